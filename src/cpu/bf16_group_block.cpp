// The AVX512-BF16 pair step of bf16_group_block.hpp. Every function here is compiled for
// avx512f/bw/vl/bf16 and runs only where dot_products.cpp found the unit.
//
// Scores: a register tile of up to 4 rows × 4 keys of accumulators with lanes along d
// (each loaded key chunk feeds every row, each row's chunk 4 keys), summed across lanes by
// a transpose-add tree (LeafSums, Join) into one vector of 16 keys. Per key and head that
// is d/32 vdpbf16ps and ~3 shuffles or adds, against the float step's d/16 FMAs and a
// tree as long.
//
// P·V: two keys' value rows interleaved into pairs (one unpack per 16 pairs, shared by
// every row of the group), times the pair of that row's weights broadcast: d_v/16
// vdpbf16ps per key pair and head, against the float step's d_v/8 FMAs. The unpacks
// leave each 128-bit lane's channels in two halves; the block's sums are put back in
// channel order once, when they are added to the row's accumulators.
#include "cpu/bf16_group_block.hpp"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC bug 105593, as bf16_dot.cpp
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cstring>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

namespace qkv::cpu::bf16dot {
namespace {

constexpr std::size_t kLanes = 16;
constexpr std::size_t kChunk = 32;    // bfloat16 values a zmm holds
constexpr std::size_t kTileRows = 4;  // 4 rows × 4 keys: 16 accumulators, 4 key chunks, a query chunk
constexpr std::size_t kLeafKeys = 4;

__m512bh AsPairs(__m512i x) { return reinterpret_cast<__m512bh>(x); }

// The lanes t + l < keys of a vector starting at t.
__mmask16 LanesBelow(std::size_t keys, std::size_t t) {
  if (t >= keys) return 0;
  return keys - t >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (keys - t)) - 1);
}

// The tree that sums each key's lanes, on shuffles that take two sources and leave them
// intact (no register copies, unlike the two-source permutes): four keys' vectors become
// one whose 128-bit lane L holds, at element e, key e's sum over lane L's channels
// (unpacks of floats, then of float pairs) ...
__m512 LeafSums(const __m512 (&a)[4]) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  const __m512d x = _mm512_castps_pd(s01), y = _mm512_castps_pd(s23);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

// ... and two such vectors join by 128-bit lanes: (x.L0 + x.L1, x.L2 + x.L3, y.L0 + y.L1,
// y.L2 + y.L3). Twice: keys 0..3 | 4..7 halves, then lane L holds keys 4L..4L+3 whole, so
// lane t of the result is key t's sum.
__m512 Join(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

// out[r], lane t: row r's sum for key k[t], t < N (4, 8 or 16).
template <std::size_t N, std::size_t R>
inline void ScoreTree(const bfloat16* q, std::size_t d, const bfloat16* const* k, __m512 (&out)[R]) {
  if constexpr (N == kLeafKeys) {
    __m512 acc[R][kLeafKeys];
    for (std::size_t r = 0; r < R; ++r)
      for (std::size_t j = 0; j < kLeafKeys; ++j) acc[r][j] = _mm512_setzero_ps();
    for (std::size_t c = 0; c < d; c += kChunk) {
      __m512i kv[kLeafKeys];
      for (std::size_t j = 0; j < kLeafKeys; ++j) kv[j] = _mm512_loadu_si512(k[j] + c);
      for (std::size_t r = 0; r < R; ++r) {
        const __m512i qv = _mm512_loadu_si512(q + r * d + c);
        for (std::size_t j = 0; j < kLeafKeys; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], AsPairs(qv), AsPairs(kv[j]));
      }
    }
    for (std::size_t r = 0; r < R; ++r) out[r] = LeafSums(acc[r]);
  } else {
    __m512 lo[R], hi[R];
    ScoreTree<N / 2>(q, d, k, lo);
    ScoreTree<N / 2>(q, d, k + N / 2, hi);
    for (std::size_t r = 0; r < R; ++r) out[r] = Join(lo[r], hi[r]);
  }
}

template <std::size_t R>
void ScoreRows(const bfloat16* q, const bfloat16* const* k, std::size_t keys, std::size_t d, float scale,
               float* scores, std::size_t ld) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (std::size_t t = 0; t < keys; t += kLanes) {
    __m512 s[R];
    ScoreTree<kLanes>(q, d, k + t, s);
    for (std::size_t r = 0; r < R; ++r) _mm512_storeu_ps(scores + r * ld + t, _mm512_mul_ps(s[r], scale_v));
  }
}

// Channel order back from the unpacks: lo's lane 4L + i holds channel 8L + i of the
// 32-column chunk, hi's lane 4L + i channel 8L + 4 + i (L the 128-bit lane).
struct ChannelOrder {
  __m512i first, second;  // columns 0..15 and 16..31 of the chunk, from (lo, hi)
  ChannelOrder() {
    alignas(64) int a[kLanes], b[kLanes];
    for (int n = 0; n < static_cast<int>(kLanes); ++n) {
      const int w = n % 8;
      a[n] = w < 4 ? 4 * (n / 8) + w : 16 + 4 * (n / 8) + w - 4;
      b[n] = a[n] + 8;
    }
    first = _mm512_load_si512(a);
    second = _mm512_load_si512(b);
  }
};

