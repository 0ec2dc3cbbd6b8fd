// Sparse attention on the cpu backend (qkv/sparse.hpp): each query row's attended keys
// (core/key_selection.hpp) gathered into blocks that the split-K schedule's register
// tiles compute (cpu/decode_tiles-inl.h), the query heads of a GQA group sharing each
// gathered block. fp32 arithmetic; storage float, bfloat16 or float16 (widened exactly,
// rounded once on store); bfloat16 on vdpbf16ps takes the pair step in both passes, any
// group (sparse_pair_step), and groups of 16+ heads on the AMX tiles their column step
// (sparse_dot_unit). Results are bitwise identical for every thread count.
#pragma once

#include <type_traits>

#include "core/key_selection.hpp"
#include "cpu/dot_products.hpp"
#include "cpu/simd_target.hpp"  // the entry points apply QKV_SIMD_TARGET themselves

namespace qkv::cpu {

// The bf16 unit both passes take for bfloat16 storage (fp32_fma: none): vdpbf16ps or the
// AMX tiles where the call's precision picks one, for groups of whole vectors of query
// heads (≥ 16: DeepSeek's MQA/MLA mode, where each gathered key feeds enough rows to make
// the dot products pay) without a modifier the transposed scores skip (soft-cap, ALiBi,
// score_mod). One rule for the forward and the backward, so that the backward's logits
// are the forward's (both take sparse_pair_step instead where it applies). May throw
// (QKV_DOT_PRODUCTS=on without the unit): call it before a parallel region.
// T: the storage type (any but bfloat16 takes none).
template <class T>
Bf16Unit sparse_dot_unit(const detail::Extents& e, const detail::ScoreModifiers& mods, Precision precision) {
  if constexpr (!std::is_same_v<T, bfloat16>) {
    return Bf16Unit::fp32_fma;
  } else {
    const bool eligible = e.group() % 16 == 0 && mods.softcap == 0.0f && !mods.has_alibi() && !mods.has_score_mod();
    return eligible ? bf16_unit(precision) : Bf16Unit::fp32_fma;
  }
}

// The forward's pair step (bf16_group_block.hpp) for bfloat16 on vdpbf16ps, where the
// call's precision picks that unit (AMD's AVX512-BF16; not the AMX tiles, where groups of
// 16+ take sparse_dot_unit's tiles and smaller ones the float step: a group of 4 would
// fill 4 of a tile's 16 rows), any group size, d and dv whole 32-value chunks. It takes
// the forward from sparse_dot_unit's column step there: its rows sweep the tile's ranges
// like the float step's (the MLA shape at N 8192, 2 threads, a Zen 5: 1.45–1.50 →
// 1.09–1.22 s; at 32768 8.9 → 5.7 s). The backward takes it too (S, dP and dQ's product;
// dK and dV float32), so its logits are the forward's bit for bit: exact products summed
// in float32. P is rounded to bfloat16 once for P·V and dS once for dQ, the
// Precision::fast contract. May throw as sparse_dot_unit does.
template <class T>
bool sparse_pair_step(const detail::Extents& e, Precision precision) {
  if constexpr (!std::is_same_v<T, bfloat16>) {
    return false;
  } else {
    return e.head_dim % 32 == 0 && e.v_dim % 32 == 0 && bf16_unit(precision) == Bf16Unit::avx512_bf16;
  }
}

void sparse_forward(const detail::SparseForwardProblem<float>& problem);
void sparse_forward(const detail::SparseForwardProblem<bfloat16>& problem);
void sparse_forward(const detail::SparseForwardProblem<float16>& problem);
void sparse_backward(const detail::SparseBackwardProblem<float>& problem);
void sparse_backward(const detail::SparseBackwardProblem<bfloat16>& problem);
void sparse_backward(const detail::SparseBackwardProblem<float16>& problem);

}  // namespace qkv::cpu
