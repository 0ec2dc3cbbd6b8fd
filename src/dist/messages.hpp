// Non-blocking point-to-point transfers of float buffers of any length: MPI counts are
// int, so a buffer longer than kMaxMessage floats goes as several messages with the same
// tag, which MPI delivers in order between one pair of ranks.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <vector>

namespace qkv::dist::detail {

inline constexpr int64_t kMaxMessage = int64_t{1} << 28;  // floats: 1 GiB per message

// Message tags, one per kind of traffic, so K/V and gradient messages never match each
// other's receives.
inline constexpr int kTagKeysValues = 7101;
inline constexpr int kTagGradients = 7102;

void post_send(const float* data, int64_t count, int peer, int tag, MPI_Comm comm,
               std::vector<MPI_Request>& requests);
void post_recv(float* data, int64_t count, int peer, int tag, MPI_Comm comm,
               std::vector<MPI_Request>& requests);

// Waits for every request and clears the list.
void wait_all(std::vector<MPI_Request>& requests);

// Lets MPI move pending messages while we compute (OpenMPI progresses rendezvous
// transfers only inside MPI calls); completes nothing we rely on.
void poke_progress(std::vector<MPI_Request>& requests);

}  // namespace qkv::dist::detail
