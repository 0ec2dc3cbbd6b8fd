#include "messages.hpp"

#include <algorithm>

#include "collective.hpp"

namespace qkv::dist::detail {

void post_send(const float* data, int64_t count, int peer, int tag, MPI_Comm comm,
               std::vector<MPI_Request>& requests) {
  for (int64_t begin = 0; begin < count; begin += kMaxMessage) {
    const int piece = static_cast<int>(std::min(kMaxMessage, count - begin));
    MPI_Request request = MPI_REQUEST_NULL;
    check_mpi(MPI_Isend(data + begin, piece, MPI_FLOAT, peer, tag, comm, &request), "MPI_Isend");
    requests.push_back(request);
  }
}

void post_recv(float* data, int64_t count, int peer, int tag, MPI_Comm comm,
               std::vector<MPI_Request>& requests) {
  for (int64_t begin = 0; begin < count; begin += kMaxMessage) {
    const int piece = static_cast<int>(std::min(kMaxMessage, count - begin));
    MPI_Request request = MPI_REQUEST_NULL;
    check_mpi(MPI_Irecv(data + begin, piece, MPI_FLOAT, peer, tag, comm, &request), "MPI_Irecv");
    requests.push_back(request);
  }
}

void wait_all(std::vector<MPI_Request>& requests) {
  if (requests.empty()) return;
  check_mpi(MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE),
            "MPI_Waitall");
  requests.clear();
}

void poke_progress(std::vector<MPI_Request>& requests) {
  if (requests.empty()) return;
  int done = 0;
  check_mpi(MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done,
                        MPI_STATUSES_IGNORE),
            "MPI_Testall");
  if (done) requests.clear();
}

}  // namespace qkv::dist::detail
