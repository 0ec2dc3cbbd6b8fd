// The VNNI kernels of int8_dot.hpp (the pragma below is the target attribute on each).
// Scores: a register tile of R query rows × 4 keys of int32 accumulators, lanes over the
// head dim (64 bytes a step: 4 key loads, R query loads, 4·R vpdpbusd), then each row's
// 4 accumulators reduced to 4 sums by an unpack/shuffle tree. Sums are exact integers, so
// the order does not matter and results never depend on threads.
#include "cpu/int8_dot.hpp"

#include <algorithm>
#include <cmath>

#if defined(__x86_64__)
// GCC 12's intrinsics build on _mm512_undefined_*(): see bf16_dot.cpp.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

namespace qkv::cpu::int8dot {
namespace {

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
void tile(const std::int8_t* q8, std::size_t q8_ld, const float* q_scale, const std::int32_t* q_bias,
          const std::int8_t* const* k, std::size_t d, float* scores, std::size_t ld) {
  __m512i acc[R][4];
  for (std::size_t r = 0; r < R; ++r)
    for (std::size_t j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (std::size_t c = 0; c < d; c += 64) {
    // Bytes past d load as 0 and flip to 128; the query's padding is 0, so they add 0.
    const __mmask64 m = d - c >= 64 ? ~__mmask64{0} : (__mmask64{1} << (d - c)) - 1;
    __m512i key[4];
    for (std::size_t j = 0; j < 4; ++j) key[j] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, k[j] + c), flip);
    for (std::size_t r = 0; r < R; ++r) {
      const __m512i q = _mm512_loadu_si512(q8 + r * q8_ld + c);
      for (std::size_t j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], key[j], q);
    }
  }
  for (std::size_t r = 0; r < R; ++r) {
    const __m128i dot = _mm_sub_epi32(sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), _mm_set1_epi32(q_bias[r]));
    _mm_storeu_ps(scores + r * ld, _mm_mul_ps(_mm_cvtepi32_ps(dot), _mm_set1_ps(q_scale[r])));
  }
}

}  // namespace

void QuantizeQueries(const float* q, std::size_t rows, std::size_t q_ld, std::size_t d, std::int8_t* q8,
                     float* q_scale, std::int32_t* q_bias) {
  const std::size_t ld = query_ld(d);
  for (std::size_t r = 0; r < rows; ++r) {
    const float* in = q + r * q_ld;
    std::int8_t* out = q8 + r * ld;
    float largest = 0.0f;
    for (std::size_t c = 0; c < d; ++c) largest = std::max(largest, std::fabs(in[c]));
    // A row of zeros has scale 0 (its scores are 0); a NaN/Inf row gets a NaN scale, so
    // its scores are NaN as the float arithmetic's would be (never a silently finite row).
    const bool finite = std::isfinite(largest);
    const float s = finite ? largest / 127.0f : std::nanf("");
    const float inverse = finite && largest > 0.0f ? 127.0f / largest : 0.0f;
    std::int32_t sum = 0;
    for (std::size_t c = 0; c < d; ++c) {
      const auto v = static_cast<std::int8_t>(std::lrintf(std::clamp(in[c] * inverse, -127.0f, 127.0f)));
      out[c] = v;
      sum += v;
    }
    std::fill(out + d, out + ld, std::int8_t{0});
    q_scale[r] = s;
    q_bias[r] = 128 * sum;
  }
}

void Scores(std::size_t rows, const std::int8_t* q8, std::size_t q8_ld, const float* q_scale,
            const std::int32_t* q_bias, const std::int8_t* const* k, std::size_t d, std::size_t keys,
            float* scores, std::size_t ld) {
  for (std::size_t j = 0; j < keys; j += 4) {
    std::size_t r = 0;
    for (; r + 4 <= rows; r += 4)
      tile<4>(q8 + r * q8_ld, q8_ld, q_scale + r, q_bias + r, k + j, d, scores + r * ld + j, ld);
    switch (rows - r) {
      case 3: tile<3>(q8 + r * q8_ld, q8_ld, q_scale + r, q_bias + r, k + j, d, scores + r * ld + j, ld); break;
      case 2: tile<2>(q8 + r * q8_ld, q8_ld, q_scale + r, q_bias + r, k + j, d, scores + r * ld + j, ld); break;
      case 1: tile<1>(q8 + r * q8_ld, q8_ld, q_scale + r, q_bias + r, k + j, d, scores + r * ld + j, ld); break;
      default: break;
    }
  }
}

}  // namespace qkv::cpu::int8dot

#pragma GCC pop_options
#pragma GCC diagnostic pop

#else  // not x86-64: dot_products.cpp never reports the unit, so these are never called.

#include "qkv/error.hpp"

namespace qkv::cpu::int8dot {
[[noreturn]] static void unavailable() { throw Error("int8 dot products: not compiled for this CPU"); }
void QuantizeQueries(const float*, std::size_t, std::size_t, std::size_t, std::int8_t*, float*, std::int32_t*) {
  unavailable();
}
void Scores(std::size_t, const std::int8_t*, std::size_t, const float*, const std::int32_t*, const std::int8_t* const*,
            std::size_t, std::size_t, float*, std::size_t) {
  unavailable();
}
}  // namespace qkv::cpu::int8dot
#endif
