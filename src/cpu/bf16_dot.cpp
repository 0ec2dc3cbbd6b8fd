// The AVX512-BF16 block products of bf16_dot.hpp. Every function here is compiled for
// avx512f/bw/vl/bf16 (the pragma below is the target attribute on each of them) and runs
// only where dot_products.cpp found the unit.
//
// Register tiles as in gemm-inl.h: kRows rows × up to 4 zmm columns of float32 sums
// (6×4 + 4 loads + 1 broadcast = 29 of 32 registers). Each step of the reduction loads
// the tile's columns of pairs once, broadcasts one pair per row and issues rows·columns
// vdpbf16ps, each 16 lanes × 2 products. The order of every sum is fixed by the shape,
// so results do not depend on threads.
#include "cpu/bf16_dot.hpp"

#if defined(__x86_64__) || defined(_M_X64)
// GCC 12's avx512fintrin.h builds some intrinsics on _mm512_undefined_*(), which
// -Wmaybe-uninitialized (and, for the unpacks of avx512_transpose.hpp at -O1,
// -Wuninitialized) reports at every use (GCC bug 105593): silenced for this file.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

#include "cpu/avx512_transpose.hpp"

namespace qkv::cpu::bf16dot {
namespace {

constexpr std::size_t kRows = 6;
constexpr std::size_t kLanes = 16;
constexpr std::size_t kPanel = 4 * kLanes;  // columns of one tile

__mmask16 lanes_below(std::size_t n) {
  return n >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

std::uint32_t load_pair(const std::uint16_t* p) {
  std::uint32_t word;
  std::memcpy(&word, p, sizeof word);
  return word;
}

// 16 words (lo[i], hi[i]) from two vectors of 16 bfloat16.
__m512i interleave(__m256i lo, __m256i hi) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
}

// tile.template run<R, C>(row, column) over rows × columns (columns in floats), tiles
// of kRows rows and panels of up to 4 vectors.
template <std::size_t C, class Tile>
void for_rows(std::size_t rows, std::size_t column, Tile& tile) {
  std::size_t r = 0;
  for (; r + kRows <= rows; r += kRows) tile.template run<kRows, C>(r, column);
  switch (rows - r) {
    case 5: tile.template run<5, C>(r, column); break;
    case 4: tile.template run<4, C>(r, column); break;
    case 3: tile.template run<3, C>(r, column); break;
    case 2: tile.template run<2, C>(r, column); break;
    case 1: tile.template run<1, C>(r, column); break;
    default: break;
  }
}

template <class Tile>
void for_tiles(std::size_t rows, std::size_t columns, Tile& tile) {
  for (std::size_t c = 0; c < columns; c += kPanel) {
    switch (std::min<std::size_t>(4, (columns - c + kLanes - 1) / kLanes)) {
      case 4: for_rows<4>(rows, c, tile); break;
      case 3: for_rows<3>(rows, c, tile); break;
      case 2: for_rows<2>(rows, c, tile); break;
      default: for_rows<1>(rows, c, tile); break;
    }
  }
}

// Sᵀ rows (keys) × columns (queries): the reduction runs over the pairs of the head dim.
struct ScoreTiles {
  const std::uint16_t* k;
  std::int64_t k_row;
  std::size_t d;
  const std::uint32_t* qp;
  std::size_t q_ld, width;
  float scale;
  float* st;
  std::size_t st_ld;

  template <std::size_t R, std::size_t C>
  void run(std::size_t row, std::size_t column) const {
    __m512 acc[R][C];
    for (std::size_t r = 0; r < R; ++r)
      for (std::size_t j = 0; j < C; ++j) acc[r][j] = _mm512_setzero_ps();
    const std::uint16_t* keys = k + static_cast<std::int64_t>(row) * k_row;
    const std::size_t whole = d / 2;
    for (std::size_t c = 0; c < (d + 1) / 2; ++c) {
      __m512bh q[C];
      for (std::size_t j = 0; j < C; ++j)
        q[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(qp + c * q_ld + column + j * kLanes));
      for (std::size_t r = 0; r < R; ++r) {
        const std::uint16_t* key = keys + static_cast<std::int64_t>(r) * k_row + 2 * c;
        // An odd d's last pair is (k[d−1], 0): nothing is read past the row.
        const std::uint32_t word = c < whole ? load_pair(key) : key[0];
        const __m512bh pair = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(word)));
        for (std::size_t j = 0; j < C; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], pair, q[j]);
      }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (std::size_t r = 0; r < R; ++r)
      for (std::size_t j = 0; j < C; ++j) {
        const std::size_t first = column + j * kLanes;
        _mm512_mask_storeu_ps(st + (row + r) * st_ld + first, lanes_below(width - first),
                              _mm512_mul_ps(acc[r][j], s));
      }
  }
};

