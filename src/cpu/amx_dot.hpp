// The bfloat16 block products of bf16_dot.hpp on Intel's AMX tiles (AMX-BF16, Sapphire
// Rapids and later): tdpbf16ps multiplies a 16 × 32 bf16 tile by a 32 × 16 one (pairs,
// the layout of bf16_dot.hpp) into a 16 × 16 float32 tile, 8192 multiply-adds an
// instruction — 1–2.3 TFLOP/s a core on the Xeon VM of bench/RESULTS.md §10g, 6–15× its
// fp32 FMAs, where vdpbf16ps runs at half of them. Same operands, same contract as bf16_dot.hpp:
// products of two bfloat16 values are exact in float32 and summed in float32 (in the
// unit's own order, fixed by the shape: results never depend on threads), bf16 inputs
// that are subnormal count as 0 (as vdpbf16ps does), and P (and in the backward P and
// dS) enters as one bfloat16 term, rounded once (the Precision::fast contract). What differs is only the order of the float32 sums, so a call that takes AMX
// for its forward must take it for its backward's recomputed scores too (forward.cpp and
// backward.cpp decide once per call from dot_products.hpp's bf16_unit).
//
// Plain functions with their own target attribute (amx-tile, amx-bf16, avx512-bf16 for
// the packing), compiled for x86-64 only and called only where dot_products.cpp found
// the tiles and the OS granted them to the process (amx_tiles.hpp). Each call loads its
// tile configuration and releases the tiles before it returns, unless a TileScope holds
// them, so other AMX users in the process (oneDNN under PyTorch) find the state they expect.
// Partial tiles (fewer than 16 rows or 32 reduction elements left) are copied into
// zero-padded scratch; whole ones are loaded in place.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu/amx_tiles.hpp"
#include "cpu/bf16_dot.hpp"

namespace qkv::cpu::amx {

// As bf16dot::ScoresTransposed: Sᵀ[j, i] = scale · Σ_c k_j[c]·q_i[c], j < keys, i < width.
void ScoresTransposed(const bfloat16* k, std::int64_t k_row, std::size_t keys, std::size_t d,
                      const std::uint32_t* qp, std::size_t q_ld, std::size_t width, float scale,
                      float* st, std::size_t st_ld);

// As bf16dot::RescaleAddWeighted: acc_i = acc_i·alpha_i + Σ_j P_ij·v_j, P as one bfloat16
// term (the Precision::fast contract; scratch.v_pairs holds V's pairs; scratch.p_pairs is not used: P's terms are
// transposed into this thread's own tile scratch). Where acc_ld is a multiple of 16, the
// sum is added onto acc in the tiles (acc's rows with alpha_i ≠ 1 scaled first, then
// rounded again by each addition: the fast contract's float32 sums, in another order),
// and acc must have rows up to round_up(count, 16): rows past count and columns past dv
// come back unchanged. Otherwise acc·alpha + Σ is rounded once, as bf16dot does. Any
// count; keys ≤ 128.
void RescaleAddWeighted(const float* pt, std::size_t pt_ld, std::size_t count, std::size_t keys,
                        const bfloat16* v, std::int64_t v_row, std::size_t dv, bf16dot::PvScratch scratch,
                        float* acc, std::size_t acc_ld, const float* alpha);

// The same with V's pairs already packed (bf16dot::PackRowPairs's layout, v_ld words a
// pair row, rows (keys + 1)/2 .. 32 zero): the forward packs each key block's V once per
// call when several query blocks read it, instead of once per (query block, key block).
// acc as above.
void AddWeightedPairs(const float* pt, std::size_t pt_ld, std::size_t count, std::size_t keys,
                      const std::uint32_t* v_pairs, std::size_t v_ld, std::size_t dv, float* acc,
                      std::size_t acc_ld, const float* alpha);

// As bf16dot::AddProduct for a left operand paired along its rows (a.pair_step == 1, as
// the backward's dK = dSᵀ·Q has it): c_r += Σ_k a(r, k)·b_k. Where c_ld is a multiple
// of 16 the sum goes onto c in the tiles (as AddWeightedPairs's acc: c must have rows up
// to round_up(rows, 16), and rows past `rows` and columns past n take A's zeros times B,
// so they hold NaN after an Inf in B: scratch rows only); otherwise it is summed from
// zero first and added.
void AddProduct(const bf16dot::LeftPairs& a, std::size_t rows, std::size_t pairs, const std::uint32_t* b,
                std::size_t b_ld, std::size_t n, float* c, std::size_t c_ld);

}  // namespace qkv::cpu::amx
