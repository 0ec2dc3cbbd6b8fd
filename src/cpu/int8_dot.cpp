// The VNNI kernels of int8_dot.hpp (the pragma below is the target attribute on each).
//
// Scores: a register tile of R query rows × 4 keys × 2 terms of int32 accumulators, lanes
// over the head dim (64 bytes a step: 4 key loads, 2·R query loads, 8·R vpdpbusd), then
// each row's 4 accumulators per term reduced to 4 sums by an unpack/shuffle tree.
//
// P·V: vpdpbusd sums 4 adjacent byte products into one int32 lane, so the 4 bytes must be
// 4 keys' values of one channel. The block's value rows are therefore interleaved once per
// block, 4 keys at a time (two unpack levels per 64 channels: lane 4L + i of the k-th
// result holds channel 16L + 4k + i), into scratch that every row then reads; each row
// broadcasts its 4 weights (one int32) per step. After the block, a 4 × 4 transpose of
// 128-bit lanes puts the channels back in order.
#include "cpu/int8_dot.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__)
// GCC 12's intrinsics build on _mm512_undefined_*(): see bf16_dot.cpp.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cfloat>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,fma")

namespace qkv::cpu::int8dot {
namespace {

constexpr std::size_t kChannels = 64;  // bytes of one zmm: channels per step
// Scores with keys transposed (lanes over keys) from this many rows on: the transpose
// costs 4 shuffles per 16 keys × 4 channels, which pays once it serves a few rows; head
// dims up to 256 (the transposed block lives in registers and L1: 64 zmm).
constexpr std::size_t kTransposedRows = 3;
constexpr std::size_t kMaxQuads = 64;
// The lo terms' units, as multipliers (a division per vector costs more than the dots it
// finishes; 1/254 and 1/255 round by 2⁻²⁴ of a term already 2⁻⁸ of the sum).
constexpr float kLoQuery = 1.0f / 254.0f;
constexpr float kLoWeight = 1.0f / 255.0f;

__mmask64 bytes_below(std::size_t n) { return n >= 64 ? ~__mmask64{0} : (__mmask64{1} << n) - 1; }

// 64 bytes of a row that has n ≥ 1 left from p: a plain load when all 64 are the row's,
// else a masked one (zeros past the row, which it never reads). Masked byte loads cost
// far more than plain ones on the Zen 5 measured in bench/RESULTS.md §10 (most of the
// VNNI decode's time went to them), so the whole steps take plain loads.
__m512i load_row_bytes(const void* p, std::size_t n) {
  return n >= 64 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(bytes_below(n), p);
}
__mmask16 lanes_below(std::size_t n) { return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1); }

std::int32_t load_word(const std::uint8_t* p) {
  std::int32_t word;
  std::memcpy(&word, p, sizeof word);
  return word;
}

// The 4 sums of a row's 4 key accumulators, in lanes 0..3.
__m128i sum4(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
  const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
  const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
  // Each 128-bit lane: (s0, s1, s2, s3) partial sums.
  __m512i t = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
  t = _mm512_add_epi32(t, _mm512_shuffle_i32x4(t, t, 0x4E));
  t = _mm512_add_epi32(t, _mm512_shuffle_i32x4(t, t, 0xB1));
  return _mm512_castsi512_si128(t);
}

template <std::size_t R>
void score_tile(const Queries& q, const std::int8_t* const* k, std::size_t d, float* scores, std::size_t ld) {
  __m512i hi[R][4], lo[R][4];
  for (std::size_t r = 0; r < R; ++r)
    for (std::size_t j = 0; j < 4; ++j) hi[r][j] = lo[r][j] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (std::size_t c = 0; c < d; c += kChannels) {
    // Bytes past d load as 0 and flip to 128; the query's padding is 0, so they add 0.
    __m512i key[4];
    for (std::size_t j = 0; j < 4; ++j) key[j] = _mm512_xor_si512(load_row_bytes(k[j] + c, d - c), flip);
    for (std::size_t r = 0; r < R; ++r) {
      const __m512i qh = _mm512_loadu_si512(q.terms + 2 * r * q.ld + c);
      const __m512i ql = _mm512_loadu_si512(q.terms + (2 * r + 1) * q.ld + c);
      for (std::size_t j = 0; j < 4; ++j) {
        hi[r][j] = _mm512_dpbusd_epi32(hi[r][j], key[j], qh);
        lo[r][j] = _mm512_dpbusd_epi32(lo[r][j], key[j], ql);
      }
    }
  }
  for (std::size_t r = 0; r < R; ++r) {
    const __m128i h = _mm_sub_epi32(sum4(hi[r][0], hi[r][1], hi[r][2], hi[r][3]), _mm_set1_epi32(q.bias[2 * r]));
    const __m128i l = _mm_sub_epi32(sum4(lo[r][0], lo[r][1], lo[r][2], lo[r][3]), _mm_set1_epi32(q.bias[2 * r + 1]));
    const __m128 sum = _mm_fmadd_ps(_mm_cvtepi32_ps(l), _mm_set1_ps(kLoQuery), _mm_cvtepi32_ps(h));
    _mm_storeu_ps(scores + r * ld, _mm_mul_ps(sum, _mm_set1_ps(q.scale[r])));
  }
}

// Keys transposed, 16 at a time: for each 64-channel block, the 16 keys' rows (16 dwords
// of 4 channels each) become 16 vectors whose lane i is key i's dword q (a 16 × 16
// transpose of dwords: unpacks of 32 and 64 bits, then a 4 × 4 transpose of 128-bit
// lanes), flipped to k + 128. to[cb·16 + q] for each block cb.
void transpose_keys(const std::int8_t* const* k, std::size_t count, std::size_t d, __m512i* to) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (std::size_t cb = 0; cb * kChannels < d; ++cb) {
    __m512i r[16], a[16], b[16];
    for (std::size_t i = 0; i < 16; ++i) r[i] = load_row_bytes(k[std::min(i, count - 1)] + cb * kChannels, d - cb * kChannels);
    for (std::size_t i = 0; i < 16; i += 2) {
      a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
      a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (std::size_t i = 0; i < 16; i += 4) {  // b[i + m], lane L: keys i..i+3, dword 4L + m
      b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
      b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
      b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
      b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
    }
    __m512i* out = to + cb * 16;
    for (std::size_t mq = 0; mq < 4; ++mq) {
      const __m512i t0 = _mm512_shuffle_i32x4(b[mq], b[4 + mq], 0x44), t1 = _mm512_shuffle_i32x4(b[8 + mq], b[12 + mq], 0x44);
      const __m512i t2 = _mm512_shuffle_i32x4(b[mq], b[4 + mq], 0xEE), t3 = _mm512_shuffle_i32x4(b[8 + mq], b[12 + mq], 0xEE);
      out[mq] = _mm512_xor_si512(_mm512_shuffle_i32x4(t0, t1, 0x88), flip);
      out[4 + mq] = _mm512_xor_si512(_mm512_shuffle_i32x4(t0, t1, 0xDD), flip);
      out[8 + mq] = _mm512_xor_si512(_mm512_shuffle_i32x4(t2, t3, 0x88), flip);
      out[12 + mq] = _mm512_xor_si512(_mm512_shuffle_i32x4(t2, t3, 0xDD), flip);
    }
  }
}

// R rows × 16 transposed keys: lanes over keys, so no reduction: each step broadcasts
// one dword (4 channels) of each row's two terms.
template <std::size_t R>
void score_rows(const Queries& q, const __m512i* keys, std::size_t quads, std::size_t count, float* scores,
                std::size_t ld) {
  __m512i hi[R], lo[R];
  for (std::size_t r = 0; r < R; ++r) hi[r] = lo[r] = _mm512_setzero_si512();
  for (std::size_t c = 0; c < quads; ++c) {
    const __m512i key = _mm512_loadu_si512(keys + c);
    for (std::size_t r = 0; r < R; ++r) {
      std::int32_t h, l;
      std::memcpy(&h, q.terms + 2 * r * q.ld + 4 * c, sizeof h);
      std::memcpy(&l, q.terms + (2 * r + 1) * q.ld + 4 * c, sizeof l);
      hi[r] = _mm512_dpbusd_epi32(hi[r], key, _mm512_set1_epi32(h));
      lo[r] = _mm512_dpbusd_epi32(lo[r], key, _mm512_set1_epi32(l));
    }
  }
  const __mmask16 m = lanes_below(count);
  for (std::size_t r = 0; r < R; ++r) {
    const __m512 h = _mm512_cvtepi32_ps(_mm512_sub_epi32(hi[r], _mm512_set1_epi32(q.bias[2 * r])));
    const __m512 l = _mm512_cvtepi32_ps(_mm512_sub_epi32(lo[r], _mm512_set1_epi32(q.bias[2 * r + 1])));
    const __m512 sum = _mm512_fmadd_ps(l, _mm512_set1_ps(kLoQuery), h);
    _mm512_mask_storeu_ps(scores + r * ld, m, _mm512_mul_ps(sum, _mm512_set1_ps(q.scale[r])));
  }
}

// Weight scratch: the rows' steps t_r, each as t_r·2^e and 2^−e (e = 100 for weights near
// the subnormals, where t_r itself would keep a few bits; else 0), then per row its hi
// bytes and its lo bytes, `keys` each.
std::size_t steps_bytes(std::size_t rows) { return (2 * rows * sizeof(float) + 63) / 64 * 64; }

// Rows r < R of one 64-channel block cb: Σ_j P'_rj v_j from the interleaved values, then
// acc_r = acc_r·alpha_r + that, channels < dv.
template <std::size_t R>
void weighted_tile(std::size_t keys, const std::uint8_t* const* hi, const std::uint8_t* const* lo, const float* step,
                   const std::int8_t* values, std::size_t blocks, std::size_t cb, std::size_t dv, const float* alpha,
                   float* const* acc) {
  __m512i sum_hi[R][4], sum_lo[R][4];
  for (std::size_t r = 0; r < R; ++r)
    for (std::size_t k = 0; k < 4; ++k) sum_hi[r][k] = sum_lo[r][k] = _mm512_setzero_si512();
  for (std::size_t j = 0; j < keys; j += 4) {
    const std::int8_t* x = values + ((j / 4) * blocks + cb) * 4 * kChannels;
    __m512i v[4];
    for (std::size_t k = 0; k < 4; ++k) v[k] = _mm512_loadu_si512(x + k * kChannels);
    for (std::size_t r = 0; r < R; ++r) {
      const __m512i wh = _mm512_set1_epi32(load_word(hi[r] + j));
      const __m512i wl = _mm512_set1_epi32(load_word(lo[r] + j));
      for (std::size_t k = 0; k < 4; ++k) {
        sum_hi[r][k] = _mm512_dpbusd_epi32(sum_hi[r][k], wh, v[k]);
        sum_lo[r][k] = _mm512_dpbusd_epi32(sum_lo[r][k], wl, v[k]);
      }
    }
  }
  const __m512 lo_unit = _mm512_set1_ps(kLoWeight);
  for (std::size_t r = 0; r < R; ++r) {
    __m512 f[4];
    for (std::size_t k = 0; k < 4; ++k)
      f[k] = _mm512_mul_ps(_mm512_mul_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_lo[r][k]), lo_unit,
                                                         _mm512_cvtepi32_ps(sum_hi[r][k])),
                                         _mm512_set1_ps(step[2 * r])),
                           _mm512_set1_ps(step[2 * r + 1]));
    // f[k]'s 128-bit lane L holds channels 16L + 4k .. 16L + 4k + 3: transpose the lanes.
    const __m512 t0 = _mm512_shuffle_f32x4(f[0], f[1], 0x44), t1 = _mm512_shuffle_f32x4(f[2], f[3], 0x44);
    const __m512 t2 = _mm512_shuffle_f32x4(f[0], f[1], 0xEE), t3 = _mm512_shuffle_f32x4(f[2], f[3], 0xEE);
    const __m512 ordered[4] = {_mm512_shuffle_f32x4(t0, t1, 0x88), _mm512_shuffle_f32x4(t0, t1, 0xDD),
                               _mm512_shuffle_f32x4(t2, t3, 0x88), _mm512_shuffle_f32x4(t2, t3, 0xDD)};
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (std::size_t n = 0; n < 4; ++n) {
      const std::size_t c = cb * kChannels + 16 * n;
      if (c >= dv) break;
      const __mmask16 m = lanes_below(dv - c);
      const __m512 old = _mm512_maskz_loadu_ps(m, acc[r] + c);
      _mm512_mask_storeu_ps(acc[r] + c, m, _mm512_fmadd_ps(old, a, ordered[n]));
    }
  }
}

}  // namespace