// c rows × columns += Σ over the left operand's pairs (each of its terms in turn), the
// block's sum from zero: then c·alpha + sum (the forward's online-softmax update) or, with
// alpha null, c + sum.
template <Terms kTerms>
struct ProductTiles {
  LeftPairs a;
  const std::uint32_t* b;
  std::size_t b_ld, pairs, n;
  float* c;
  std::size_t c_ld;
  const float* alpha;

  template <std::size_t R, std::size_t C>
  void run(std::size_t row, std::size_t column) const {
    __m512 sum[R][C];
    for (std::size_t r = 0; r < R; ++r)
      for (std::size_t j = 0; j < C; ++j) sum[r][j] = _mm512_setzero_ps();
    const std::uint32_t* words = a.words + row * a.row_step;
    for (std::size_t k = 0; k < pairs; ++k) {
      __m512bh v[C];
      for (std::size_t j = 0; j < C; ++j)
        v[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + k * b_ld + column + j * kLanes));
      for (std::size_t r = 0; r < R; ++r) {
        const std::uint32_t* at = words + r * a.row_step + k * a.pair_step;
        const __m512bh hi = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(at[0])));
        if constexpr (kTerms == Terms::two) {
          const __m512bh lo = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(at[a.terms_at])));
          for (std::size_t j = 0; j < C; ++j) sum[r][j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(sum[r][j], hi, v[j]), lo, v[j]);
        } else {
          for (std::size_t j = 0; j < C; ++j) sum[r][j] = _mm512_dpbf16_ps(sum[r][j], hi, v[j]);
        }
      }
    }
    for (std::size_t r = 0; r < R; ++r) {
      float* out = c + (row + r) * c_ld;
      for (std::size_t j = 0; j < C; ++j) {
        const std::size_t first = column + j * kLanes;
        const __mmask16 m = lanes_below(n - first);
        const __m512 old = _mm512_maskz_loadu_ps(m, out + first);
        // acc·alpha + sum, as gemm-inl.h's GemmStore::rescale_add (one rounding).
        const __m512 updated = alpha != nullptr ? _mm512_fmadd_ps(old, _mm512_set1_ps(alpha[row + r]), sum[r][j])
                                                : _mm512_add_ps(old, sum[r][j]);
        _mm512_mask_storeu_ps(out + first, m, updated);
      }
    }
  }
};

// bf16(x) as the high half of a float (exact), for the second term x − bf16(x).
__m512 widen(__m256i bf16) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16)); }

__m256i to_bf16(__m512 x) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)); }

void AddProductImpl(const LeftPairs& a, std::size_t rows, std::size_t pairs, const std::uint32_t* b,
                    std::size_t b_ld, std::size_t n, float* c, std::size_t c_ld, const float* alpha) {
  if (a.terms == Terms::two) {
    ProductTiles<Terms::two> tiles{a, b, b_ld, pairs, n, c, c_ld, alpha};
    for_tiles(rows, n, tiles);
  } else {
    ProductTiles<Terms::one> tiles{a, b, b_ld, pairs, n, c, c_ld, alpha};
    for_tiles(rows, n, tiles);
  }
}

}  // namespace

void PackQueryPairs(const bfloat16* q, std::int64_t q_row, std::size_t count, std::size_t d,
                    std::uint32_t* qp, std::size_t q_ld) {
  const std::size_t pairs = (d + 1) / 2, whole = d / 2;
  for (std::size_t c = 0; c < pairs; ++c) std::fill(qp + c * q_ld + count, qp + (c + 1) * q_ld, 0u);
  // 16 rows × 16 pairs at a time: each row's pairs are consecutive words, so a 16 × 16
  // transposition of words (one pair a lane) gives 16 columns of 16 rows. (One store per
  // word, 64 rows apart, took ~2.5% of the bf16 backward on the AMX tiles.)
  for (std::size_t i0 = 0; i0 < count; i0 += kLanes) {
    const std::size_t rows = std::min(kLanes, count - i0);
    for (std::size_t c0 = 0; c0 < whole; c0 += kLanes) {
      const std::size_t columns = std::min(kLanes, whole - c0);
      __m512 r[kLanes];
      for (std::size_t k = 0; k < kLanes; ++k)
        r[k] = k < rows ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(
                              lanes_below(columns), &q[static_cast<std::int64_t>(i0 + k) * q_row].bits + 2 * c0))
                        : _mm512_setzero_ps();
      avx512::transpose16(r);  // r[k]: pair c0 + k of rows i0 … i0 + 15
      for (std::size_t k = 0; k < columns; ++k)
        _mm512_mask_storeu_epi32(qp + (c0 + k) * q_ld + i0, lanes_below(rows), _mm512_castps_si512(r[k]));
    }
    if (pairs > whole)  // an odd d: the last value with a zero partner
      for (std::size_t i = i0; i < i0 + rows; ++i)
        qp[whole * q_ld + i] = q[static_cast<std::int64_t>(i) * q_row + static_cast<std::int64_t>(d) - 1].bits;
  }
}