// Rows [0, R) × C chunks of 32 columns from `col`: the block's sums, then acc·alpha + them.
template <std::size_t R, std::size_t C>
void ValueTile(const std::uint32_t* pw, std::size_t pw_ld, std::size_t keys, const bfloat16* const* v,
               std::size_t col, float* acc, std::size_t acc_ld, const float* alpha, const ChannelOrder& order) {
  __m512 sum[R][2 * C];
  for (std::size_t r = 0; r < R; ++r)
    for (std::size_t x = 0; x < 2 * C; ++x) sum[r][x] = _mm512_setzero_ps();
  const std::size_t pairs = (keys + 1) / 2;
  for (std::size_t m = 0; m < pairs; ++m) {
    const bool partner = 2 * m + 1 < keys;  // an odd block's last key pairs with zeros
    __m512i w[2 * C];
    for (std::size_t c = 0; c < C; ++c) {
      const __m512i x = _mm512_loadu_si512(v[2 * m] + col + c * kChunk);
      const __m512i y = partner ? _mm512_loadu_si512(v[2 * m + 1] + col + c * kChunk) : _mm512_setzero_si512();
      w[2 * c] = _mm512_unpacklo_epi16(x, y);
      w[2 * c + 1] = _mm512_unpackhi_epi16(x, y);
    }
    for (std::size_t r = 0; r < R; ++r) {
      const __m512bh p = AsPairs(_mm512_set1_epi32(static_cast<int>(pw[r * pw_ld + m])));
      for (std::size_t x = 0; x < 2 * C; ++x) sum[r][x] = _mm512_dpbf16_ps(sum[r][x], AsPairs(w[x]), p);
    }
  }
  for (std::size_t r = 0; r < R; ++r) {
    float* out = acc + r * acc_ld + col;
    const __m512 a = _mm512_set1_ps(alpha == nullptr ? 1.0f : alpha[r]);
    for (std::size_t c = 0; c < C; ++c) {
      const __m512 lo = sum[r][2 * c], hi = sum[r][2 * c + 1];
      float* o = out + c * kChunk;
      _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), a, _mm512_permutex2var_ps(lo, order.first, hi)));
      _mm512_storeu_ps(o + kLanes,
                       _mm512_fmadd_ps(_mm512_loadu_ps(o + kLanes), a, _mm512_permutex2var_ps(lo, order.second, hi)));
    }
  }
}

template <std::size_t R>
void ValueRows(const std::uint32_t* pw, std::size_t pw_ld, std::size_t keys, const bfloat16* const* v, std::size_t dv,
               float* acc, std::size_t acc_ld, const float* alpha, const ChannelOrder& order) {
  std::size_t col = 0;
  for (; col + 2 * kChunk <= dv; col += 2 * kChunk) ValueTile<R, 2>(pw, pw_ld, keys, v, col, acc, acc_ld, alpha, order);
  if (col < dv) ValueTile<R, 1>(pw, pw_ld, keys, v, col, acc, acc_ld, alpha, order);
}

// f.template operator()<R>(first_row) over rows in tiles of kTileRows (then 1 to 3).
template <class F>
void ForRowTiles(std::size_t rows, const F& f) {
  std::size_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) f.template operator()<kTileRows>(r);
  switch (rows - r) {
    case 3: return f.template operator()<3>(r);
    case 2: return f.template operator()<2>(r);
    case 1: return f.template operator()<1>(r);
    default: return;
  }
}

}  // namespace

void GroupScores(const bfloat16* q, std::size_t rows, const bfloat16* const* k, std::size_t keys, std::size_t d,
                 float scale, float* scores, std::size_t ld) {
  ForRowTiles(rows, [&]<std::size_t R>(std::size_t r) { ScoreRows<R>(q + r * d, k, keys, d, scale, scores + r * ld, ld); });
}

void GroupValues(const float* p, std::size_t p_ld, std::size_t rows, std::size_t keys, const bfloat16* const* v,
                 std::size_t dv, std::uint32_t* pairs, float* acc, std::size_t acc_ld, const float* alpha) {
  // Each row's P as bfloat16 (round to nearest even, once), in order: word m is the
  // pair (P_2m, P_2m+1); past the block, zeros.
  const std::size_t words = group_value_words(1, keys);  // per row: 16 words (32 weights) a step
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t t = 0; t < 2 * words; t += kLanes) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(LanesBelow(keys, t), p + r * p_ld + t));
      std::memcpy(pairs + r * words + t / 2, &h, sizeof h);
    }
  const ChannelOrder order;
  ForRowTiles(rows, [&]<std::size_t R>(std::size_t r) {
    ValueRows<R>(pairs + r * words, words, keys, v, dv, acc + r * acc_ld, acc_ld,
                 alpha == nullptr ? nullptr : alpha + r, order);
  });
}

}  // namespace qkv::cpu::bf16dot

#pragma GCC pop_options
#pragma GCC diagnostic pop

#else  // not x86-64: dot_products.cpp never reports the unit, so these are never called.

#include "qkv/error.hpp"

namespace qkv::cpu::bf16dot {
[[noreturn]] static void unavailable() { throw Error("bf16 dot products: not compiled for this CPU"); }
void GroupScores(const bfloat16*, std::size_t, const bfloat16* const*, std::size_t, std::size_t, float, float*,
                 std::size_t) { unavailable(); }
void GroupValues(const float*, std::size_t, std::size_t, std::size_t, const bfloat16* const*, std::size_t,
                 std::uint32_t*, float*, std::size_t, const float*) { unavailable(); }
}  // namespace qkv::cpu::bf16dot
#endif
