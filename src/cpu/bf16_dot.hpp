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

// Scratch of RescaleAddWeighted: pairs of P (⌈keys/2⌉ × pair_ld(count)) and of V
// (⌈keys/2⌉ × pair_ld(dv)).
struct PvScratch {
  std::uint32_t* p_pairs;
  std::uint32_t* v_pairs;
};

// acc_i = acc_i·alpha_i + Σ_j P_ij·v_j for i < count (columns < dv), P read from Pᵀ (pt
// row j at pt + j·pt_ld, columns < count): the forward's online-softmax update, the
// block's sum from zero (alpha null: acc_i + Σ). P enters as one bfloat16 term, bf16(P)
// rounded to nearest even, as PyTorch's, oneDNN's, SGLang's and vLLM's CPU kernels and
// FlashAttention round it: the Precision::fast contract (within 2× PyTorch's bf16 error,
// docs/numerics.md). The sums stay float32.
void RescaleAddWeighted(const float* pt, std::size_t pt_ld, std::size_t count, std::size_t keys,
                        const bfloat16* v, std::int64_t v_row, std::size_t dv, PvScratch scratch,
                        float* acc, std::size_t acc_ld, const float* alpha);

// The same with V's pairs already packed (PackRowPairs's layout, v_ld words a pair row,
// ⌈keys/2⌉ rows): the forward packs each key block's V once per call when several query
// blocks read it, and the backward's dQ = dS·K takes K's pairs packed once per key block.
// p_pairs: ⌈keys/2⌉ × pair_ld(count) words of scratch.
void AddWeightedPairs(const float* pt, std::size_t pt_ld, std::size_t count, std::size_t keys,
                      const std::uint32_t* v_pairs, std::size_t v_ld, std::size_t dv, std::uint32_t* p_pairs,
                      float* acc, std::size_t acc_ld, const float* alpha);

// The pieces the backward composes (backward.cpp): packings into pairs and one product.
//
// How many bfloat16 terms a float operand is split into: one (bf16(x), 2⁻⁹ of x lost)
// or two (hi + lo as above, ~2⁻¹⁶ lost). A two-term buffer holds hi's words, then lo's
// words `terms_at` words further on.
enum class Terms { one = 1, two = 2 };

// out[c][x] = (r_2c[x], r_2c+1[x]) for c < ⌈count/2⌉, x < out_ld (0 past n, and for an
// odd count's last partner): bfloat16 rows (row i at rows + i·row_stride) paired across
// rows, the right operand of a product that sums over those rows.
void PackRowPairs(const bfloat16* rows, std::int64_t row_stride, std::size_t count, std::size_t n,
                  std::uint32_t* out, std::size_t out_ld);

// Float rows (row r at t + r·t_ld, columns < n) as bfloat16 pairs along each row:
// out[r·out_ld + c] = (t_r[2c], t_r[2c+1]) for c < ⌈n/2⌉ (an odd n's partner 0). The
// second term (Terms::two) at out + rows·out_ld.
void PairsAlongRows(const float* t, std::size_t t_ld, std::size_t rows, std::size_t n, Terms terms,
                    std::uint32_t* out, std::size_t out_ld);

// Float rows paired across rows: out[c·out_ld + i] = (t_2c[i], t_2c+1[i]) for c <
// ⌈rows/2⌉, i < n (0 up to round_up(n, 16), and an odd row count's partner); the second
// term at out + ⌈rows/2⌉·out_ld.
void PairsAcrossRows(const float* t, std::size_t t_ld, std::size_t rows, std::size_t n, Terms terms,
                     std::uint32_t* out, std::size_t out_ld);

// The left operand of AddProduct: word (r, c) at words[r·row_step + c·pair_step] (pairs
// along rows: row_step = ld, pair_step = 1; across rows: row_step = 1, pair_step = ld),
// with `terms` terms, the second at words + terms_at.
struct LeftPairs {
  const std::uint32_t* words;
  std::size_t row_step, pair_step;
  Terms terms = Terms::one;
  std::size_t terms_at = 0;
};

// c_r += Σ_k a(r, k)·b_k for r < rows, columns < n (c row r at c + r·c_ld), the sum over
// `pairs` pairs of the left operand (each term's products added in turn) and the rows of
// b (pair-major, b_ld ≥ n words apart) summed from zero before it is added.
void AddProduct(const LeftPairs& a, std::size_t rows, std::size_t pairs, const std::uint32_t* b,
                std::size_t b_ld, std::size_t n, float* c, std::size_t c_ld);

}  // namespace qkv::cpu::bf16dot
