// Vectorized block operations shared by the forward and backward kernels: packing,
// the column-wise online softmax, finiteness checks. Score tiles are stored transposed,
// Sᵀ[key][query], so every softmax statistic is a lane-wise operation across queries
// (no horizontal reductions): row max over keys = elementwise Max down the tile.
//
// Exp is Highway's (contrib/math): max error 1 ULP in float32 over its valid range;
// inputs below -104 give 0 (exp(-104) is below the smallest float anyway), and we keep
// NaN inputs as NaN so a poisoned row stays visibly poisoned.
#if defined(QKV_CPU_BLOCK_OPS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_BLOCK_OPS_INL_H_
#undef QKV_CPU_BLOCK_OPS_INL_H_
#else
#define QKV_CPU_BLOCK_OPS_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "hwy/aligned_allocator.h"
#include "hwy/cache_control.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "core/dropout.hpp"
#include "qkv/error.hpp"
#include "cpu/scratch_cache.hpp"
#include "cpu/storage-inl.h"
#include "cpu/vec_array-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using FloatTag = hn::ScalableTag<float>;
using FloatVec = hn::Vec<FloatTag>;

inline constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
inline constexpr float kPlusInf = std::numeric_limits<float>::infinity();

HWY_INLINE size_t VectorLanes() { return hn::Lanes(FloatTag()); }

// Aligned scratch; Highway refuses zero-sized allocations, so ask for at least one.
// Highway returns null when the memory is not there: a qkv::Error then (the entry points
// allocate their per-call workspaces before any output is written), not a null write.
// Large blocks come from and go back to the workspace cache (scratch_cache.hpp).
inline hwy::AlignedFreeUniquePtr<float[]> AllocateFloats(size_t count) {
  auto memory = hwy::AllocateAligned<float>(count == 0 ? 1 : count, scratch_allocate, scratch_free, nullptr);
  if (memory == nullptr)
    throw Error("qkv: a workspace of " + std::to_string(count) + " floats could not be allocated (out of memory)");
  return memory;
}

// Whether Min/Max return their second operand when either is NaN (x86's MINPS/MAXPS
// rule), so that Max(bound, x) keeps a NaN x. Other targets make no such promise.
#if HWY_ARCH_X86 && HWY_TARGET != HWY_EMU128 && HWY_TARGET != HWY_SCALAR
inline constexpr bool kMinMaxKeepSecondNaN = true;
#else
inline constexpr bool kMinMaxKeepSecondNaN = false;
#endif

// e^x for the softmax, with NaN kept (a bad input must stay visible) and −inf → 0.
//
// Every exp of the kernels (P = e^(S − m), the rescale e^(m − m'), the backward's
// e^(S − lse)) goes through here, so it is a fifth of a forward block's instructions
// at d = 64. Highway's Exp (1 ULP, any input) spends ~26 operations and a NaN blend
// two more; this one ~15, by doing only what the kernels need:
//   n = round(x·log2 e)                       one FMA with the 1.5·2²³ rounding trick
//   r = x − n·ln2   (ln2 split in two parts: r exact to ~1 ULP; |r| ≤ ln2/2)
//   e^r ≈ 1 + r + r²·q(r)                     q of degree 4, fitted (Lawson-weighted
//                                             least squares, relative error 3·10⁻⁹)
//   e^x = e^r · 2^n                           2^n built from n's bits
// Measured against fp64 over [−88, 0] and near 0: ≤ 2 ULP (tests/cpp: fast_exp_test).
// Range: x is clamped to [−88, 89]; below −88 the result is exactly 0 (2^−127 has
// exponent bits 0: subnormal results below e^−87.3 are flushed too, far below any
// weight that can change a sum of at least 1), above 88.38 it is +inf (the true
// overflow is at 88.72: attention's arguments are ≤ 0 up to rounding).
HWY_INLINE FloatVec ExpKeepNaN(FloatTag d, FloatVec x) {
  const hn::RebindToSigned<FloatTag> di;
  const auto magic = hn::Set(d, 12582912.0f);  // 1.5·2²³: adding it rounds to an integer
  // Max(bound, NaN) is NaN on x86 (second operand), and NaN then flows through every
  // step below; elsewhere the NaN is put back at the end.
  const FloatVec clamped =
      hn::Min(hn::Set(d, 89.0f), hn::Max(hn::Set(d, -88.0f), x));
  const FloatVec shifted = hn::MulAdd(clamped, hn::Set(d, 1.44269504088896341f), magic);
  const FloatVec n = hn::Sub(shifted, magic);
  FloatVec r = hn::NegMulAdd(n, hn::Set(d, 0.693145751953125f), clamped);  // ln2, high bits (exact n·hi)
  r = hn::NegMulAdd(n, hn::Set(d, 1.428606765330187e-6f), r);              // ln2, the rest
  FloatVec q = hn::Set(d, 0.00138146f);
  q = hn::MulAdd(q, r, hn::Set(d, 0.00836871f));
  q = hn::MulAdd(q, r, hn::Set(d, 0.04166839f));
  q = hn::MulAdd(q, r, hn::Set(d, 0.16666521f));
  q = hn::MulAdd(q, r, hn::Set(d, 0.49999994f));
  const auto one = hn::Set(d, 1.0f);
  const FloatVec er = hn::MulAdd(hn::MulAdd(q, r, one), r, one);
  // shifted's bits are magic's plus n; 2^n's bits are (n + 127) << 23, 0 for n = −127.
  const auto bias = hn::Set(di, 127 - 0x4B400000);
  const FloatVec two_n = hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(hn::BitCast(di, shifted), bias)));
  const FloatVec result = hn::Mul(er, two_n);
  if constexpr (kMinMaxKeepSecondNaN) return result;
  return hn::IfThenElse(hn::IsNaN(x), x, result);
}

