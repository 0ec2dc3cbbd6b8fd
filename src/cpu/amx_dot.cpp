// The AMX kernels of amx_dot.hpp (the pragma below is the target attribute on each).
//
// One product serves every function here: C (M × N float32) = Σ over the terms of A_t·B_t, A
// row-major bfloat16 (M rows × K values), B pair-major (⌈K/2⌉ rows of N words). Tiles: C in
// tmm0–3 as 2 × 2 blocks of 16 × 16, A in tmm4–5 (16 rows × 32 values), B in tmm6–7 (16
// pairs × 16 columns); each step of 32 reduction values issues 4 tdpbf16ps a term. Each
// block's C tiles are stored into this thread's scratch and the caller's epilogue takes
// what it needs from them (scale, online-softmax rescale, or a plain add) with AVX-512.
#include "cpu/amx_dot.hpp"

#if defined(__x86_64__)
// GCC 12's intrinsics build on _mm512_undefined_*(): see bf16_dot.cpp.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")

#include "cpu/avx512_transpose.hpp"

namespace qkv::cpu::amx {
namespace {

constexpr std::size_t kMaxRows = 64;     // rows of P a product takes at once (a block of queries)
constexpr std::size_t kMaxKeys = 128;    // keys of P·V (latent decode blocks are up to 96)

// A: value (r, x) at data[r·stride + x] for r < rows, x < values.
struct Left {
  const std::uint16_t* data;
  std::size_t stride;  // bfloat16 values between rows
  std::size_t rows, values;
};

// B: word (p, n) at data[p·ld + n] for p < pairs; columns up to a multiple of 16 readable.
struct Right {
  const std::uint32_t* data;
  std::size_t ld, pairs;
};

// This thread's scratch: a 2 × 2 block of C tiles (32 × 32 floats, 64-byte aligned: tile
// stores to rows that straddle cache lines made the P·V tile products ~60% slower,
// measured) and the padded copies of partial tiles.
struct Scratch {
  alignas(64) float c[2 * kTileRows * 2 * kTileWords];
  alignas(64) std::uint16_t a_tile[kTileRows * kTileValues];
  alignas(64) std::uint32_t b_tile[kTileRows * kTileWords];
  alignas(64) std::uint16_t p_terms[kMaxRows * kMaxKeys];  // bf16(P), row-major
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

constexpr std::size_t round_up(std::size_t n, std::size_t m) { return (n + m - 1) / m * m; }

__mmask16 lanes_below(std::size_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// The A tile at rows [row, row + 16), values [x, x + 32): in place when whole, else
// copied with zeros past the operand (tile loads read all 16 rows × 64 bytes).
// (The copies apart, so that the whole tiles' path inlines into the products.)
[[gnu::noinline]] const std::uint16_t* left_copy(const Left& a, std::size_t row, std::size_t x,
                                                 std::size_t& stride_bytes) {
  std::uint16_t* tile = scratch().a_tile;
  std::memset(tile, 0, sizeof scratch().a_tile);
  const std::size_t rows = a.rows > row ? std::min(kTileRows, a.rows - row) : 0;
  const std::size_t values = a.values > x ? std::min(kTileValues, a.values - x) : 0;
  for (std::size_t r = 0; r < rows; ++r)
    std::memcpy(tile + r * kTileValues, a.data + (row + r) * a.stride + x, values * sizeof(std::uint16_t));
  stride_bytes = kTileValues * sizeof(std::uint16_t);
  return tile;
}

inline const std::uint16_t* left_tile(const Left& a, std::size_t row, std::size_t x, std::size_t& stride_bytes) {
  if (row + kTileRows <= a.rows && x + kTileValues <= a.values) [[likely]] {
    stride_bytes = a.stride * sizeof(std::uint16_t);
    return a.data + row * a.stride + x;
  }
  return left_copy(a, row, x, stride_bytes);
}

[[gnu::noinline]] const std::uint32_t* right_copy(const Right& b, std::size_t pair, std::size_t column,
                                                  std::size_t& stride_bytes) {
  std::uint32_t* tile = scratch().b_tile;
  std::memset(tile, 0, sizeof scratch().b_tile);
  for (std::size_t p = pair; p < b.pairs; ++p)
    std::memcpy(tile + (p - pair) * kTileWords, b.data + p * b.ld + column, kTileWords * sizeof(std::uint32_t));
  stride_bytes = kTileWords * sizeof(std::uint32_t);
  return tile;
}

inline const std::uint32_t* right_tile(const Right& b, std::size_t pair, std::size_t column, std::size_t& stride_bytes) {
  if (pair + kTileRows <= b.pairs) [[likely]] {
    stride_bytes = b.ld * sizeof(std::uint32_t);
    return b.data + pair * b.ld + column;
  }
  return right_copy(b, pair, column, stride_bytes);
}

constexpr std::size_t kCBlockLd = 2 * kTileWords;  // floats a row of the scratch's C block

// One term of a product: A_t·B_t. Terms that share an operand (a left operand given as two
// bfloat16 terms, bf16dot::Terms::two) load it once a step: tile loads wait for the products
// still reading the tile they overwrite.
struct Term {
  Left a;
  Right b;
};

// C[m0..m0+32) × [n0..n0+32) (fewer where `two_rows` / `two_columns` say one tile) summed
// over the terms, stored at c (its top left; c_ld floats a row): onto what c holds when
// `load` (the running P·V sum, added in the tiles), else from zero (the scratch's C
// block). Tile numbers are immediates, hence the four spelled-out shapes.
template <bool kTwoRows, bool kTwoColumns>
void block(const Term* terms, std::size_t term_count, std::size_t m0, std::size_t n0, float* c, std::size_t c_ld,
           bool load) {
  const std::size_t row_bytes = c_ld * sizeof(float);
  float* const c01 = c + kTileWords;
  float* const c10 = c + kTileRows * c_ld;
  float* const c11 = c10 + kTileWords;
  if (load) {
    _tile_loadd(0, c, row_bytes);
    if constexpr (kTwoColumns) _tile_loadd(1, c01, row_bytes);
    if constexpr (kTwoRows) _tile_loadd(2, c10, row_bytes);
    if constexpr (kTwoRows && kTwoColumns) _tile_loadd(3, c11, row_bytes);
  } else {
    _tile_zero(0);
    if constexpr (kTwoColumns) _tile_zero(1);
    if constexpr (kTwoRows) _tile_zero(2);
    if constexpr (kTwoRows && kTwoColumns) _tile_zero(3);
  }
  for (std::size_t x = 0; x < terms[0].a.values; x += kTileValues) {
    std::size_t stride = 0;
    for (std::size_t t = 0; t < term_count; ++t) {
      const Left& a = terms[t].a;
      const Right& b = terms[t].b;
      const bool new_a = t == 0 || a.data != terms[t - 1].a.data, new_b = t == 0 || b.data != terms[t - 1].b.data;
      // Copies of partial tiles share one scratch tile each: load every tile right after
      // it is made.
      if (new_b) {
        _tile_loadd(6, right_tile(b, x / 2, n0, stride), stride);
        if constexpr (kTwoColumns) _tile_loadd(7, right_tile(b, x / 2, n0 + kTileWords, stride), stride);
      }
      if (new_a) _tile_loadd(4, left_tile(a, m0, x, stride), stride);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (kTwoColumns) _tile_dpbf16ps(1, 4, 7);
      if constexpr (kTwoRows) {
        if (new_a) _tile_loadd(5, left_tile(a, m0 + kTileRows, x, stride), stride);
        _tile_dpbf16ps(2, 5, 6);
        if constexpr (kTwoColumns) _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
  _tile_stored(0, c, row_bytes);
  if constexpr (kTwoColumns) _tile_stored(1, c01, row_bytes);
  if constexpr (kTwoRows) _tile_stored(2, c10, row_bytes);
  if constexpr (kTwoRows && kTwoColumns) _tile_stored(3, c11, row_bytes);
}

template <class Visit>
void for_blocks(std::size_t m, std::size_t n, Visit&& visit) {
  for (std::size_t n0 = 0; n0 < n; n0 += 2 * kTileWords) {
    const bool two_columns = n0 + kTileWords < n;
    for (std::size_t m0 = 0; m0 < m; m0 += 2 * kTileRows) visit(m0, n0, m0 + kTileRows < m, two_columns);
  }
}

void block_at(const Term* terms, std::size_t term_count, std::size_t m0, std::size_t n0, bool two_rows,
              bool two_columns, float* c, std::size_t c_ld, bool load) {
  if (two_rows && two_columns) block<true, true>(terms, term_count, m0, n0, c, c_ld, load);
  else if (two_rows) block<true, false>(terms, term_count, m0, n0, c, c_ld, load);
  else if (two_columns) block<false, true>(terms, term_count, m0, n0, c, c_ld, load);
  else block<false, false>(terms, term_count, m0, n0, c, c_ld, load);
}

// C = Σ_t A_t·B_t for rows < m, columns < n (every term as long as the first), one 32 × 32
// block at a time: `epilogue(m0, n0, c)` takes rows [m0, m0 + 32) and columns [n0, n0 + 32)
// (those below m and n) from c, kCBlockLd floats a row, while the block is in L1. (A
// whole 64 × 128 C stored first and read after, beside a 64 × 128 accumulator and the
// operands, did not fit L1: the P·V product with its epilogue went 4.0 → 3.5 µs a 64 × 64
// block at dv 128 with this and the aligned scratch together, measured.)
template <class Epilogue>
void product(const Term* terms, std::size_t term_count, std::size_t m, std::size_t n, Epilogue&& epilogue) {
  const CallTiles tiles;
  float* const c = scratch().c;
  for_blocks(m, n, [&](std::size_t m0, std::size_t n0, bool two_rows, bool two_columns) {
    block_at(terms, term_count, m0, n0, two_rows, two_columns, c, kCBlockLd, /*load=*/false);
    epilogue(m0, n0, static_cast<const float*>(c));
  });
}

// C += A·B in the tiles themselves, C's rows [0, round_up(m, 16)) and columns [0,
// round_up(n, 16)) loaded from and stored back to c (c_ld floats a row, a multiple of 16:
// whole tiles stay inside each row). The caller's rows and columns past m and n must be
// there and take A's and B's zeros: they come back unchanged.
void product_onto(const Term* terms, std::size_t term_count, std::size_t m, std::size_t n, float* c,
                  std::size_t c_ld) {
  const CallTiles tiles;
  for_blocks(m, n, [&](std::size_t m0, std::size_t n0, bool two_rows, bool two_columns) {
    block_at(terms, term_count, m0, n0, two_rows, two_columns, c + m0 * c_ld + n0, c_ld, /*load=*/true);
  });
}

// Calls f(r, x, mask, c_row + x) for rows [m0, min(m0 + 32, m)) and the vectors of columns
// [n0, min(n0 + 32, n)) of a C block.
template <class F>
void for_block_vectors(std::size_t m0, std::size_t m, std::size_t n0, std::size_t n, const float* c, F&& f) {
  const std::size_t rows = std::min(m - m0, 2 * kTileRows);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t x = n0; x < n && x < n0 + 2 * kTileWords; x += 16)
      f(m0 + r, x, lanes_below(n - x), c + r * kCBlockLd + (x - n0));
}

__m256i to_bf16(__m512 x) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)); }

// bf16(Pᵀ)ᵀ: P as one bfloat16 term, rounded to nearest even (the Precision::fast contract,
// as bf16_dot.cpp and the peers), row-major into dst (row i: query i's weights over the
// keys, dst_ld values apart), rows up to round_up(count, 16) and columns up to `columns`
// (≥ keys, a multiple of 16), zero past count and keys.
void transpose_weights(const float* pt, std::size_t pt_ld, std::size_t count, std::size_t keys,
                       std::uint16_t* dst, std::size_t dst_ld, std::size_t columns) {
  const std::size_t rows = round_up(count, kTileRows);
  for (std::size_t i0 = 0; i0 < rows; i0 += 16) {
    const __mmask16 lanes = i0 < count ? lanes_below(count - i0) : 0;
    for (std::size_t j0 = 0; j0 < columns; j0 += 16) {
      __m512 r[16];
      for (std::size_t j = 0; j < 16; ++j)
        r[j] = j0 + j < keys ? _mm512_maskz_loadu_ps(lanes, pt + (j0 + j) * pt_ld + i0) : _mm512_setzero_ps();
      avx512::transpose16(r);  // r[i]: query i0 + i's weights of keys j0..j0+15
      for (std::size_t i = 0; i < 16; ++i)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (i0 + i) * dst_ld + j0), to_bf16(r[i]));
    }
  }
}

// acc_i *= alpha_i for the rows whose alpha is not 1: with the online softmax, those
// whose maximum grew in this block, which after the first few blocks is rare.
void scale_rows(float* acc, std::size_t acc_ld, std::size_t count, std::size_t dv, const float* alpha) {
  if (alpha == nullptr) return;
  for (std::size_t i = 0; i < count; ++i) {
    if (alpha[i] == 1.0f) continue;
    const __m512 a = _mm512_set1_ps(alpha[i]);
    float* row = acc + i * acc_ld;
    for (std::size_t x = 0; x < dv; x += 16)
      _mm512_mask_storeu_ps(row + x, lanes_below(dv - x),
                            _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes_below(dv - x), row + x), a));
  }
}

