// Sparse attention's pair step (sparse_forward.cpp): one gathered block of listed keys
// against the few query heads of a GQA group (fewer than 16: groups of 16+ take latent
// decode's column step), on AVX512-BF16's vdpbf16ps. Where the column step puts the heads
// in the lanes, a group of 4 would fill a quarter of them; here the lanes run along the
// head dimension (the scores, summed across lanes by a transpose-add tree) and along
// the value columns (P·V over pairs of keys), so every lane works for any group size.
// Plain functions with their own target attribute (as bf16_dot.hpp), called only where
// dot_products.hpp reports the unit; not compiled in on other architectures.
#pragma once

#include <cstddef>
#include <cstdint>

#include "qkv/half.hpp"

namespace qkv::cpu::bf16dot {

// scores[r·ld + t] = scale·Σ_c q_r[c]·k_t[c] for r < rows, t < keys (a multiple of 16:
// a gathered block padded with its last key), q_r at q + r·d, k_t the row k[t]; d a
// multiple of 32. The products of two bfloat16 values are exact; the sums are float32,
// each key's over the lanes of its chunks, then a fixed tree across lanes.
void GroupScores(const bfloat16* q, std::size_t rows, const bfloat16* const* k, std::size_t keys, std::size_t d,
                 float scale, float* scores, std::size_t ld);

// acc_r = acc_r·alpha_r + Σ_{t < keys} bf16(P_rt)·v_t for r < rows (acc_r at acc + r·acc_ld),
// columns < dv (a multiple of 32); P_r at p + r·p_ld, readable up to round_up(keys, 16)
// (entries past keys are never used: an odd block's last pair takes a zero partner, not
// the padding's row). Each P is rounded to bfloat16 once (the Precision::fast contract,
// as every peer rounds it); products exact, the block's sum float32 from zero, then added.
// pairs: scratch of group_value_words(rows, keys) words.
void GroupValues(const float* p, std::size_t p_ld, std::size_t rows, std::size_t keys, const bfloat16* const* v,
                 std::size_t dv, std::uint32_t* pairs, float* acc, std::size_t acc_ld, const float* alpha);

// The scratch GroupValues needs for rows × keys: each row's weights in pairs.
constexpr std::size_t group_value_words(std::size_t rows, std::size_t keys) { return rows * ((keys + 31) / 32 * 16); }

}  // namespace qkv::cpu::bf16dot
