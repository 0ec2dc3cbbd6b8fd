// The row-layout AMX products of amx_rows.hpp (the pragma below is the target attribute
// on each). Tiles as in amx_dot.cpp: C in tmm0–3 as a 2 × 2 block of 16 × 16 floats, the
// left operand in tmm4–5 (16 rows × 32 bfloat16 values), the right one in tmm6–7 (16 pair
// rows × 16 words); every step of 32 reduction values loads 4 tiles and issues 4
// tdpbf16ps.
#include "cpu/amx_rows.hpp"

#if defined(__x86_64__)
// GCC 12's intrinsics build on _mm512_undefined_*(): see bf16_dot.cpp.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")

#include "cpu/avx512_transpose.hpp"

namespace qkv::cpu::amx {
namespace {

constexpr std::size_t round_up(std::size_t n, std::size_t m) { return (n + m - 1) / m * m; }

__mmask32 values_below(std::size_t n) {
  return n >= 32 ? static_cast<__mmask32>(0xFFFFFFFFu) : static_cast<__mmask32>((1u << n) - 1);
}

// A packed key block's tiles: kKeyTiles tiles of 16 keys for each 32 values of d, each tile's
// 16 pair rows × 16 words contiguous (1 KiB: one sequential stream for the tile loads).
constexpr std::size_t kKeyTiles = kKeyBlock / kTileWords;
constexpr std::size_t kTileWordsPerTile = kTileRows * kTileWords;

// Lanes of the 16 keys from j that lie in [begin, end).
__mmask16 key_lanes(std::ptrdiff_t j, std::ptrdiff_t begin, std::ptrdiff_t end) {
  const std::ptrdiff_t a = std::clamp<std::ptrdiff_t>(begin - j, 0, 16), b = std::clamp<std::ptrdiff_t>(end - j, 0, 16);
  return b > a ? static_cast<__mmask16>((1u << b) - (1u << a)) : static_cast<__mmask16>(0);
}

constexpr float kLog2e = 1.44269504088896341f;


// 2^t for t ≤ 0 (the softmax's centred logits in base 2): 2^n·2^f with n = round(t), f ∈
// [−½, ½], 2^f by its Taylor polynomial of degree 6 (relative error below 1.2·10⁻⁷ there,
// ~1 float ulp), 2^n applied by vscalefps. Below t = −125 the result is 0 without being
// computed (so are the masked keys' −inf): a result in the subnormal range costs a
// microcode assist per instruction, which made spans with masked keys (a causal diagonal)
// twice as slow, measured; bf16(P) would flush such weights anyway. NaN stays NaN (an
// unordered comparison keeps its lane).
__m512 exp2_of(__m512 t) {
  const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-125.0f), _CMP_NLT_UQ);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 q = _mm512_set1_ps(1.5403530393381606e-4f);  // ln(2)^k / k!, k = 6 … 0
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(1.3333558146428443e-3f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(9.6181291076284772e-3f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(5.5504108664821580e-2f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(2.4022650695910071e-1f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(6.9314718055994531e-1f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(normal, q, n);
}

// The 2 × 2 (or 1 × 2) C block at rows m0, columns n0 of S = Q·Kᵀ.
template <bool kTwoRows>
void score_block(const std::uint16_t* q, std::size_t q_ld, std::size_t m0, const std::uint32_t* k_column,
                 float* s, std::size_t s_ld) {
  const std::size_t q_bytes = q_ld * sizeof(std::uint16_t), k_bytes = kTileWords * sizeof(std::uint32_t);
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kTwoRows) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const std::uint16_t* q_rows = q + m0 * q_ld;
  for (std::size_t x = 0; x < q_ld; x += kTileValues) {
    const std::uint32_t* k_pairs = k_column + x / kTileValues * kKeyTiles * kTileWordsPerTile;
    _tile_loadd(6, k_pairs, k_bytes);
    _tile_loadd(7, k_pairs + kTileWordsPerTile, k_bytes);
    _tile_loadd(4, q_rows + x, q_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kTwoRows) {
      _tile_loadd(5, q_rows + kTileRows * q_ld + x, q_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  const std::size_t s_bytes = s_ld * sizeof(float);
  _tile_stored(0, s, s_bytes);
  _tile_stored(1, s + kTileWords, s_bytes);
  if constexpr (kTwoRows) {
    _tile_stored(2, s + kTileRows * s_ld, s_bytes);
    _tile_stored(3, s + kTileRows * s_ld + kTileWords, s_bytes);
  }
}

// acc's C block at rows m0, columns n0 += P·V over the span's keys (values: a multiple of 32).
template <bool kTwoRows, bool kTwoColumns>
void weighted_block(const std::uint16_t* p, std::size_t p_ld, std::size_t values, const std::uint32_t* v_column,
                    std::size_t v_ld, float* c, std::size_t c_ld) {
  const std::size_t c_bytes = c_ld * sizeof(float), p_bytes = p_ld * sizeof(std::uint16_t);
  const std::size_t v_bytes = v_ld * sizeof(std::uint32_t);
  _tile_loadd(0, c, c_bytes);
  if constexpr (kTwoColumns) _tile_loadd(1, c + kTileWords, c_bytes);
  if constexpr (kTwoRows) _tile_loadd(2, c + kTileRows * c_ld, c_bytes);
  if constexpr (kTwoRows && kTwoColumns) _tile_loadd(3, c + kTileRows * c_ld + kTileWords, c_bytes);
  for (std::size_t x = 0; x < values; x += kTileValues) {
    const std::uint32_t* v_pairs = v_column + x / 2 * v_ld;
    _tile_loadd(6, v_pairs, v_bytes);
    if constexpr (kTwoColumns) _tile_loadd(7, v_pairs + kTileWords, v_bytes);
    _tile_loadd(4, p + x, p_bytes);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kTwoColumns) _tile_dpbf16ps(1, 4, 7);
    if constexpr (kTwoRows) {
      _tile_loadd(5, p + kTileRows * p_ld + x, p_bytes);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (kTwoColumns) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, c_bytes);
  if constexpr (kTwoColumns) _tile_stored(1, c + kTileWords, c_bytes);
  if constexpr (kTwoRows) _tile_stored(2, c + kTileRows * c_ld, c_bytes);
  if constexpr (kTwoRows && kTwoColumns) _tile_stored(3, c + kTileRows * c_ld + kTileWords, c_bytes);
}

}  // namespace

void PackKeyPairs(const bfloat16* k, std::int64_t k_row, std::size_t keys, std::size_t d, std::uint32_t* out) {
  const std::uint16_t* values = &k->bits;
  const std::size_t pairs = query_ld(d) / 2;
  // 16 keys × 16 pairs at a time: each key's pairs are consecutive words of its row, so
  // a 16 × 16 transpose of 32-bit lanes turns them into pair rows.
  for (std::size_t c0 = 0; c0 < pairs; c0 += 16) {
    const __mmask32 present = 2 * c0 < d ? values_below(d - 2 * c0) : 0;  // an odd d's partner 0
    for (std::size_t j0 = 0; j0 < kKeyBlock; j0 += 16) {
      __m512 r[16];
      for (std::size_t j = 0; j < 16; ++j)
        r[j] = j0 + j < keys ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(
                                   present, values + static_cast<std::int64_t>(j0 + j) * k_row + 2 * c0))
                             : _mm512_setzero_ps();
      avx512::transpose16(r);  // r[c]: pair c0 + c of keys j0..j0+15
      std::uint32_t* tile = out + (c0 / kTileRows * kKeyTiles + j0 / kTileWords) * kTileWordsPerTile;
      for (std::size_t c = 0; c < 16; ++c) _mm512_storeu_ps(tile + c * kTileWords, r[c]);
    }
  }
}

void PackQueryRows(const bfloat16* q, std::int64_t q_row, std::size_t rows, std::size_t d, std::uint16_t* out) {
  const std::size_t ld = query_ld(d);
  for (std::size_t r = 0; r < round_up(rows, kTileRows); ++r)
    for (std::size_t x = 0; x < ld; x += kTileValues) {
      const bool present = r < rows && x < d;  // rows past `rows` are not read at all
      _mm512_storeu_si512(out + r * ld + x,
                          present ? _mm512_maskz_loadu_epi16(values_below(d - x),
                                                             &q[static_cast<std::int64_t>(r) * q_row].bits + x)
                                  : _mm512_setzero_si512());
    }
}

namespace {

// One row's online-softmax step (amx_rows.hpp, AttendSpan): the row's maximum over its keys
// [lo, hi) (masked lanes read −inf), then P = 2^(log2(e)·(scale·S − m')) 32 keys at a time,
// stored as bfloat16 in key order, zeros outside the row's keys up to `values`.
template <bool kValueScales>
void softmax_row(const Span& span, const SpanScratch& scratch, const RowState& state, std::size_t values,
                 std::size_t i) {
  const __m512 minus_inf = _mm512_set1_ps(-__builtin_inff());
  const float* row = scratch.s + i * scratch.s_ld;
  std::uint16_t* weights = scratch.p + i * scratch.p_ld;
  const std::ptrdiff_t begin = span.lo[i], end = std::max<std::ptrdiff_t>(span.hi[i], begin);
  __m512 max0 = minus_inf, max1 = minus_inf;
  std::ptrdiff_t j = begin & ~std::ptrdiff_t{15};
  if (j < begin && j < end) {
    max0 = _mm512_mask_loadu_ps(minus_inf, key_lanes(j, begin, end), row + j);
    j += 16;
  }
  for (; j + 32 <= end; j += 32) {
    max0 = _mm512_max_ps(max0, _mm512_loadu_ps(row + j));
    max1 = _mm512_max_ps(max1, _mm512_loadu_ps(row + j + 16));
  }
  for (; j < end; j += 16) max0 = _mm512_max_ps(max0, _mm512_mask_loadu_ps(minus_inf, key_lanes(j, begin, end), row + j));
  const float row_max = _mm512_reduce_max_ps(_mm512_max_ps(max0, max1));
  // scale > 0: the maximum of the scaled row. NaN scores are not maxima (std::max keeps
  // m): they reach P below, and through it the output.
  float& m = state.m[i];
  const float m_new = std::max(m, row_max * span.scale);
  const bool none = m_new == -__builtin_inff();
  const float shift = none ? 0.0f : m_new;
  const float alpha = none ? 1.0f : std::exp(m - shift);
  state.alpha[i] = alpha;
  m = m_new;
  const __m512 factor = _mm512_set1_ps(span.scale * kLog2e), offset = _mm512_set1_ps(shift * kLog2e);
  const std::size_t first = static_cast<std::size_t>(begin) & ~(kTileValues - 1);
  std::fill(weights, weights + first, std::uint16_t{0});
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  std::size_t u = first;
  for (; static_cast<std::ptrdiff_t>(u) < end; u += kTileValues) {
    const std::ptrdiff_t at = static_cast<std::ptrdiff_t>(u);
    const bool whole = at >= begin && at + 32 <= end;
    const __m512 s0 = whole ? _mm512_loadu_ps(row + u) : _mm512_mask_loadu_ps(minus_inf, key_lanes(at, begin, end), row + u);
    const __m512 s1 = whole ? _mm512_loadu_ps(row + u + 16)
                            : _mm512_mask_loadu_ps(minus_inf, key_lanes(at + 16, begin, end), row + u + 16);
    __m512 p0 = exp2_of(_mm512_fmsub_ps(s0, factor, offset));
    __m512 p1 = exp2_of(_mm512_fmsub_ps(s1, factor, offset));
    sum0 = _mm512_add_ps(sum0, p0);
    sum1 = _mm512_add_ps(sum1, p1);
    if constexpr (kValueScales) {  // the row's keys only: others' weights stay 0 whatever their scale
      p0 = _mm512_mul_ps(p0, _mm512_maskz_loadu_ps(key_lanes(at, begin, end), span.value_scales + u));
      p1 = _mm512_mul_ps(p1, _mm512_maskz_loadu_ps(key_lanes(at + 16, begin, end), span.value_scales + u + 16));
    }
    _mm512_storeu_si512(weights + u, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0)));  // nearest even
  }
  std::fill(weights + u, weights + values, std::uint16_t{0});
  state.l[i] = state.l[i] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
}

// S_ij ·= ks_j for the rows' keys j < keys (the keys' row scales, Span::key_scales), in
// place before the softmax, which reads only each row's own keys.
void scale_scores(const Span& span, const SpanScratch& scratch) {
  for (std::size_t i = 0; i < span.count; ++i) {
    float* row = scratch.s + i * scratch.s_ld;
    for (std::size_t j = 0; j < span.keys; j += 16) {
      const __mmask16 m = span.keys - j >= 16 ? static_cast<__mmask16>(0xFFFF)
                                               : static_cast<__mmask16>((1u << (span.keys - j)) - 1);
      _mm512_mask_storeu_ps(row + j, m,
                            _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + j), _mm512_maskz_loadu_ps(m, span.key_scales + j)));
    }
  }
}

// acc_i *= alpha_i where alpha_i ≠ 1 (rows whose maximum grew), columns < dv.
void scale_rows(const RowState& state, std::size_t first, std::size_t end, std::size_t dv) {
  for (std::size_t i = first; i < end; ++i) {
    if (state.alpha[i] == 1.0f) continue;
    const __m512 a = _mm512_set1_ps(state.alpha[i]);
    float* row = state.acc + i * state.acc_ld;
    for (std::size_t x = 0; x < dv; x += 16) _mm512_storeu_ps(row + x, _mm512_mul_ps(_mm512_loadu_ps(row + x), a));
  }
}

// S = Q·K_spanᵀ for every row tile: one 2 × 2 C block per 32 keys and 32 rows (each key
// block's tiles loaded from L2 once, then reused from L1 by the second pair of row tiles).
void score_rows(const Span& span, const SpanScratch& scratch, std::size_t row_tiles) {
  const std::size_t q_ld = query_ld(span.d), block_words = key_block_words(span.d);
  for (std::size_t n0 = 0; n0 < span.keys; n0 += 2 * kTileWords) {
    const std::uint32_t* k_column =
        span.k_blocks + n0 / kKeyBlock * block_words + n0 % kKeyBlock / kTileWords * kTileWordsPerTile;
    for (std::size_t m0 = 0; m0 < row_tiles; m0 += 2 * kTileRows) {
      float* block = scratch.s + m0 * scratch.s_ld + n0;
      if (m0 + kTileRows < row_tiles) score_block<true>(span.q, q_ld, m0, k_column, block, scratch.s_ld);
      else score_block<false>(span.q, q_ld, m0, k_column, block, scratch.s_ld);
    }
  }
}

// acc += P·V over the span for every row tile: one C block per 32 rows and 32 columns.
void weighted_rows(const Span& span, const SpanScratch& scratch, const RowState& state, std::size_t values,
                   std::size_t row_tiles) {
  for (std::size_t m0 = 0; m0 < row_tiles; m0 += 2 * kTileRows) {
    const bool two_rows = m0 + kTileRows < row_tiles;
    const std::uint16_t* p_rows = scratch.p + m0 * scratch.p_ld;
    for (std::size_t n0 = 0; n0 < span.dv; n0 += 2 * kTileWords) {
      const bool two_columns = n0 + kTileWords < span.dv;
      const std::uint32_t* v_column = span.v_pairs + n0;
      float* c = state.acc + m0 * state.acc_ld + n0;
      if (two_rows && two_columns)
        weighted_block<true, true>(p_rows, scratch.p_ld, values, v_column, span.v_ld, c, state.acc_ld);
      else if (two_rows)
        weighted_block<true, false>(p_rows, scratch.p_ld, values, v_column, span.v_ld, c, state.acc_ld);
      else if (two_columns)
        weighted_block<false, true>(p_rows, scratch.p_ld, values, v_column, span.v_ld, c, state.acc_ld);
      else
        weighted_block<false, false>(p_rows, scratch.p_ld, values, v_column, span.v_ld, c, state.acc_ld);
    }
  }
}

}  // namespace

void AttendSpan(const Span& span, const SpanScratch& scratch, const RowState& state) {
  if (span.count == 0 || span.keys == 0) return;
  const CallTiles tiles;
  const std::size_t values = round_up(span.keys, kTileValues), row_tiles = round_up(span.count, kTileRows);
  for (std::size_t i = span.count; i < row_tiles; ++i)  // the tiles' rows past the queries
    std::fill(scratch.p + i * scratch.p_ld, scratch.p + i * scratch.p_ld + values, std::uint16_t{0});
  score_rows(span, scratch, row_tiles);
  if (span.key_scales != nullptr) scale_scores(span, scratch);
  for (std::size_t i = 0; i < span.count; ++i) {
    if (span.value_scales != nullptr) softmax_row<true>(span, scratch, state, values, i);
    else softmax_row<false>(span, scratch, state, values, i);
  }
  scale_rows(state, 0, span.count, span.dv);
  weighted_rows(span, scratch, state, values, row_tiles);
}

}  // namespace qkv::cpu::amx

#pragma GCC pop_options
#pragma GCC diagnostic pop

#else  // not x86-64: amx::available() is false, so these are never called.

#include "qkv/error.hpp"

namespace qkv::cpu::amx {
[[noreturn]] static void unavailable() { throw Error("AMX tiles: not compiled for this CPU"); }
void PackKeyPairs(const bfloat16*, std::int64_t, std::size_t, std::size_t, std::uint32_t*) { unavailable(); }
void PackQueryRows(const bfloat16*, std::int64_t, std::size_t, std::size_t, std::uint16_t*) { unavailable(); }
void AttendSpan(const Span&, const SpanScratch&, const RowState&) { unavailable(); }
}  // namespace qkv::cpu::amx
#endif
