// A 16 × 16 transpose of 32-bit lanes in AVX-512 registers (amx_dot.cpp: P's weights into
// bf16 rows; amx_rows.cpp: K into pairs along d; bf16_dot.cpp: queries into pairs). Include
// it after the file's `#pragma GCC target` that enables avx512f: it has no target
// attribute of its own. x86-64 only.
#pragma once

#include <immintrin.h>

namespace qkv::cpu::avx512 {

// Transposes 16 rows of 16 floats in place (r[i] lane j ↔ r[j] lane i): 32 unpacks within
// 128-bit lanes, then 32 shuffles of 128-bit lanes across the rows.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  // r[4q + m] now holds, in 128-bit lane L, row 4L..4L+3's... of the group q: a 4 × 4
  // transpose of 128-bit lanes across the groups finishes it.
  for (int m = 0; m < 4; ++m) {
    const __m512 a = _mm512_shuffle_f32x4(r[m], r[4 + m], 0x44), b = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0x44);
    const __m512 c = _mm512_shuffle_f32x4(r[m], r[4 + m], 0xEE), d = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0xEE);
    t[m] = _mm512_shuffle_f32x4(a, b, 0x88);
    t[4 + m] = _mm512_shuffle_f32x4(a, b, 0xDD);
    t[8 + m] = _mm512_shuffle_f32x4(c, d, 0x88);
    t[12 + m] = _mm512_shuffle_f32x4(c, d, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

}  // namespace qkv::cpu::avx512