// Asks for every cache line of `rows` rows of `cols` elements, `row_stride` elements
// apart: the next block's operands, requested while this block computes.
template <class T>
HWY_INLINE void PrefetchRows(const T* data, int64_t row_stride, size_t rows, size_t cols) {
  constexpr size_t kLine = 64 / sizeof(T);
  for (size_t r = 0; r < rows; ++r)
    for (size_t c = 0; c < cols; c += kLine) hwy::Prefetch(data + static_cast<int64_t>(r) * row_stride + c);
}

// dst[c·ld + i] = scale · src(i, c) for i < rows, c < cols; columns rows ≤ i < width
// of dst are zeroed. `src` rows are `src_row` elements apart and contiguous along c; a
// 16-bit storage type is widened here (storage-inl.h).
template <class T>
HWY_INLINE void PackTransposed(const T* HWY_RESTRICT src, int64_t src_row, size_t rows,
                               size_t cols, float scale, float* HWY_RESTRICT dst, size_t ld,
                               size_t width) {
  for (size_t i = 0; i < rows; ++i) {
    const T* in = src + static_cast<int64_t>(i) * src_row;
    if constexpr (kIsHalf<T>) {
      // Widened with SIMD a chunk at a time: a scalar float16 conversion (~20 cycles) per
      // element would cost a few percent of the whole task's FMAs.
      float wide[kWidenChunk];
      for (size_t c0 = 0; c0 < cols; c0 += kWidenChunk) {
        const size_t n = std::min(kWidenChunk, cols - c0);
        WidenRows(in + c0, 0, 1, n, wide, n);
        for (size_t c = 0; c < n; ++c) dst[(c0 + c) * ld + i] = scale * wide[c];
      }
    } else {
      for (size_t c = 0; c < cols; ++c) dst[c * ld + i] = scale * in[c];
    }
  }
  for (size_t c = 0; c < cols; ++c)
    for (size_t i = rows; i < width; ++i) dst[c * ld + i] = 0.0f;
}

// dst[i·ld + c] = src(i, c) for i < rows, c < cols, zero-padded to ld columns.
HWY_INLINE void PackRowsPadded(const float* HWY_RESTRICT src, int64_t src_row, size_t rows,
                               size_t cols, float* HWY_RESTRICT dst, size_t ld) {
  for (size_t i = 0; i < rows; ++i) {
    const float* in = src + static_cast<int64_t>(i) * src_row;
    float* out = dst + i * ld;
    for (size_t c = 0; c < cols; ++c) out[c] = in[c];
    for (size_t c = cols; c < ld; ++c) out[c] = 0.0f;
  }
}

