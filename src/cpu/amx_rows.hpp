// The forward's products on the AMX tiles in the row layout of PyTorch's and SGLang's CPU
// flash attention: scores S = Q·Kᵀ and weights P stay query-major (a row per query, the
// keys along it), so that P is the tiles' left operand as it stands — no transposition —
// and one product spans up to kSpanKeys keys, loading and storing the accumulator's tiles
// once per span instead of once per 64-key block. K is packed once per call into pairs
// along d (the tiles' right operand); V's pairs are bf16dot::PackRowPairs's layout.
//
// Same arithmetic contract as amx_dot.hpp (products of two bfloat16 values exact in
// float32, summed in float32 in the unit's fixed order; P rounded to bfloat16 once): the
// scores are bitwise those of amx::ScoresTransposed (the same pairs summed in the same
// order, the operands' roles swapped), so the backward's recomputed scores agree.
// Plain functions with their own target attribute; called only where amx::available().
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu/amx_tiles.hpp"
#include "qkv/half.hpp"

namespace qkv::cpu::amx {

constexpr std::size_t kKeyBlock = 64;   // keys of a packed K block (the forward's kBlockKeys)
constexpr std::size_t kSpanKeys = 512;  // keys of one span: scores, weights and one P·V reduction
constexpr std::size_t kMaxQueries = 64; // rows of a span (the forward's kBlockQueries)

// Values of a packed query row: d rounded up to whole tiles (32 values).
constexpr std::size_t query_ld(std::size_t d) { return (d + 31) / 32 * 32; }
// Words of one packed key block: query_ld(d)/2 pair rows of kKeyBlock keys.
constexpr std::size_t key_block_words(std::size_t d) { return query_ld(d) / 2 * kKeyBlock; }

// Pair (k_j[2c], k_j[2c+1]) of keys j < keys ≤ kKeyBlock, c < query_ld(d)/2, into `out` in the
// tiles' own order: the 16 × 16 tile of pair rows [16a, 16a + 16) and keys [16t, 16t + 16)
// is contiguous, tile (a, t) at word (4a + t)·256, its row c − 16a at 16 words a row.
// Zero past the keys and past d (k_j row at k + j·k_row).
void PackKeyPairs(const bfloat16* k, std::int64_t k_row, std::size_t keys, std::size_t d, std::uint32_t* out);

// out[r·query_ld(d) + c] = q_r[c] for rows r < rows ≤ kMaxQueries, zero past d and in the
// rows up to a multiple of 16.
void PackQueryRows(const bfloat16* q, std::int64_t q_row, std::size_t rows, std::size_t d, std::uint16_t* out);

// One span of keys for a block of query rows.
struct Span {
  const std::uint16_t* q;  // the rows' Q (PackQueryRows)
  std::size_t count, d;    // rows ≤ kMaxQueries; head dim
  // key j < keys ≤ kSpanKeys in the packed block k_blocks + (j / kKeyBlock)·key_block_words(d)
  // (a span's blocks are consecutive; zero past the keys)
  const std::uint32_t* k_blocks;
  std::size_t keys;
  // V's pairs (bf16dot::PackRowPairs: v_ld words a pair row, a multiple of 16; rows up to
  // round_up(keys, 32)/2 readable, zero past the keys), dv values
  const std::uint32_t* v_pairs;
  std::size_t v_ld, dv;
  const std::int32_t* lo;  // per row: its keys are [lo_i, hi_i) of [0, keys)
  const std::int32_t* hi;
  float scale;  // > 0
  // float8 caches (decode_latent-inl.h): per key j < keys, a factor on its scores (the
  // keys' row scale, S_ij·ks_j before the softmax) and one on its weights before they are
  // rounded to bfloat16 (the values', P_ij·vs_j; l sums P_ij); null: none.
  const float* key_scales = nullptr;
  const float* value_scales = nullptr;
};

// Per-thread scratch: S (kMaxQueries rows, s_ld floats apart, s_ld ≥ kSpanKeys) and bf16(P)
// (kMaxQueries rows, p_ld values apart, p_ld ≥ kSpanKeys).
struct SpanScratch {
  float* s;
  std::size_t s_ld;
  std::uint16_t* p;
  std::size_t p_ld;
};

// The rows' online-softmax state: m, l, alpha per row, and acc (rows acc_ld floats apart,
// a multiple of 16; rows up to round_up(count, 16), columns up to round_up(dv, 16)).
struct RowState {
  float* m;
  float* l;
  float* alpha;
  float* acc;
  std::size_t acc_ld;
};

// One span's step of the forward for rows i < count:
//   S = Q·K_spanᵀ (tiles; unscaled float32 sums)
//   m' = max(m, scale·max_j S_ij) over the row's keys,  P = e^(scale·S − m'),
//   l = l·e^(m − m') + Σ_j P,  acc = acc·e^(m − m') + bf16(P)·V_span (tiles, onto acc)
// P is rounded to bfloat16 once, to nearest even (the Precision::fast contract; l sums P
// before rounding, as the peers do); e^x is computed as 2^(log2(e)·x), within ~1 float
// ulp. A row with no key yet keeps m = −inf, l = 0. Rows past count and acc's columns past
// dv come back unchanged. The three phases run one after the other: interleaving one half
// of the rows' tile products with the other half's softmax, in the hope that the tile unit
// and the vector units would overlap, measured 7–10% slower (Emerald Rapids VM, 64 × 512
// spans, d 64 and 128).
void AttendSpan(const Span& span, const SpanScratch& scratch, const RowState& state);

}  // namespace qkv::cpu::amx