// acc_i = acc_i·alpha_i + Σ_j P_ij·v_j with V's pairs in b (alpha null: acc_i + Σ).
// `onto`: the sum goes onto acc in the tiles (product_onto; acc_ld a multiple of 16 and
// acc's rows up to round_up(count, 16) there), after acc's rows with alpha_i ≠ 1 are
// scaled, so no C block passes through the scratch and an epilogue. Otherwise the block
// sums from zero and acc·alpha + sum is one rounding (bf16_dot.cpp's order).
void weighted(const float* pt, std::size_t pt_ld, std::size_t count, std::size_t keys, const Right& b,
              std::size_t dv, float* acc, std::size_t acc_ld, const float* alpha, bool onto) {
  Scratch& s = scratch();
  const std::size_t values = round_up(keys, kTileValues);
  // 64 rows of P at a time (latent decode stacks up to 128 heads × tokens in a tile).
  for (std::size_t r0 = 0; r0 < count; r0 += kMaxRows) {
    const std::size_t part = std::min(kMaxRows, count - r0);
    float* const part_acc = acc + r0 * acc_ld;
    const float* const part_alpha = alpha == nullptr ? nullptr : alpha + r0;
    transpose_weights(pt + r0, pt_ld, part, keys, s.p_terms, kMaxKeys, values);
    const Term term{{s.p_terms, kMaxKeys, round_up(part, kTileRows), values}, b};
    if (onto) {
      scale_rows(part_acc, acc_ld, part, dv, part_alpha);
      product_onto(&term, 1, part, dv, part_acc, acc_ld);
      continue;
    }
    product(&term, 1, part, dv, [&](std::size_t m0, std::size_t n0, const float* c) {
      for_block_vectors(m0, part, n0, dv, c, [&](std::size_t i, std::size_t x, __mmask16 m, const float* sum) {
        float* out = part_acc + i * acc_ld + x;
        const __m512 block_sum = _mm512_maskz_loadu_ps(m, sum);
        // acc·alpha + sum in one rounding, as bf16_dot.cpp and gemm-inl.h do.
        _mm512_mask_storeu_ps(out, m, part_alpha == nullptr
                                          ? _mm512_add_ps(_mm512_maskz_loadu_ps(m, out), block_sum)
                                          : _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, out),
                                                            _mm512_set1_ps(part_alpha[i]), block_sum));
      });
    });
  }
}

}  // namespace

