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
// -Wmaybe-uninitialized reports at every use (GCC bug 105593): silenced for this file.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

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

// acc rows (queries) × columns (value dims): the reduction runs over the pairs of keys.
struct WeightedTiles {
  const std::uint32_t* pp;  // P's bfloat16 pairs, then (key_pairs·p_ld words on) P − bf16(P)'s
  std::size_t p_ld;
  const std::uint32_t* vp;
  std::size_t v_ld, key_pairs, dv;
  float* acc;
  std::size_t acc_ld;
  const float* alpha;

  template <std::size_t R, std::size_t C>
  void run(std::size_t row, std::size_t column) const {
    __m512 sum[R][C];
    for (std::size_t r = 0; r < R; ++r)
      for (std::size_t j = 0; j < C; ++j) sum[r][j] = _mm512_setzero_ps();
    for (std::size_t c = 0; c < key_pairs; ++c) {
      __m512bh v[C];
      for (std::size_t j = 0; j < C; ++j)
        v[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(vp + c * v_ld + column + j * kLanes));
      for (std::size_t r = 0; r < R; ++r) {
        const std::size_t at = c * p_ld + row + r;
        const __m512bh hi = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pp[at])));
        const __m512bh lo = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pp[key_pairs * p_ld + at])));
        for (std::size_t j = 0; j < C; ++j) sum[r][j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(sum[r][j], hi, v[j]), lo, v[j]);
      }
    }
    // acc·alpha + sum, as gemm-inl.h's GemmStore::rescale_add.
    for (std::size_t r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[row + r]);
      float* out = acc + (row + r) * acc_ld;
      for (std::size_t j = 0; j < C; ++j) {
        const std::size_t first = column + j * kLanes;
        const __mmask16 m = lanes_below(dv - first);
        _mm512_mask_storeu_ps(out + first, m, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, out + first), a, sum[r][j]));
      }
    }
  }
};

}  // namespace

void PackQueryPairs(const bfloat16* q, std::int64_t q_row, std::size_t count, std::size_t d,
                    std::uint32_t* qp, std::size_t q_ld) {
  const std::size_t pairs = (d + 1) / 2, whole = d / 2;
  for (std::size_t c = 0; c < pairs; ++c) std::fill(qp + c * q_ld + count, qp + (c + 1) * q_ld, 0u);
  for (std::size_t i = 0; i < count; ++i) {
    const std::uint16_t* row = &q[static_cast<std::int64_t>(i) * q_row].bits;
    for (std::size_t c = 0; c < whole; ++c) qp[c * q_ld + i] = load_pair(row + 2 * c);
    if (pairs > whole) qp[whole * q_ld + i] = row[d - 1];
  }
}

void ScoresTransposed(const bfloat16* k, std::int64_t k_row, std::size_t keys, std::size_t d,
                      const std::uint32_t* qp, std::size_t q_ld, std::size_t width, float scale,
                      float* st, std::size_t st_ld) {
  ScoreTiles tiles{&k->bits, k_row, d, qp, q_ld, width, scale, st, st_ld};
  for_tiles(keys, width, tiles);
}

void RescaleAddWeighted(const float* pt, std::size_t pt_ld, std::size_t count, std::size_t keys,
                        const bfloat16* v, std::int64_t v_row, std::size_t dv, PvScratch scratch,
                        float* acc, std::size_t acc_ld, const float* alpha) {
  const std::size_t key_pairs = (keys + 1) / 2, p_ld = pair_ld(count), v_ld = pair_ld(dv);
  // P as two bfloat16 terms, hi = bf16(P) (round to nearest even) and lo = bf16(P − hi):
  // hi + lo is P to ~2⁻¹⁶ relative, so P·V = hi·V + lo·V keeps the float32 arithmetic's
  // accuracy (one bf16 P alone costs up to 2⁻⁹·P and measured above PyTorch's bf16 error on
  // some rows, bench/RESULTS.md §10). Pairs (P_i,2c, P_i,2c+1); an odd key count's last
  // partner 0.
  std::uint32_t* lo_pairs = scratch.p_pairs + key_pairs * p_ld;
  for (std::size_t c = 0; c < key_pairs; ++c) {
    const bool has_odd = 2 * c + 1 < keys;
    for (std::size_t i = 0; i < count; i += kLanes) {
      const __mmask16 m = lanes_below(count - i);
      const __m512 even = _mm512_maskz_loadu_ps(m, pt + 2 * c * pt_ld + i);
      const __m512 odd = has_odd ? _mm512_maskz_loadu_ps(m, pt + (2 * c + 1) * pt_ld + i) : _mm512_setzero_ps();
      const __m256i even_hi = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(even));
      const __m256i odd_hi = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(odd));
      // bf16 → float is a shift into the high half (exact).
      const __m512 even_rest = _mm512_sub_ps(even, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(even_hi), 16)));
      const __m512 odd_rest = _mm512_sub_ps(odd, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(odd_hi), 16)));
      _mm512_storeu_si512(scratch.p_pairs + c * p_ld + i, interleave(even_hi, odd_hi));
      _mm512_storeu_si512(lo_pairs + c * p_ld + i,
                          interleave(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(even_rest)),
                                     reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(odd_rest))));
    }
  }
  // V pairs (v_2c[n], v_2c+1[n]); columns past dv and an odd key count's partner are 0.
  const std::uint16_t* values = &v->bits;
  for (std::size_t c = 0; c < key_pairs; ++c) {
    const std::uint16_t* even = values + static_cast<std::int64_t>(2 * c) * v_row;
    const bool has_odd = 2 * c + 1 < keys;
    for (std::size_t n = 0; n < v_ld; n += kLanes) {
      const __mmask16 m = n < dv ? lanes_below(dv - n) : 0;
      const __m256i lo = _mm256_maskz_loadu_epi16(m, even + n);
      const __m256i hi = has_odd ? _mm256_maskz_loadu_epi16(m, even + v_row + n) : _mm256_setzero_si256();
      _mm512_storeu_si512(scratch.v_pairs + c * v_ld + n, interleave(lo, hi));
    }
  }
  WeightedTiles tiles{scratch.p_pairs, p_ld, scratch.v_pairs, v_ld, key_pairs, dv, acc, acc_ld, alpha};
  for_tiles(count, dv, tiles);
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
}  // namespace qkv::cpu::bf16dot
#endif