void QuantizeQueries(const float* q, std::size_t rows, std::size_t q_ld, std::size_t d, Queries out) {
  for (std::size_t r = 0; r < rows; ++r) {
    const float* in = q + r * q_ld;
    std::int8_t* hi = out.terms + 2 * r * out.ld;
    std::int8_t* lo = hi + out.ld;
    float largest = 0.0f;
    bool finite = true;
    for (std::size_t c = 0; c < d; ++c) {
      finite = finite && std::isfinite(in[c]);
      largest = std::max(largest, std::fabs(in[c]));
    }
    const bool usable = finite && largest > 0.0f;
    const float s = !finite ? std::nanf("") : largest / 127.0f;
    std::int32_t sum_hi = 0, sum_lo = 0;
    for (std::size_t c = 0; c < d; ++c) {
      std::int8_t h = 0, l = 0;
      if (usable) {  // in double: 127/largest overflows float for a subnormal largest
        const double t = static_cast<double>(in[c]) * (127.0 / static_cast<double>(largest));
        const double rounded = std::clamp(std::nearbyint(t), -127.0, 127.0);
        h = static_cast<std::int8_t>(rounded);
        l = static_cast<std::int8_t>(std::clamp(std::nearbyint((t - rounded) * 254.0), -127.0, 127.0));
      }
      hi[c] = h;
      lo[c] = l;
      sum_hi += h;
      sum_lo += l;
    }
    std::fill(hi + d, hi + out.ld, std::int8_t{0});
    std::fill(lo + d, lo + out.ld, std::int8_t{0});
    out.scale[r] = s;
    out.bias[2 * r] = 128 * sum_hi;
    out.bias[2 * r + 1] = 128 * sum_lo;
  }
}