// True if every src(i, c), i < rows, c < cols, is finite.
HWY_INLINE bool AllFinite(const float* HWY_RESTRICT src, int64_t src_row, size_t rows,
                          size_t cols) {
  const FloatTag d;
  const size_t lanes = hn::Lanes(d);
  // x − x is 0 for finite x and NaN for ±inf and NaN; one sum per block tells.
  auto poison = hn::Zero(d);
  float scalar_poison = 0.0f;
  for (size_t i = 0; i < rows; ++i) {
    const float* in = src + static_cast<int64_t>(i) * src_row;
    size_t c = 0;
    for (; c + lanes <= cols; c += lanes) {
      const auto v = hn::LoadU(d, in + c);
      poison = hn::Add(poison, hn::Sub(v, v));
    }
    for (; c < cols; ++c) scalar_poison += in[c] - in[c];
  }
  return std::isfinite(hn::GetLane(hn::SumOfLanes(d, poison)) + scalar_poison);
}

// Masks a partial tile st[key][query] (`keys` rows, `width` columns, a multiple of the
// vector length): entry (j, i) becomes −inf where key first_key + j lies outside
// [key_begin[i], key_end[i]) or add[j][i] is −inf, and st + add[j][i] elsewhere (add null:
// the window/causal/padding edges only; rows of add are add_ld floats apart). key_begin
// and key_end hold `width` entries.
HWY_INLINE void MaskTile(float* HWY_RESTRICT st, size_t keys, size_t width, int64_t first_key,
                         const int32_t* HWY_RESTRICT key_begin,
                         const int32_t* HWY_RESTRICT key_end, const float* HWY_RESTRICT add,
                         size_t add_ld) {
  const FloatTag d;
  const hn::RebindToSigned<FloatTag> di;
  const size_t lanes = hn::Lanes(d);
  const auto minus_inf = hn::Set(d, kMinusInf);
  for (size_t j = 0; j < keys; ++j) {
    const auto key = hn::Set(di, static_cast<int32_t>(first_key + static_cast<int64_t>(j)));
    float* row = st + j * width;
    for (size_t i = 0; i < width; i += lanes) {
      auto visible = hn::RebindMask(d, hn::And(hn::Lt(key, hn::LoadU(di, key_end + i)),
                                               hn::Not(hn::Lt(key, hn::LoadU(di, key_begin + i)))));
      auto x = hn::LoadU(d, row + i);
      if (add != nullptr) {
        const auto a = hn::LoadU(d, add + j * add_ld + i);
        // Not(Eq), not Ne: Highway's Ne is ordered (false for NaN), which would remove a
        // key whose bias is NaN; PyTorch (and the reference) make that row NaN instead.
        visible = hn::AndNot(hn::Eq(a, minus_inf), visible);
        x = hn::Add(x, a);
      }
      hn::StoreU(hn::IfThenElse(visible, x, minus_inf), d, row + i);
    }
  }
}

// Soft-capping of a score tile: s ← c·tanh(s/c). With slope non-null, also stores
// ds_capped/ds = 1 − tanh² per entry (same layout) for the backward.
HWY_INLINE void SoftcapTile(float* HWY_RESTRICT st, size_t keys, size_t width, float cap,
                            float* HWY_RESTRICT slope) {
  const FloatTag d;
  const size_t lanes = hn::Lanes(d);
  const auto c = hn::Set(d, cap), inverse = hn::Set(d, 1.0f / cap), one = hn::Set(d, 1.0f);
  for (size_t e = 0; e < keys * width; e += lanes) {
    const auto t = hn::Tanh(d, hn::Mul(hn::LoadU(d, st + e), inverse));
    hn::StoreU(hn::Mul(c, t), d, st + e);
    if (slope != nullptr) hn::StoreU(hn::NegMulAdd(t, t, one), d, slope + e);
  }
}

