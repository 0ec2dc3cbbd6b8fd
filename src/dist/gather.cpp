// gather_sequence: every rank's shard back into the global sequence, on every rank.
#include <climits>
#include <numeric>
#include <string>
#include <vector>

#include "blocks.hpp"
#include "check/checker.hpp"
#include "collective.hpp"
#include "qkv/dist.hpp"

namespace qkv::dist {

Tensor<float, 4> gather_sequence(View4<const float> local, MPI_Comm comm, Sharding sharding) {
  constexpr const char* kFunction = "qkv::dist::gather_sequence";
  if (comm == MPI_COMM_NULL) throw Error(std::string(kFunction) + ": comm: MPI_COMM_NULL");
  detail::agree_on_errors(kFunction, detail::error_of([&] {
                            qkv::detail::Checker(kFunction).expect_well_formed(
                                qkv::detail::describe("local", local));
                          }),
                          comm);
  const auto all = detail::allgather_values({local.shape[0], local.shape[1], local.shape[2], local.shape[3]}, comm);
  const int world = static_cast<int>(all.size());
  int rank = 0;
  detail::check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  int64_t length = 0;
  for (const auto& r : all) length += r[1];
  const char* names[] = {"batch", "seq", "heads", "dim"};
  for (int r = 0; r < world; ++r) {
    for (int axis : {0, 2, 3}) {
      if (all[r][axis] != all[0][axis]) {
        throw Error(std::string(kFunction) + ": rank " + std::to_string(r) + ": local.shape[" +
                    std::to_string(axis) + "] (" + names[axis] + ") is " + std::to_string(all[r][axis]) +
                    ", rank 0's is " + std::to_string(all[0][axis]));
      }
    }
    const int64_t expected = shard_length(length, world, r, sharding);
    if (all[r][1] != expected) {
      throw Error(std::string(kFunction) + ": rank " + std::to_string(r) + " holds " +
                  std::to_string(all[r][1]) + " rows, but its shard of " + std::to_string(length) +
                  " rows has " + std::to_string(expected));
    }
  }
  const int64_t batch = local.shape[0], heads = local.shape[2], dim = local.shape[3];
  const int64_t per_row = batch * heads * dim;
  if (per_row * length > INT_MAX) {
    throw Error(std::string(kFunction) + ": the global tensor has more than INT_MAX elements");
  }
  // Each rank's shard, packed contiguous, one after the other.
  std::vector<int> counts(world), displacements(world);
  for (int r = 0; r < world; ++r) {
    counts[r] = static_cast<int>(per_row * all[r][1]);
    displacements[r] = r == 0 ? 0 : displacements[r - 1] + counts[r - 1];
  }
  std::vector<float> packed(static_cast<std::size_t>(per_row * local.shape[1]));
  detail::copy_into(local, View4<float>::contiguous(packed.data(), local.shape));
  std::vector<float> everything(static_cast<std::size_t>(per_row * length));
  detail::check_mpi(MPI_Allgatherv(packed.data(), counts[rank], MPI_FLOAT, everything.data(), counts.data(),
                                   displacements.data(), MPI_FLOAT, comm),
                    "MPI_Allgatherv");
  Tensor<float, 4> global({batch, length, heads, dim});
  for (int r = 0; r < world; ++r) {
    const auto shard = View4<const float>::contiguous(everything.data() + displacements[r],
                                                      {batch, all[r][1], heads, dim});
    unshard_into(shard, global.view(), world, r, sharding);
  }
  return global;
}

}  // namespace qkv::dist
