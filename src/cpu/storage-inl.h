// Storage types of the fused kernels: float, bfloat16 and float16 (qkv/half.hpp). The
// kernels are written once, over the storage type T; everything a tile computes is
// float. These are the only places T is read or written:
//
//   Widen / LoadWidened / WidenRows
//                         T → float, exact (every bfloat16, float16 and int8 is a float),
//                         one value, one vector (read in place by the split-K schedule),
//                         or rows packed into float scratch. The vectors use Highway's
//                         PromoteTo: a shift for bfloat16; for float16 the F16C / AVX-512
//                         / aarch64 instruction, on the targets that have it (see
//                         kHardwareFloat16).
//                         int8 (caches) is widened before its row's scale is applied;
//                         int4 (uint4x2, two levels a byte) unpacked to its levels
//                         0..15, before its scales and zero points; float8 (caches,
//                         e4m3fn and e5m2) to its value, exactly, before its scale.
//   LoadValues / WidenAt  values c.. of a row (a vector; int4 within a full chunk of 32
//                         channels) / value c of a row of `count`.
//   RowAt                 a row from its channel c on (int4: c a multiple of 32).
//   StoreAs               float → T, round to nearest even, once per output element.
//   AllFinite             the non-finite scan of a K/V block (finite_scan.hpp): the
//                         16-bit types' overload reads the bits (float's is in
//                         block_ops-inl.h).
//
// For T = float each of these is the identity or what the kernels did before, so the
// fp32 path makes no extra copy.
//
// Per-target include guard (Highway's toggle idiom).
#if defined(QKV_CPU_STORAGE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_STORAGE_INL_H_
#undef QKV_CPU_STORAGE_INL_H_
#else
#define QKV_CPU_STORAGE_INL_H_
#endif

#include <bit>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "hwy/highway.h"
#include "qkv/half.hpp"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

template <class T>
inline constexpr bool kIsHalf = std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>;

// Whether Highway widens float16 with the hardware instruction on this target. Its
// software fallback (Highway 1.0.3: EMU128, SSE4, 32-bit Arm without half-precision
// FP, and other architectures) turns ±inf and NaN into finite numbers near 65536, which
// would hide a bad input; there qkv widens float16 one value at a time with
// qkv/half.hpp (exact; only fallback targets pay). aarch64 always converts in hardware:
// FCVTL on NEON, FCVT on SVE.
#if (HWY_TARGET == HWY_AVX2 && !defined(HWY_DISABLE_F16C)) || HWY_TARGET == HWY_AVX3 || \
    HWY_TARGET == HWY_AVX3_DL ||                                                     \
    (HWY_ARCH_ARM_A64 && (HWY_TARGET == HWY_NEON || HWY_TARGET == HWY_SVE ||           \
                          HWY_TARGET == HWY_SVE2 || HWY_TARGET == HWY_SVE_256 ||       \
                          HWY_TARGET == HWY_SVE2_128))
inline constexpr bool kHardwareFloat16 = true;
#else
inline constexpr bool kHardwareFloat16 = false;
#endif

template <class T>
inline constexpr bool kIsFloat8 = std::is_same_v<T, float8_e4m3fn> || std::is_same_v<T, float8_e5m2>;

template <class T>
inline constexpr bool kVectorWiden =
    std::is_same_v<T, bfloat16> || (std::is_same_v<T, float16> && kHardwareFloat16);

// Highway's lane type with the same bits as qkv's storage type.
template <class T>
struct HwyLane;
template <>
struct HwyLane<bfloat16> {
  using type = hwy::bfloat16_t;
};
template <>
struct HwyLane<float16> {
  using type = hwy::float16_t;
};

HWY_INLINE float Widen(float x) { return x; }
HWY_INLINE float Widen(bfloat16 x) { return static_cast<float>(x); }
HWY_INLINE float Widen(float16 x) { return static_cast<float>(x); }
HWY_INLINE float Widen(std::int8_t x) { return static_cast<float>(x); }  // int8 caches, before the scale
HWY_INLINE float Widen(float8_e4m3fn x) { return static_cast<float>(x); }  // float8 caches, before the scale
HWY_INLINE float Widen(float8_e5m2 x) { return static_cast<float>(x); }