// ALiBi: st[j][i] −= slope·|first_query + i + offset − (first_key + j)| (exact in float
// for positions below 2²⁴).
HWY_INLINE void AlibiTile(float* HWY_RESTRICT st, size_t keys, size_t width, int64_t first_key,
                          int64_t first_query_plus_offset, float slope) {
  const FloatTag d;
  const size_t lanes = hn::Lanes(d);
  const auto minus_slope = hn::Set(d, -slope);
  for (size_t j = 0; j < keys; ++j) {
    const float base = static_cast<float>(first_query_plus_offset - first_key - static_cast<int64_t>(j));
    float* row = st + j * width;
    for (size_t i = 0; i < width; i += lanes) {
      const auto distance = hn::Abs(hn::Add(hn::Iota(d, static_cast<float>(i)), hn::Set(d, base)));
      hn::StoreU(hn::MulAdd(minus_slope, distance, hn::LoadU(d, row + i)), d, row + i);
    }
  }
}

// Dropout on a weight tile pt[key][query]: kept entries × scale, dropped ones 0, with
// the bits of core/dropout.hpp (row_keys: the per-query row keys, `width` entries).
HWY_INLINE void DropoutTile(float* HWY_RESTRICT pt, size_t keys, size_t width, int64_t first_key,
                            const uint32_t* HWY_RESTRICT row_keys, uint32_t threshold,
                            float scale) {
  const FloatTag d;
  const hn::RebindToUnsigned<FloatTag> du;
  const hn::RebindToSigned<FloatTag> di;
  const size_t lanes = hn::Lanes(d);
  const auto sign = hn::Set(du, 0x80000000u);
  // Unsigned x ≥ threshold as a signed comparison with both sign bits flipped.
  const auto limit = hn::BitCast(di, hn::Xor(hn::Set(du, threshold), sign));
  const auto factor = hn::Set(d, scale);
  const auto m1 = hn::Set(du, 0x85EBCA6Bu), m2 = hn::Set(du, 0xC2B2AE35u);
  for (size_t j = 0; j < keys; ++j) {
    const uint32_t key = static_cast<uint32_t>(first_key + static_cast<int64_t>(j));
    const auto salt = hn::Set(du, key * detail::kDropoutKeyStep + detail::kDropoutKeyBias);
    float* row = pt + j * width;
    for (size_t i = 0; i < width; i += lanes) {
      auto x = hn::Xor(hn::LoadU(du, row_keys + i), salt);  // fmix32, lane-wise
      x = hn::Xor(x, hn::ShiftRight<16>(x));
      x = hn::Mul(x, m1);
      x = hn::Xor(x, hn::ShiftRight<13>(x));
      x = hn::Mul(x, m2);
      x = hn::Xor(x, hn::ShiftRight<16>(x));
      const auto kept = hn::Not(hn::Lt(hn::BitCast(di, hn::Xor(x, sign)), limit));
      const auto p = hn::LoadU(d, row + i);
      hn::StoreU(hn::IfThenElseZero(hn::RebindMask(d, kept), hn::Mul(p, factor)), d, row + i);
    }
  }
}

// Elementwise a ⊙= b over keys × width entries.
HWY_INLINE void MultiplyTile(float* HWY_RESTRICT a, const float* HWY_RESTRICT b, size_t count) {
  const FloatTag d;
  const size_t lanes = hn::Lanes(d);
  for (size_t e = 0; e < count; e += lanes)
    hn::StoreU(hn::Mul(hn::LoadU(d, a + e), hn::LoadU(d, b + e)), d, a + e);
}

// What OnlineSoftmaxStep keeps besides m and l: nothing, or the centred sum u for the
// softmax statistics (see there), either on a full tile (no removed keys, so no −inf
// score unless an input is non-finite or q·k overflows, which makes that row's
// statistics NaN) or on a masked tile, whose −inf entries must add 0 (one more op).
enum class SoftmaxStats { none, unmasked, masked };

