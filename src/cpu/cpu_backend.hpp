// The fused CPU backend (fp32 arithmetic): FlashAttention-2 style forward and backward (tiled, online
// softmax, no Nq×Nk buffer), SIMD through Highway with runtime dispatch, OpenMP threads.
// Results are bitwise identical for every thread count: each output block has exactly
// one writer and is computed the same way whichever thread runs it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/problem.hpp"

namespace qkv::cpu {

// Storage: float, bfloat16 or float16 (widened to float inside, rounded once on store).
void forward(const detail::ForwardProblem<float>& problem);
void forward(const detail::ForwardProblem<bfloat16>& problem);
void forward(const detail::ForwardProblem<float16>& problem);
void backward(const detail::BackwardProblem<float>& problem);
void backward(const detail::BackwardProblem<bfloat16>& problem);
void backward(const detail::BackwardProblem<float16>& problem);

// out[i] = e^x[i] through the kernels' own vector exp (ExpKeepNaN), on the SIMD target
// the next call will use: for tests of its accuracy and special values.
void softmax_exp(const float* x, float* out, std::size_t count);

// Environment variable QKV_SIMD_TARGET (e.g. AVX2, case-insensitive): run the kernels on
// that compiled target instead of the best one the CPU has — for measuring a lower
// target on a newer machine, like PyTorch's ATEN_CPU_CAPABILITY. Read once, at the first
// kernel call; a name this build or CPU lacks makes every call throw qkv::Error. The
// kernel entry points call it themselves.
void apply_simd_target_override();

// Name of the SIMD target the next call will use (e.g. "AVX3", "AVX2"), for benchmarks
// and tests.
const char* simd_target_name();

// The Highway targets compiled into qkv that this CPU supports, best first; tests run
// every one of them through hwy::SetSupportedTargetsForTest.
std::vector<int64_t> compiled_simd_targets();

}  // namespace qkv::cpu