// Value c of a row of `count` values (int4: its level, as qkv/half.hpp lays them out).
template <class T>
HWY_INLINE float WidenAt(const T* HWY_RESTRICT row, size_t c, size_t count) {
  if constexpr (std::is_same_v<T, uint4x2>) {
    const Int4Position at = int4_position(c, count);
    const std::uint8_t byte = row[at.byte].bits;
    return static_cast<float>(at.high ? byte >> 4 : byte & 0x0F);
  } else {
    (void)count;
    return Widen(row[c]);
  }
}

// The row from its value c on (int4: c a multiple of kInt4Chunk, where a chunk starts).
template <class T>
HWY_INLINE const T* RowAt(const T* row, size_t c) {
  if constexpr (std::is_same_v<T, uint4x2>) {
    return row + c / 2;
  } else {
    return row + c;
  }
}

// Bytes of a row of `count` values.
template <class T>
constexpr size_t RowBytes(size_t count) {
  return std::is_same_v<T, uint4x2> ? (count + 1) / 2 : count * sizeof(T);
}

// Whether LoadWidened reads T with vector instructions (else one value at a time).
template <class T>
inline constexpr bool kVectorLoad =
    std::is_same_v<T, float> || std::is_same_v<T, std::int8_t> || kVectorWiden<T> || kIsFloat8<T>;

// Lanes(df) float8 values as floats, exactly. WidenFloat8Integer: with integer lane
// operations, on every target (Highway's software float16 widening would lose ±inf and
// NaN): the magnitude's
// exponent and mantissa bits are moved into a float's and rebiased. A subnormal
// (exponent field 0) is built as 2^emin · (1 + m / 2^M) and 2^emin subtracted — exact,
// and never a float subnormal, which a denormals-are-zero mode would flush. NaN (and
// e5m2's ±inf) are selected by code; the sign bit is put back last.
//
// Where float16 widens in hardware (kHardwareFloat16: F16C, AVX-512, aarch64) float8 goes
// through it, about half the instructions (decode over an fp8 cache is bound by them):
// e5m2 is float16's high byte, so code << 8 is the same number as a float16; e4m3fn's
// exponent and mantissa shifted into float16's (code & 0x7F) << 7 are the value · 2⁻⁸
// (bias 15 instead of 7, subnormals alike: 2⁻¹⁴·m/8 against 2⁻⁶·m/8), so the float is
// multiplied by 2⁸ (exact). Its NaN code S.1111.111 (which would become ±1.875 · 2⁸) is
// given float16's NaN bits first. The conversion widens float16 subnormals to normal
// floats, whatever the denormal mode.
template <class T, class D>
HWY_INLINE hn::Vec<D> WidenFloat8ThroughFloat16(D df, const T* HWY_RESTRICT p) {
  const hn::Rebind<uint8_t, D> d8;
  const hn::Rebind<int16_t, D> d16;
  const hn::Rebind<hwy::float16_t, D> dh;
  const auto code = hn::PromoteTo(d16, hn::LoadU(d8, reinterpret_cast<const uint8_t*>(p)));
  if constexpr (std::is_same_v<T, float8_e5m2>) {
    return hn::PromoteTo(df, hn::BitCast(dh, hn::ShiftLeft<8>(code)));
  } else {
    // code << 8 then an arithmetic shift right by 1: the sign lands in bits 15 and 14, the
    // exponent and mantissa in 13..7; bit 14 cleared. Work on 16-bit lanes (half the
    // vector width of the float ones). NaN: float16's NaN bits, which stay NaN times 2⁸.
    auto bits = hn::And(hn::ShiftRight<1>(hn::ShiftLeft<8>(code)), hn::Set(d16, static_cast<int16_t>(0xBFFF)));
    bits = hn::IfThenElse(hn::Eq(hn::And(code, hn::Set(d16, 0x7F)), hn::Set(d16, 0x7F)), hn::Set(d16, 0x7E00), bits);
    return hn::Mul(hn::PromoteTo(df, hn::BitCast(dh, bits)), hn::Set(df, 256.0f));
  }
}