void ScoresTransposed(const bfloat16* k, std::int64_t k_row, std::size_t keys, std::size_t d,
                      const std::uint32_t* qp, std::size_t q_ld, std::size_t width, float scale,
                      float* st, std::size_t st_ld) {
  if (keys == 0 || width == 0) return;
  const Term term{{&k->bits, static_cast<std::size_t>(k_row), keys, d}, {qp, q_ld, (d + 1) / 2}};
  const __m512 s = _mm512_set1_ps(scale);
  product(&term, 1, keys, width, [&](std::size_t m0, std::size_t n0, const float* c) {
    for_block_vectors(m0, keys, n0, width, c, [&](std::size_t j, std::size_t i, __mmask16 m, const float* sum) {
      _mm512_mask_storeu_ps(st + j * st_ld + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sum), s));
    });
  });
}

void RescaleAddWeighted(const float* pt, std::size_t pt_ld, std::size_t count, std::size_t keys,
                        const bfloat16* v, std::int64_t v_row, std::size_t dv, bf16dot::PvScratch pairs,
                        float* acc, std::size_t acc_ld, const float* alpha) {
  if (count == 0 || dv == 0) return;
  const std::size_t v_ld = bf16dot::pair_ld(dv);
  bf16dot::PackRowPairs(v, v_row, keys, dv, pairs.v_pairs, v_ld);
  // Pair rows past (keys + 1)/2 are not zeroed here: a partial tile of them is copied
  // with zeros (right_tile reads only the rows below `pairs`).
  weighted(pt, pt_ld, count, keys, Right{pairs.v_pairs, v_ld, (keys + 1) / 2}, dv, acc, acc_ld, alpha,
           acc_ld % kTileWords == 0);
}

