// Collective agreement on errors, so that a bad argument on one rank makes every rank
// throw the same qkv::Error instead of leaving the others waiting in the ring forever.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "qkv/error.hpp"

namespace qkv::dist::detail {

// Every rank passes its own verdict (nullopt: its arguments are fine). If any rank
// failed, every rank throws Error("<function>: rank R: <message>") for the lowest
// failing rank R. Collective over comm.
void agree_on_errors(const char* function, const std::optional<std::string>& local_error,
                     MPI_Comm comm);

// Runs `check` (which throws qkv::Error on bad input) and returns its message, if any.
template <class Check>
std::optional<std::string> error_of(Check&& check);

// Every rank's `values` (all ranks pass the same count), rank by rank. Collective.
std::vector<std::vector<int64_t>> allgather_values(const std::vector<int64_t>& values,
                                                   MPI_Comm comm);

// Checks an MPI return code; MPI's default handler aborts before we see a failure, but a
// communicator with MPI_ERRORS_RETURN would hand us one.
void check_mpi(int code, const char* what);

}  // namespace qkv::dist::detail

template <class Check>
std::optional<std::string> qkv::dist::detail::error_of(Check&& check) {
  try {
    check();
  } catch (const qkv::Error& error) {
    return std::string(error.what());
  }
  return std::nullopt;
}