void Scores(std::size_t rows, Queries q, const std::int8_t* const* k, std::size_t d, std::size_t keys,
            float* scores, std::size_t ld, Prefetch ahead) {
  const std::size_t quads = (d + kChannels - 1) / kChannels * 16;
  if (rows >= kTransposedRows && quads <= kMaxQuads) {  // keys transposed once for all rows
    __m512i transposed[kMaxQuads];
    for (std::size_t j = 0; j < keys; j += 16) {
      const std::size_t count = std::min<std::size_t>(16, keys - j);
      for (std::size_t i = 0; i < 16; ++i) ahead(j + i);
      transpose_keys(k + j, count, d, transposed);
      std::size_t r = 0;
      for (; r + 4 <= rows; r += 4) score_rows<4>(q.rows_from(r), transposed, quads, count, scores + r * ld + j, ld);
      switch (rows - r) {
        case 3: score_rows<3>(q.rows_from(r), transposed, quads, count, scores + r * ld + j, ld); break;
        case 2: score_rows<2>(q.rows_from(r), transposed, quads, count, scores + r * ld + j, ld); break;
        case 1: score_rows<1>(q.rows_from(r), transposed, quads, count, scores + r * ld + j, ld); break;
        default: break;
      }
    }
    return;
  }
  for (std::size_t j = 0; j < keys; j += 4) {
    for (std::size_t i = 0; i < 4; ++i) ahead(j + i);
    std::size_t r = 0;
    for (; r + 2 <= rows; r += 2) score_tile<2>(q.rows_from(r), k + j, d, scores + r * ld + j, ld);
    if (r < rows) score_tile<1>(q.rows_from(r), k + j, d, scores + r * ld + j, ld);
  }
}

