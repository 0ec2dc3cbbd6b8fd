// The forward's block products on AVX512-BF16 (vdpbf16ps: 32 bf16 multiply-adds per
// instruction, pairs of exact products summed into float32 lanes). Plain functions with
// their own target attribute, not Highway code: Highway 1.0.3 has no bf16 dot. Called
// only when dot_products.hpp says so (this CPU has the unit and the call's precision
// allows it); on other architectures they are not compiled in and never called.
//
// Operands are "pairs": 32-bit words holding two bfloat16 values, the even index in the
// low half — the layout vdpbf16ps multiplies. A pair buffer's leading dimension is a
// multiple of 16 words (one zmm). An odd reduction length is padded with a zero half
// (the pair's partner is 0, never a value read past the row), so any head dim works.
#pragma once

#include <cstddef>
#include <cstdint>

#include "qkv/half.hpp"

namespace qkv::cpu::bf16dot {

// Words of a pair buffer row holding n values (rounded up to whole zmm).
constexpr std::size_t pair_ld(std::size_t n) { return (n + 15) / 16 * 16; }

// qp[c][i] = (q_i[2c], q_i[2c+1]) for i < count, c < ⌈d/2⌉ (leading dimension q_ld ≥
// count, a multiple of 16; columns count..q_ld are zero). Q itself, unscaled: the
// products of two bfloat16 values are exact in float32, scale·q would not be.
void PackQueryPairs(const bfloat16* q, std::int64_t q_row, std::size_t count, std::size_t d,
                    std::uint32_t* qp, std::size_t q_ld);

// Sᵀ[j, i] = scale · Σ_c k_j[c]·q_i[c] for j < keys, i < width (st row j at st + j·st_ld;
// nothing past column width is written), from qp of PackQueryPairs.
void ScoresTransposed(const bfloat16* k, std::int64_t k_row, std::size_t keys, std::size_t d,
                      const std::uint32_t* qp, std::size_t q_ld, std::size_t width, float scale,
                      float* st, std::size_t st_ld);

// Scratch of RescaleAddWeighted: pairs of P's two bfloat16 terms (2 × ⌈keys/2⌉ ×
// pair_ld(count)) and of V (⌈keys/2⌉ × pair_ld(dv)).
struct PvScratch {
  std::uint32_t* p_pairs;
  std::uint32_t* v_pairs;
};

// acc_i = acc_i·alpha_i + Σ_j P_ij·v_j for i < count (columns < dv), P read from Pᵀ (pt
// row j at pt + j·pt_ld, columns < count): the forward's online-softmax update, the
// block's sum from zero. P enters as hi + lo, two bfloat16 terms (hi = bf16(P), lo =
// bf16(P − hi)), so the products lose ~2⁻¹⁶ of P instead of bf16's 2⁻⁹.
void RescaleAddWeighted(const float* pt, std::size_t pt_ld, std::size_t count, std::size_t keys,
                        const bfloat16* v, std::int64_t v_row, std::size_t dv, PvScratch scratch,
                        float* acc, std::size_t acc_ld, const float* alpha);

}  // namespace qkv::cpu::bf16dot
