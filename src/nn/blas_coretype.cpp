// OpenBLAS (DYNAMIC_ARCH, as Debian builds it) chooses its kernels once, from the CPU
// model, when it loads. A release older than the CPU does not know the model and falls
// back to its SSE3 "Prescott" kernels: on one Xeon of this project (family 6, model 207)
// OpenBLAS 0.3.21 does, and its sgemm then runs at ~16 GFLOP/s instead of ~115 with the
// AVX-512 ones. The documented way to choose is the OPENBLAS_CORETYPE environment
// variable, read when the library loads; a process that finds the fallback can only act
// on it by starting again with the variable set (the `qkv` command does, cli/main.cpp).
#include "blas_coretype.hpp"

namespace qkv::nn::detail {

CpuVectorFeatures cpu_vector_features() {
  CpuVectorFeatures cpu;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  cpu.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  cpu.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return cpu;
}

std::string faster_coretype(std::string_view chosen, bool user_set, CpuVectorFeatures cpu) {
  if (user_set || chosen != "Prescott") return "";
  if (cpu.avx512) return "SkylakeX";
  if (cpu.avx2_fma) return "Haswell";
  return "";
}

}  // namespace qkv::nn::detail