std::size_t weight_bytes(std::size_t rows, std::size_t keys) { return steps_bytes(rows) + 2 * rows * keys; }

std::size_t value_bytes(std::size_t keys, std::size_t dv) {
  return (keys + 3) / 4 * ((dv + kChannels - 1) / kChannels) * 4 * kChannels;
}

bool AddWeighted(std::size_t rows, const float* p, std::size_t p_ld, std::size_t keys, const std::int8_t* const* v,
                 std::size_t dv, const float* alpha, float* acc, std::size_t acc_ld, std::uint8_t* weight_scratch,
                 std::int8_t* value_scratch, Prefetch ahead) {
  // Each row's largest weight; a negative, NaN or infinite one leaves it to the floats.
  float* step = reinterpret_cast<float*>(weight_scratch);
  std::uint8_t* bytes = weight_scratch + steps_bytes(rows);
  const __m512 huge = _mm512_set1_ps(FLT_MAX), zero = _mm512_setzero_ps();
  for (std::size_t r = 0; r < rows; ++r) {
    const float* row = p + r * p_ld;
    __m512 largest = zero;
    __mmask16 bad = 0;
    for (std::size_t j = 0; j < keys; j += 16) {
      const __m512 x = _mm512_maskz_loadu_ps(lanes_below(keys - j), row + j);
      bad = static_cast<__mmask16>(bad | _mm512_cmp_ps_mask(x, huge, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ));
      largest = _mm512_max_ps(largest, x);
    }
    if (bad != 0) return false;
    step[2 * r] = _mm512_reduce_max_ps(largest);  // the row's largest weight until below
  }
  // hi = ⌊P'/t⌋, lo = round((P'/t − hi)·255), both clamped to [0, 255]. A block far below
  // the row's maximum (logits ~90 under it: long ALiBi distances) has weights near the
  // subnormals, where 1/t overflows: they are scaled by 2¹⁰⁰ first (exactly).
  const __m512 top = _mm512_set1_ps(255.0f);
  for (std::size_t r = 0; r < rows; ++r) {
    const float* row = p + r * p_ld;
    std::uint8_t* hi = bytes + 2 * r * keys;
    std::uint8_t* lo = hi + keys;
    const float largest = step[2 * r];
    const float pre = largest < 0x1p-100f ? 0x1p100f : 1.0f;
    step[2 * r] = largest * pre / 255.0f;
    step[2 * r + 1] = 1.0f / pre;
    const __m512 lift = _mm512_set1_ps(pre);
    const __m512 inverse = _mm512_set1_ps(largest > 0.0f ? 255.0f / (largest * pre) : 0.0f);
    for (std::size_t j = 0; j < keys; j += 16) {
      const __mmask16 m = lanes_below(keys - j);
      const __m512 t = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + j), lift), inverse);
      const __m512 h = _mm512_min_ps(_mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC), top);
      const __m512 l = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_sub_ps(t, h), top), zero), top);
      _mm512_mask_cvtusepi32_storeu_epi8(hi + j, m, _mm512_cvtps_epu32(h));
      _mm512_mask_cvtusepi32_storeu_epi8(lo + j, m, _mm512_cvtps_epu32(l));  // rounds to nearest
    }
  }
  // The block's values, 4 keys interleaved per 64-channel block.
  const std::size_t blocks = (dv + kChannels - 1) / kChannels;
  for (std::size_t j = 0; j < keys; j += 4) {
    for (std::size_t i = 0; i < 4; ++i) ahead(j + i);
    for (std::size_t cb = 0; cb < blocks; ++cb) {
      __m512i row[4];
      for (std::size_t t = 0; t < 4; ++t) row[t] = load_row_bytes(v[j + t] + cb * kChannels, dv - cb * kChannels);
      const __m512i a = _mm512_unpacklo_epi8(row[0], row[1]), b = _mm512_unpackhi_epi8(row[0], row[1]);
      const __m512i c = _mm512_unpacklo_epi8(row[2], row[3]), e = _mm512_unpackhi_epi8(row[2], row[3]);
      std::int8_t* to = value_scratch + ((j / 4) * blocks + cb) * 4 * kChannels;
      _mm512_storeu_si512(to, _mm512_unpacklo_epi16(a, c));
      _mm512_storeu_si512(to + kChannels, _mm512_unpackhi_epi16(a, c));
      _mm512_storeu_si512(to + 2 * kChannels, _mm512_unpacklo_epi16(b, e));
      _mm512_storeu_si512(to + 3 * kChannels, _mm512_unpackhi_epi16(b, e));
    }
  }
  for (std::size_t cb = 0; cb < blocks; ++cb)
    for (std::size_t r = 0; r < rows; r += 2) {
      const std::uint8_t* hi[2] = {bytes + 2 * r * keys, bytes + 2 * std::min(r + 1, rows - 1) * keys};
      const std::uint8_t* lo[2] = {hi[0] + keys, hi[1] + keys};
      float* out[2] = {acc + r * acc_ld, acc + std::min(r + 1, rows - 1) * acc_ld};
      if (r + 2 <= rows) {
        weighted_tile<2>(keys, hi, lo, step + 2 * r, value_scratch, blocks, cb, dv, alpha + r, out);
      } else {
        weighted_tile<1>(keys, hi, lo, step + 2 * r, value_scratch, blocks, cb, dv, alpha + r, out);
      }
    }
  return true;
}

}  // namespace qkv::cpu::int8dot

#pragma GCC pop_options
#pragma GCC diagnostic pop

#else  // not x86-64: dot_products.cpp never reports the unit, so these are never called.

#include "qkv/error.hpp"

namespace qkv::cpu::int8dot {
[[noreturn]] static void unavailable() { throw Error("int8 dot products: not compiled for this CPU"); }
void QuantizeQueries(const float*, std::size_t, std::size_t, std::size_t, Queries) { unavailable(); }
void Scores(std::size_t, Queries, const std::int8_t* const*, std::size_t, std::size_t, float*, std::size_t, Prefetch) {
  unavailable();
}
std::size_t weight_bytes(std::size_t, std::size_t) { return 0; }
std::size_t value_bytes(std::size_t, std::size_t) { return 0; }
bool AddWeighted(std::size_t, const float*, std::size_t, std::size_t, const std::int8_t* const*, std::size_t,
                 const float*, float*, std::size_t, std::uint8_t*, std::int8_t*, Prefetch) {
  unavailable();
}
}  // namespace qkv::cpu::int8dot
#endif
