// Whether OpenBLAS runs its slowest kernels on a CPU that has faster ones, and which
// OPENBLAS_CORETYPE would choose those (see faster_blas_coretype in qkv/nn/threads.hpp).
#pragma once

#include <string>
#include <string_view>

namespace qkv::nn::detail {

struct CpuVectorFeatures {
  bool avx512 = false;    // AVX-512 F, BW, VL and DQ: OpenBLAS's SkylakeX kernels
  bool avx2_fma = false;  // AVX2 and FMA: its Haswell kernels
};

CpuVectorFeatures cpu_vector_features();

// `chosen`: the kernels OpenBLAS picked when it loaded (openblas_get_corename());
// `user_set`: OPENBLAS_CORETYPE was in the environment then (the user's choice stands).
// Returns "SkylakeX" or "Haswell" when OpenBLAS fell back to its SSE3 "Prescott"
// kernels on a CPU that runs those, else "".
std::string faster_coretype(std::string_view chosen, bool user_set, CpuVectorFeatures cpu);

}  // namespace qkv::nn::detail
