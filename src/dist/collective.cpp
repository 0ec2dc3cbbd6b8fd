#include "collective.hpp"

#include <climits>

namespace qkv::dist::detail {

void check_mpi(int code, const char* what) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw Error(std::string("qkv::dist: ") + what + " failed: " + std::string(text, length));
}

void agree_on_errors(const char* function, const std::optional<std::string>& local_error,
                     MPI_Comm comm) {
  int world = 0, rank = 0;
  check_mpi(MPI_Comm_size(comm, &world), "MPI_Comm_size");
  check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  const int mine = local_error ? rank : world;
  int first_bad = world;
  check_mpi(MPI_Allreduce(&mine, &first_bad, 1, MPI_INT, MPI_MIN, comm), "MPI_Allreduce");
  if (first_bad == world) return;
  std::string message = rank == first_bad ? *local_error : std::string();
  int length = static_cast<int>(std::min<std::size_t>(message.size(), INT_MAX));
  check_mpi(MPI_Bcast(&length, 1, MPI_INT, first_bad, comm), "MPI_Bcast");
  message.resize(static_cast<std::size_t>(length));
  check_mpi(MPI_Bcast(message.data(), length, MPI_CHAR, first_bad, comm), "MPI_Bcast");
  throw Error(std::string(function) + ": rank " + std::to_string(first_bad) + ": " + message);
}

std::vector<std::vector<int64_t>> allgather_values(const std::vector<int64_t>& values,
                                                   MPI_Comm comm) {
  int world = 0;
  check_mpi(MPI_Comm_size(comm, &world), "MPI_Comm_size");
  const int count = static_cast<int>(values.size());
  std::vector<int64_t> all(values.size() * static_cast<std::size_t>(world));
  check_mpi(MPI_Allgather(values.data(), count, MPI_INT64_T, all.data(), count, MPI_INT64_T, comm),
            "MPI_Allgather");
  std::vector<std::vector<int64_t>> by_rank;
  for (int r = 0; r < world; ++r)
    by_rank.emplace_back(all.begin() + r * count, all.begin() + (r + 1) * count);
  return by_rank;
}

}  // namespace qkv::dist::detail