template <class T, class D>
HWY_INLINE hn::Vec<D> WidenFloat8Integer(D df, const T* HWY_RESTRICT p) {
  constexpr bool kE5M2 = std::is_same_v<T, float8_e5m2>;
  constexpr int kMantissa = kE5M2 ? 2 : 3, kBias = kE5M2 ? 15 : 7;
  const hn::RebindToSigned<D> di;
  const hn::Rebind<uint8_t, D> d8;
  const auto code = hn::PromoteTo(di, hn::LoadU(d8, reinterpret_cast<const uint8_t*>(p)));
  const auto magnitude = hn::And(code, hn::Set(di, 0x7F));
  const auto sign = hn::ShiftLeft<24>(hn::And(code, hn::Set(di, 0x80)));
  const auto subnormal = hn::Lt(magnitude, hn::Set(di, 1 << kMantissa));
  const auto rebias = hn::IfThenElse(subnormal, hn::Set(di, (128 - kBias) << 23), hn::Set(di, (127 - kBias) << 23));
  auto value = hn::BitCast(df, hn::Add(hn::ShiftLeft<23 - kMantissa>(magnitude), rebias));
  const float min_normal = std::bit_cast<float>(static_cast<uint32_t>(128 - kBias) << 23);
  value = hn::IfThenElse(hn::RebindMask(df, subnormal), hn::Sub(value, hn::Set(df, min_normal)), value);
  auto bits = hn::BitCast(di, value);
  if constexpr (kE5M2) {
    bits = hn::IfThenElse(hn::Eq(magnitude, hn::Set(di, 0x7C)), hn::Set(di, 0x7F800000), bits);
    bits = hn::IfThenElse(hn::Gt(magnitude, hn::Set(di, 0x7C)), hn::Set(di, 0x7FC00000), bits);
  } else {
    bits = hn::IfThenElse(hn::Eq(magnitude, hn::Set(di, 0x7F)), hn::Set(di, 0x7FC00000), bits);
  }
  return hn::BitCast(df, hn::Or(bits, sign));
}

template <class T, class D>
HWY_INLINE hn::Vec<D> WidenFloat8(D df, const T* HWY_RESTRICT p) {
  if constexpr (kHardwareFloat16) {
    return WidenFloat8ThroughFloat16(df, p);
  } else {
    return WidenFloat8Integer(df, p);
  }
}

// Whether int4 rows are read with vectors here: 2 to 16 lanes (a vector's channels are
// the low or high nibbles of Lanes consecutive bytes of a chunk; never on HWY_SCALAR).
template <class D>
HWY_INLINE bool Int4Vectors(D d) {
  return HWY_TARGET != HWY_SCALAR && hn::Lanes(d) >= 2 && hn::Lanes(d) <= kInt4Chunk / 2;
}

// One vector of floats from Lanes(df) consecutive values of T, read in place.
template <class T, class D>
HWY_INLINE hn::Vec<D> LoadWidened(D df, const T* HWY_RESTRICT p) {
  if constexpr (std::is_same_v<T, float>) {
    return hn::LoadU(df, p);
  } else if constexpr (std::is_same_v<T, std::int8_t>) {
    const hn::Rebind<std::int8_t, D> d8;
    const hn::RebindToSigned<D> di;
    return hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(d8, p)));
  } else if constexpr (kIsFloat8<T>) {
    return WidenFloat8(df, p);
  } else if constexpr (kVectorWiden<T>) {  // bfloat16: a shift; float16: F16C/AVX-512
    const hn::Rebind<typename HwyLane<T>::type, D> dh;
    return hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const typename HwyLane<T>::type*>(p)));
  } else {
    // float16 where Highway 1.0.3 has no hardware conversion: one value at a time through
    // qkv/half.hpp (exact; its software PromoteTo turns ±inf and NaN into finite numbers).
    HWY_ALIGN float wide[hn::MaxLanes(D())];
    for (size_t i = 0; i < hn::Lanes(df); ++i) wide[i] = static_cast<float>(p[i]);
    return hn::Load(df, wide);
  }
}

