#include "faster_blas.hpp"

#include <unistd.h>

#include <cstdlib>
#include <string>

#include "qkv/nn/threads.hpp"

namespace qkv::cli {

void restart_for_faster_blas(char** argv) {
  const std::string coretype = nn::faster_blas_coretype();
  if (coretype.empty()) return;
  // The restarted process finds the variable set and never restarts again.
  if (::setenv("OPENBLAS_CORETYPE", coretype.c_str(), 1) != 0) return;
  ::execv("/proc/self/exe", argv);
  ::unsetenv("OPENBLAS_CORETYPE");  // exec failed (no /proc?): carry on as we are
}

}  // namespace qkv::cli