void AddWeightedPairs(const float* pt, std::size_t pt_ld, std::size_t count, std::size_t keys,
                      const std::uint32_t* v_pairs, std::size_t v_ld, std::size_t dv, float* acc,
                      std::size_t acc_ld, const float* alpha) {
  if (count == 0 || dv == 0) return;
  // Zero up to 32 pair rows: every tile loads in place.
  weighted(pt, pt_ld, count, keys, Right{v_pairs, v_ld, round_up((keys + 1) / 2, kTileRows)}, dv, acc, acc_ld,
           alpha, acc_ld % kTileWords == 0);
}

void AddProduct(const bf16dot::LeftPairs& a, std::size_t rows, std::size_t pairs, const std::uint32_t* b,
                std::size_t b_ld, std::size_t n, float* c, std::size_t c_ld) {
  if (rows == 0 || n == 0) return;
  if (a.pair_step != 1 || rows > kMaxRows)  // not the layout the tiles load: the AVX512-BF16 kernel
    return bf16dot::AddProduct(a, rows, pairs, b, b_ld, n, c, c_ld);
  const auto* words = reinterpret_cast<const std::uint16_t*>(a.words);
  const Right right{b, b_ld, pairs};
  const Term terms[2] = {{{words, 2 * a.row_step, rows, 2 * pairs}, right},
                         {{words + 2 * a.terms_at, 2 * a.row_step, rows, 2 * pairs}, right}};
  const std::size_t term_count = a.terms == bf16dot::Terms::two ? 2 : 1;
  if (c_ld % kTileWords == 0) return product_onto(terms, term_count, rows, n, c, c_ld);
  product(terms, term_count, rows, n, [&](std::size_t m0, std::size_t n0, const float* sum) {
    for_block_vectors(m0, rows, n0, n, sum, [&](std::size_t r, std::size_t x, __mmask16 m, const float* block_sum) {
      float* out = c + r * c_ld + x;
      _mm512_mask_storeu_ps(out, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, out), _mm512_maskz_loadu_ps(m, block_sum)));
    });
  });
}

}  // namespace qkv::cpu::amx

#pragma GCC pop_options
#pragma GCC diagnostic pop

#else  // not x86-64: available() is false, so the kernels are never called.

#include "qkv/error.hpp"

namespace qkv::cpu::amx {
[[noreturn]] static void unavailable() { throw Error("AMX tiles: not compiled for this CPU"); }
void ScoresTransposed(const bfloat16*, std::int64_t, std::size_t, std::size_t, const std::uint32_t*, std::size_t,
                      std::size_t, float, float*, std::size_t) { unavailable(); }
void RescaleAddWeighted(const float*, std::size_t, std::size_t, std::size_t, const bfloat16*, std::int64_t,
                        std::size_t, bf16dot::PvScratch, float*, std::size_t, const float*) { unavailable(); }
void AddProduct(const bf16dot::LeftPairs&, std::size_t, std::size_t, const std::uint32_t*, std::size_t, std::size_t,
                float*, std::size_t) { unavailable(); }
void AddWeightedPairs(const float*, std::size_t, std::size_t, std::size_t, const std::uint32_t*, std::size_t, std::size_t,
                      float*, std::size_t, const float*) { unavailable(); }
}  // namespace qkv::cpu::amx
#endif