// One group of C query vectors (columns i .. i + C·lanes) of OnlineSoftmaxStep. The C
// columns are independent, so their Exp chains overlap in the pipeline. The statistics
// code is compiled out for SoftmaxStats::none.
template <size_t C, SoftmaxStats kStats>
HWY_INLINE void OnlineSoftmaxColumns(float* HWY_RESTRICT st, size_t keys, size_t width,
                                     size_t i, float* HWY_RESTRICT m, float* HWY_RESTRICT l,
                                     float* HWY_RESTRICT alpha, float* HWY_RESTRICT u) {
  constexpr bool kKeep = kStats != SoftmaxStats::none;
  const FloatTag d;
  const size_t lanes = hn::Lanes(d);
  const auto minus_inf = hn::Set(d, kMinusInf);
  VecArray<FloatTag, C> shift, sum;  // FloatVec[C] (vec_array-inl.h: not on SVE)
  [[maybe_unused]] VecArray<FloatTag, C> centred;  // Σ_j P·(S − m') of this tile
  for (size_t c = 0; c < C; ++c) shift[c] = minus_inf;
  for (size_t j = 0; j < keys; ++j)
    for (size_t c = 0; c < C; ++c)
      shift[c] = hn::Max(shift[c], hn::LoadU(d, st + j * width + i + c * lanes));
  for (size_t c = 0; c < C; ++c) {
    const size_t col = i + c * lanes;
    const auto m_old = hn::LoadU(d, m + col);
    const auto m_new = hn::Max(m_old, shift[c]);
    const auto all_masked = hn::Eq(m_new, minus_inf);
    // Subtract 0 instead of -inf for fully masked queries: exp(-inf − 0) = 0, no NaN.
    shift[c] = hn::IfThenZeroElse(all_masked, m_new);
    const auto a =
        hn::IfThenElse(all_masked, hn::Set(d, 1.0f), ExpKeepNaN(d, hn::Sub(m_old, shift[c])));
    if constexpr (kKeep) {
      // Re-centre u on the new max: u' = α·(u + (m − m')·l). While m is −inf, l and u
      // are 0 and so is the correction (−inf·0 would be NaN).
      const auto moved = hn::IfThenZeroElse(hn::Eq(m_old, minus_inf), hn::Sub(m_old, shift[c]));
      hn::StoreU(hn::Mul(a, hn::MulAdd(moved, hn::LoadU(d, l + col), hn::LoadU(d, u + col))), d,
                 u + col);
      centred[c] = hn::Zero(d);
    }
    hn::StoreU(m_new, d, m + col);
    hn::StoreU(a, d, alpha + col);
    sum[c] = hn::Zero(d);
  }
  // Removed keys of a masked tile have S − m' = −inf and P = 0: clamping to the lowest
  // float keeps their P·(S − m') at 0 instead of 0·(−inf) = NaN.
  [[maybe_unused]] const auto lowest = hn::Set(d, std::numeric_limits<float>::lowest());
  for (size_t j = 0; j < keys; ++j)
    for (size_t c = 0; c < C; ++c) {
      float* row = st + j * width + i + c * lanes;
      const auto centred_score = hn::Sub(hn::LoadU(d, row), shift[c]);
      const auto p = ExpKeepNaN(d, centred_score);
      hn::StoreU(p, d, row);
      sum[c] = hn::Add(sum[c], p);
      if constexpr (kStats == SoftmaxStats::unmasked)
        centred[c] = hn::MulAdd(p, centred_score, centred[c]);
      if constexpr (kStats == SoftmaxStats::masked)
        centred[c] = hn::MulAdd(p, hn::Max(centred_score, lowest), centred[c]);
    }
  for (size_t c = 0; c < C; ++c) {
    const size_t col = i + c * lanes;
    hn::StoreU(hn::MulAdd(hn::LoadU(d, l + col), hn::LoadU(d, alpha + col), sum[c]), d, l + col);
    if constexpr (kKeep) hn::StoreU(hn::Add(hn::LoadU(d, u + col), centred[c]), d, u + col);
  }
}

