// Sparse attention on the cpu backend (qkv/sparse.hpp): each query row's attended keys
// (core/key_selection.hpp) gathered into blocks that the split-K schedule's register
// tiles compute (cpu/decode_tiles-inl.h), the query heads of a GQA group sharing each
// gathered block. fp32 arithmetic; storage float, bfloat16 or float16 (widened exactly,
// rounded once on store). Results are bitwise identical for every thread count.
#pragma once

#include "core/key_selection.hpp"
#include "cpu/simd_target.hpp"  // the entry points apply QKV_SIMD_TARGET themselves

namespace qkv::cpu {

void sparse_forward(const detail::SparseForwardProblem<float>& problem);
void sparse_forward(const detail::SparseForwardProblem<bfloat16>& problem);
void sparse_forward(const detail::SparseForwardProblem<float16>& problem);
void sparse_backward(const detail::SparseBackwardProblem<float>& problem);
void sparse_backward(const detail::SparseBackwardProblem<bfloat16>& problem);
void sparse_backward(const detail::SparseBackwardProblem<float16>& problem);

}  // namespace qkv::cpu