// Values [c, c + Lanes(df)) of a row as floats, read in place. int4: c a multiple of
// Lanes(df) inside a full chunk of 32 channels, on a target where Int4Vectors — Lanes
// bytes widened to 32-bit lanes (one instruction), then the low nibbles masked or the
// high ones shifted down, and converted (exact).
template <class T, class D>
HWY_INLINE hn::Vec<D> LoadValues(D df, const T* HWY_RESTRICT row, size_t c) {
  if constexpr (std::is_same_v<T, uint4x2>) {
#if HWY_TARGET == HWY_SCALAR
    HWY_ALIGN float wide[hn::MaxLanes(D())];
    for (size_t i = 0; i < hn::Lanes(df); ++i) wide[i] = WidenAt(row, c + i, (c / kInt4Chunk + 1) * kInt4Chunk);
    return hn::Load(df, wide);
#else
    const size_t w = c % kInt4Chunk, half = kInt4Chunk / 2;
    const hn::Rebind<uint8_t, D> d8;
    const hn::RebindToUnsigned<D> du;
    const auto* bytes = reinterpret_cast<const uint8_t*>(row) + c / kInt4Chunk * half + w % half;
    auto levels = hn::PromoteTo(du, hn::LoadU(d8, bytes));
    levels = w < half ? hn::And(levels, hn::Set(du, 0x0F)) : hn::ShiftRight<4>(levels);
    return hn::ConvertTo(df, hn::BitCast(hn::RebindToSigned<D>(), levels));
#endif
  } else {
    return LoadWidened(df, row + c);
  }
}

// The int4 levels of channels [c, c + Lanes) and [c + 16, c + 16 + Lanes) of a row, c in
// the first half of its chunk of 32 (where Int4Vectors): the low and the high nibbles of
// the same Lanes bytes, widened once for both (LoadValues widens them once per vector).
template <class D>
HWY_INLINE void LoadLevelPair(D df, const uint4x2* HWY_RESTRICT row, size_t c, hn::Vec<D>& low, hn::Vec<D>& high) {
#if HWY_TARGET == HWY_SCALAR
  low = LoadValues(df, row, c);
  high = LoadValues(df, row, c + kInt4Chunk / 2);
#else
  const hn::Rebind<uint8_t, D> d8;
  const hn::RebindToUnsigned<D> du;
  const hn::RebindToSigned<D> di;
  const auto* bytes = reinterpret_cast<const uint8_t*>(row) + c / kInt4Chunk * (kInt4Chunk / 2) + c % kInt4Chunk;
  const auto levels = hn::PromoteTo(du, hn::LoadU(d8, bytes));
  low = hn::ConvertTo(df, hn::BitCast(di, hn::And(levels, hn::Set(du, 0x0F))));
  high = hn::ConvertTo(df, hn::BitCast(di, hn::ShiftRight<4>(levels)));
#endif
}

// One rounding to T (to nearest, ties to even; qkv/half.hpp, tested on every tie).
template <class T>
HWY_INLINE T StoreAs(float x) {
  if constexpr (kIsHalf<T>) {
    return T(x);
  } else {
    return x;
  }
}

// dst[i·ld + c] = float(src(i, c)) for i < rows, c < cols, zero-padded to ld columns.
// `src` rows are `src_row` elements apart and contiguous along c.
template <class T>
HWY_INLINE void WidenRows(const T* HWY_RESTRICT src, int64_t src_row, size_t rows, size_t cols,
                          float* HWY_RESTRICT dst, size_t ld) {
  const hn::ScalableTag<float> df;
  const size_t lanes = hn::Lanes(df);
  for (size_t i = 0; i < rows; ++i) {
    const T* in = src + static_cast<int64_t>(i) * src_row;
    float* out = dst + i * ld;
    size_t c = 0;
    if constexpr (kVectorLoad<T>) {
      for (; c + lanes <= cols; c += lanes) hn::StoreU(LoadWidened(df, in + c), df, out + c);
    } else if constexpr (std::is_same_v<T, uint4x2>) {
      if (Int4Vectors(df))  // the full chunks
        for (; c + lanes <= cols / kInt4Chunk * kInt4Chunk; c += lanes) hn::StoreU(LoadValues(df, in, c), df, out + c);
    }
    for (; c < cols; ++c) out[c] = WidenAt(in, c, cols);
    for (; c < ld; ++c) out[c] = 0.0f;
  }
}

// Elements widened per chunk into a stack buffer where a row is consumed as float.
inline constexpr size_t kWidenChunk = 256;