void ScoresTransposed(const bfloat16* k, std::int64_t k_row, std::size_t keys, std::size_t d,
                      const std::uint32_t* qp, std::size_t q_ld, std::size_t width, float scale,
                      float* st, std::size_t st_ld) {
  ScoreTiles tiles{&k->bits, k_row, d, qp, q_ld, width, scale, st, st_ld};
  for_tiles(keys, width, tiles);
}

void PackRowPairs(const bfloat16* rows, std::int64_t row_stride, std::size_t count, std::size_t n,
                  std::uint32_t* out, std::size_t out_ld) {
  const std::uint16_t* values = &rows->bits;
  for (std::size_t c = 0; c < (count + 1) / 2; ++c) {
    const std::uint16_t* even = values + static_cast<std::int64_t>(2 * c) * row_stride;
    const bool has_odd = 2 * c + 1 < count;
    for (std::size_t x = 0; x < out_ld; x += kLanes) {
      const __mmask16 m = x < n ? lanes_below(n - x) : 0;
      const __m256i lo = _mm256_maskz_loadu_epi16(m, even + x);
      const __m256i hi = has_odd ? _mm256_maskz_loadu_epi16(m, even + row_stride + x) : _mm256_setzero_si256();
      _mm512_storeu_si512(out + c * out_ld + x, interleave(lo, hi));
    }
  }
}

void PairsAlongRows(const float* t, std::size_t t_ld, std::size_t rows, std::size_t n, Terms terms,
                    std::uint32_t* out, std::size_t out_ld) {
  // 32 floats of a row → 16 words: cvtne2ps_pbh puts its second argument's 16 values in
  // the low half, so the words are (x0, x1), (x2, x3), … in order.
  std::uint32_t* lo_out = out + rows * out_ld;
  if (terms == Terms::one && n % (2 * kLanes) == 0) {  // whole vectors (the backward's full blocks)
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t x = 0; x < n; x += 2 * kLanes)
        _mm512_storeu_si512(out + r * out_ld + x / 2,
                            reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(t + r * t_ld + x + kLanes),
                                                                          _mm512_loadu_ps(t + r * t_ld + x))));
    return;
  }
  for (std::size_t r = 0; r < rows; ++r) {
    const float* row = t + r * t_ld;
    for (std::size_t x = 0; x < n; x += 2 * kLanes) {
      const __m512 first = _mm512_maskz_loadu_ps(lanes_below(n - x), row + x);
      const __m512 second = x + kLanes < n ? _mm512_maskz_loadu_ps(lanes_below(n - x - kLanes), row + x + kLanes)
                                           : _mm512_setzero_ps();
      const __m256i first_hi = to_bf16(first), second_hi = to_bf16(second);
      const __mmask16 words = lanes_below((n - x + 1) / 2);
      _mm512_mask_storeu_epi32(out + r * out_ld + x / 2, words,
                               _mm512_inserti64x4(_mm512_castsi256_si512(first_hi), second_hi, 1));
      if (terms == Terms::two) {
        const __m256i first_lo = to_bf16(_mm512_sub_ps(first, widen(first_hi)));
        const __m256i second_lo = to_bf16(_mm512_sub_ps(second, widen(second_hi)));
        _mm512_mask_storeu_epi32(lo_out + r * out_ld + x / 2, words,
                                 _mm512_inserti64x4(_mm512_castsi256_si512(first_lo), second_lo, 1));
      }
    }
  }
}