// Forward online-softmax step on a transposed score tile st[key][query] (keys rows,
// `width` query columns, a multiple of the vector length): with the running max m and
// sum l of each query,
//   m' = max(m, max_key st),  alpha = exp(m − m'),  P = exp(st − m'),  l' = l·alpha + Σ P
// P overwrites st; alpha is written for rescaling the output accumulator. A query whose
// keys are all -inf so far keeps m' = -inf, P = 0, alpha = 1.
//
// With kStats ≠ none (attention health, qkv/attention_stats.hpp) it also keeps, per query,
//   u = Σ_j e^(S_j − m)·(S_j − m)   (centred on the running max: no cancellation, u ≤ 0)
// rescaled like l, so that at the end the row's largest weight is 1/l and its entropy
// H = lse − Σ_j P_j S_j = ln l − u/l. With none, u is never touched (may be null).
template <SoftmaxStats kStats = SoftmaxStats::none>
HWY_INLINE void OnlineSoftmaxStep(float* HWY_RESTRICT st, size_t keys, size_t width,
                                  float* HWY_RESTRICT m, float* HWY_RESTRICT l,
                                  float* HWY_RESTRICT alpha, float* HWY_RESTRICT u = nullptr) {
  const size_t lanes = hn::Lanes(FloatTag());
  constexpr size_t kColumns = 4;  // vectors of queries per pass over the keys
  size_t i = 0;
  for (; i + kColumns * lanes <= width; i += kColumns * lanes)
    OnlineSoftmaxColumns<kColumns, kStats>(st, keys, width, i, m, l, alpha, u);
  for (; i < width; i += lanes) OnlineSoftmaxColumns<1, kStats>(st, keys, width, i, m, l, alpha, u);
}

// Backward: P = exp(st − lse) in place, for lse already adjusted so that masked or
// padding queries have +inf (their P is 0).
HWY_INLINE void ProbabilitiesFromLse(float* HWY_RESTRICT st, size_t keys, size_t width,
                                     const float* HWY_RESTRICT lse) {
  const FloatTag d;
  const size_t lanes = hn::Lanes(d);
  for (size_t i = 0; i < width; i += lanes) {
    const auto shift = hn::LoadU(d, lse + i);
    for (size_t j = 0; j < keys; ++j) {
      float* row = st + j * width + i;
      hn::StoreU(ExpKeepNaN(d, hn::Sub(hn::LoadU(d, row), shift)), d, row);
    }
  }
}

// dSᵀ = Pᵀ ⊙ (dPᵀ − D) in place of dpt, with dS = 0 wherever P = 0 so that a non-finite
// value behind a removed key cannot leak through 0·NaN.
HWY_INLINE void ScoreGradient(const float* HWY_RESTRICT pt, float* HWY_RESTRICT dpt,
                              size_t keys, size_t width, const float* HWY_RESTRICT delta) {
  const FloatTag d;
  const size_t lanes = hn::Lanes(d);
  for (size_t i = 0; i < width; i += lanes) {
    const auto di = hn::LoadU(d, delta + i);
    for (size_t j = 0; j < keys; ++j) {
      const auto p = hn::LoadU(d, pt + j * width + i);
      float* row = dpt + j * width + i;
      const auto ds = hn::Mul(p, hn::Sub(hn::LoadU(d, row), di));
      hn::StoreU(hn::IfThenZeroElse(hn::Eq(p, hn::Zero(d)), ds), d, row);
    }
  }
}

// acc[i] += Σ_j wt[j][i]·rows[j] over i < count, j < keys, skipping wt = 0 terms. The
// slow, exact path for a masked block whose other operand holds NaN/Inf: a removed
// key's value must not reach a query through 0·Inf.
inline void AccumulateSkippingZeros(const float* wt, size_t width, size_t count, size_t keys,
                                    const float* rows, int64_t row_stride, size_t cols,
                                    float* acc, size_t ld) {
  for (size_t i = 0; i < count; ++i)
    for (size_t j = 0; j < keys; ++j) {
      const float w = wt[j * width + i];
      if (w == 0.0f) continue;
      const float* row = rows + static_cast<int64_t>(j) * row_stride;
      for (size_t c = 0; c < cols; ++c) acc[i * ld + c] += w * row[c];
    }
}

// rows of acc (ld floats each, `width` used) multiplied by factor[row].
HWY_INLINE void ScaleRows(float* HWY_RESTRICT acc, size_t rows, size_t width, size_t ld,
                          const float* HWY_RESTRICT factor) {
  const FloatTag d;
  const size_t lanes = hn::Lanes(d);
  for (size_t r = 0; r < rows; ++r) {
    if (factor[r] == 1.0f) continue;
    const auto f = hn::Set(d, factor[r]);
    for (size_t c = 0; c < width; c += lanes) {
      hn::StoreU(hn::Mul(hn::LoadU(d, acc + r * ld + c), f), d, acc + r * ld + c);
    }
  }
}

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