// Σ_c a_r[c]·b_r[c] in double over float-widened values (c < n) for `rows` rows
// (a_r = a + r·a_row, b_r likewise) into sums[r]. Each row's sum runs in order from
// c = 0, so it is the same, bit for bit, whatever the rows around it (a float·float
// product is exact in double, so contracting it into an FMA changes nothing either).
// Eight rows' sums are interleaved: one row's chain of dependent double additions
// costs an addition's latency per element (the backward's prepack spent ~4 cycles an
// element there), eight independent chains overlap it.
template <class T>
HWY_INLINE void DotsWidened(const T* HWY_RESTRICT a, int64_t a_row, const T* HWY_RESTRICT b,
                            int64_t b_row, size_t rows, size_t n, double* HWY_RESTRICT sums) {
  constexpr size_t kRows = 8, kChunk = 128;
  float wa[kRows][kChunk], wb[kRows][kChunk];
  for (size_t r0 = 0; r0 < rows; r0 += kRows) {
    const size_t m_rows = rows - r0 < kRows ? rows - r0 : kRows;
    double sum[kRows] = {};
    for (size_t c0 = 0; c0 < n; c0 += kChunk) {
      const size_t m = n - c0 < kChunk ? n - c0 : kChunk;
      for (size_t r = 0; r < m_rows; ++r) {
        const int64_t row = static_cast<int64_t>(r0 + r);
        WidenRows(a + row * a_row + c0, 0, 1, m, wa[r], m);
        WidenRows(b + row * b_row + c0, 0, 1, m, wb[r], m);
      }
      for (size_t r = m_rows; r < kRows; ++r)  // absent rows: zeros, never stored
        for (size_t c = 0; c < m; ++c) wa[r][c] = wb[r][c] = 0.0f;
      for (size_t c = 0; c < m; ++c)
        for (size_t r = 0; r < kRows; ++r) sum[r] += static_cast<double>(wa[r][c]) * wb[r][c];
    }
    for (size_t r = 0; r < m_rows; ++r) sums[r0 + r] = sum[r];
  }
}

// The 16-bit types: a value is NaN or ±inf exactly when its exponent bits are all ones.
template <class T, class = std::enable_if_t<kIsHalf<T>>>
HWY_INLINE bool AllFinite(const T* HWY_RESTRICT src, int64_t src_row, size_t rows, size_t cols) {
  constexpr uint16_t kExponent = std::is_same_v<T, bfloat16> ? 0x7F80 : 0x7C00;
  const hn::ScalableTag<uint16_t> d;
  const size_t lanes = hn::Lanes(d);
  const auto exponent = hn::Set(d, kExponent);
  auto bad = hn::Zero(d);  // lanes that saw an all-ones exponent hold kExponent
  bool scalar_bad = false;
  for (size_t i = 0; i < rows; ++i) {
    const auto* in = reinterpret_cast<const uint16_t*>(src + static_cast<int64_t>(i) * src_row);
    size_t c = 0;
    for (; c + lanes <= cols; c += lanes) {
      const auto bits = hn::And(hn::LoadU(d, in + c), exponent);
      bad = hn::Or(bad, hn::IfThenElseZero(hn::Eq(bits, exponent), exponent));
    }
    for (; c < cols; ++c) scalar_bad = scalar_bad || (in[c] & kExponent) == kExponent;
  }
  return !scalar_bad && hn::AllTrue(d, hn::Eq(bad, hn::Zero(d)));
}

// float8: e4m3fn's only non-finite code is its NaN, S.1111.111; e5m2's are those with
// an all-ones exponent, as float16's.
template <class T, class = std::enable_if_t<kIsFloat8<T>>, class = void>
HWY_INLINE bool AllFinite(const T* HWY_RESTRICT src, int64_t src_row, size_t rows, size_t cols) {
  constexpr uint8_t kMask = std::is_same_v<T, float8_e5m2> ? 0x7C : 0x7F;
  for (size_t i = 0; i < rows; ++i) {
    const auto* in = reinterpret_cast<const uint8_t*>(src + static_cast<int64_t>(i) * src_row);
    uint8_t seen = 0;  // any byte whose masked bits are all ones
    for (size_t c = 0; c < cols; ++c) seen |= static_cast<uint8_t>((in[c] & kMask) == kMask);
    if (seen != 0) return false;
  }
  return true;
}

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