void PairsAcrossRows(const float* t, std::size_t t_ld, std::size_t rows, std::size_t n, Terms terms,
                     std::uint32_t* out, std::size_t out_ld) {
  const std::size_t pairs = (rows + 1) / 2;
  std::uint32_t* lo_out = out + pairs * out_ld;
  for (std::size_t c = 0; c < pairs; ++c) {
    const bool has_odd = 2 * c + 1 < rows;
    for (std::size_t i = 0; i < n; i += kLanes) {
      const __mmask16 m = lanes_below(n - i);
      const __m512 even = _mm512_maskz_loadu_ps(m, t + 2 * c * t_ld + i);
      const __m512 odd = has_odd ? _mm512_maskz_loadu_ps(m, t + (2 * c + 1) * t_ld + i) : _mm512_setzero_ps();
      const __m256i even_hi = to_bf16(even), odd_hi = to_bf16(odd);
      _mm512_storeu_si512(out + c * out_ld + i, interleave(even_hi, odd_hi));
      if (terms == Terms::two)
        _mm512_storeu_si512(lo_out + c * out_ld + i,
                            interleave(to_bf16(_mm512_sub_ps(even, widen(even_hi))),
                                       to_bf16(_mm512_sub_ps(odd, widen(odd_hi)))));
    }
  }
}

void AddProduct(const LeftPairs& a, std::size_t rows, std::size_t pairs, const std::uint32_t* b,
                std::size_t b_ld, std::size_t n, float* c, std::size_t c_ld) {
  AddProductImpl(a, rows, pairs, b, b_ld, n, c, c_ld, nullptr);
}

void AddWeightedPairs(const float* pt, std::size_t pt_ld, std::size_t count, std::size_t keys,
                      const std::uint32_t* v_pairs, std::size_t v_ld, std::size_t dv, std::uint32_t* p_pairs,
                      float* acc, std::size_t acc_ld, const float* alpha) {
  const std::size_t key_pairs = (keys + 1) / 2, p_ld = pair_ld(count);
  // Pairs (P_i,2c, P_i,2c+1) of bf16(P) (one rounding, the fast contract); an odd key
  // count's last partner 0.
  PairsAcrossRows(pt, pt_ld, keys, count, Terms::one, p_pairs, p_ld);
  const LeftPairs p{p_pairs, 1, p_ld, Terms::one, 0};
  AddProductImpl(p, count, key_pairs, v_pairs, v_ld, dv, acc, acc_ld, alpha);
}

void RescaleAddWeighted(const float* pt, std::size_t pt_ld, std::size_t count, std::size_t keys,
                        const bfloat16* v, std::int64_t v_row, std::size_t dv, PvScratch scratch,
                        float* acc, std::size_t acc_ld, const float* alpha) {
  const std::size_t v_ld = pair_ld(dv);
  PackRowPairs(v, v_row, keys, dv, scratch.v_pairs, v_ld);
  AddWeightedPairs(pt, pt_ld, count, keys, scratch.v_pairs, v_ld, dv, scratch.p_pairs, acc, acc_ld, alpha);
}

}  // namespace qkv::cpu::bf16dot

#pragma GCC pop_options
#pragma GCC diagnostic pop

#else  // not x86-64: dot_products.cpp never reports the unit, so these are never called.

#include "qkv/error.hpp"

namespace qkv::cpu::bf16dot {
[[noreturn]] static void unavailable() { throw Error("bf16 dot products: not compiled for this CPU"); }
void PackQueryPairs(const bfloat16*, std::int64_t, std::size_t, std::size_t, std::uint32_t*, std::size_t) { unavailable(); }
void ScoresTransposed(const bfloat16*, std::int64_t, std::size_t, std::size_t, const std::uint32_t*, std::size_t,
                      std::size_t, float, float*, std::size_t) { unavailable(); }
void RescaleAddWeighted(const float*, std::size_t, std::size_t, std::size_t, const bfloat16*, std::int64_t,
                        std::size_t, PvScratch, float*, std::size_t, const float*) { unavailable(); }
void AddWeightedPairs(const float*, std::size_t, std::size_t, std::size_t, const std::uint32_t*, std::size_t,
                      std::size_t, std::uint32_t*, float*, std::size_t, const float*) { unavailable(); }
void PackRowPairs(const bfloat16*, std::int64_t, std::size_t, std::size_t, std::uint32_t*, std::size_t) { unavailable(); }
void PairsAlongRows(const float*, std::size_t, std::size_t, std::size_t, Terms, std::uint32_t*, std::size_t) { unavailable(); }
void PairsAcrossRows(const float*, std::size_t, std::size_t, std::size_t, Terms, std::uint32_t*, std::size_t) { unavailable(); }
void AddProduct(const LeftPairs&, std::size_t, std::size_t, const std::uint32_t*, std::size_t, std::size_t, float*,
                std::size_t) { unavailable(); }
}  // namespace qkv::cpu::bf16dot
#endif
