// The fused CPU backend (fp32 arithmetic): FlashAttention-2 style forward and backward (tiled, online
// softmax, no Nq×Nk buffer), SIMD through Highway with runtime dispatch, OpenMP threads.
// Results are bitwise identical for every thread count: each output block has exactly
// one writer and is computed the same way whichever thread runs it.
#pragma once

#include <cstddef>

#include "core/problem.hpp"
#include "cpu/simd_target.hpp"  // the entry points apply QKV_SIMD_TARGET themselves

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

}  // namespace qkv::cpu
