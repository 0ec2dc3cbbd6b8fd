#include "load_time_environment.hpp"

#include <unistd.h>

#include <cstdlib>
#include <string>

#include "qkv/nn/threads.hpp"

namespace qkv::cli {

void restart_with_load_time_environment(char** argv) {
  const std::string coretype = nn::faster_blas_coretype();
  const bool set_coretype = !coretype.empty();
  const bool set_wait_policy = std::getenv("OMP_WAIT_POLICY") == nullptr;
  if (!set_coretype && !set_wait_policy) return;
  // The restarted process finds both set (faster_blas_coretype is empty once
  // OPENBLAS_CORETYPE is) and never restarts again.
  if (set_coretype && ::setenv("OPENBLAS_CORETYPE", coretype.c_str(), 1) != 0) return;
  if (set_wait_policy && ::setenv("OMP_WAIT_POLICY", "passive", 1) != 0) return;
  ::execv("/proc/self/exe", argv);
  // exec failed (no /proc?): carry on as we are.
  if (set_coretype) ::unsetenv("OPENBLAS_CORETYPE");
  if (set_wait_policy) ::unsetenv("OMP_WAIT_POLICY");
}

}  // namespace qkv::cli
