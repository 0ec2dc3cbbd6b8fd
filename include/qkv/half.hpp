// 16-bit floating-point storage types: qkv::bfloat16 and qkv::float16.
//
// They are containers, not arithmetic types: kernels widen them to float (exactly: every
// bfloat16 and every float16 value is a float), compute in float and round once when
// they store. Narrowing rounds to nearest, ties to even, as IEEE 754 and every peer
// (PyTorch, NumPy, the F16C/AVX512-BF16 instructions) do:
//
//   bfloat16  1 sign, 8 exponent, 7 mantissa bits: float's range, 8 bits of precision.
//             Narrowing keeps the top 16 bits of the float, rounded; overflow → ±inf.
//   float16   1 sign, 5 exponent, 10 mantissa bits (IEEE binary16): largest 65504,
//             smallest normal 2⁻¹⁴, subnormals down to 2⁻²⁴. |x| ≥ 65520 → ±inf;
//             |x| ≤ 2⁻²⁵ → ±0 (2⁻²⁵ itself is the tie between 0 and 2⁻²⁴: even is 0).
//
// NaN narrows to a quiet NaN with the same sign (the payload's top bits kept, the quiet
// bit set so it can never become an infinity); ±inf, ±0 and subnormals are exact.
// Widening is exact for every bit pattern.
//
// Layout: exactly one uint16_t, so arrays of them are the same bytes as PyTorch's
// torch.bfloat16 / torch.float16 tensors and Highway's hwy::bfloat16_t / float16_t.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "qkv/float8.hpp"

namespace qkv {

namespace half_detail {

constexpr std::uint16_t float_to_bfloat16_bits(float value) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {  // NaN: keep sign and top payload, set quiet
    return static_cast<std::uint16_t>((bits >> 16) | 0x0040u);
  }
  // Round to nearest even on the 16 bits dropped; a carry may ripple into the exponent
  // (correctly: the largest finite floats round to inf, as the standard says).
  const std::uint32_t round = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>((bits + round) >> 16);
}

constexpr float bfloat16_bits_to_float(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

// n >> shift rounded to nearest, ties to even (shift ≥ 1).
constexpr std::uint32_t shift_right_round_even(std::uint32_t n, unsigned shift) {
  const std::uint32_t kept = n >> shift;
  const std::uint32_t rest = n & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1u);
  return kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
}

constexpr std::uint16_t float_to_float16_bits(float value) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  const auto sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) {  // NaN: quiet, top 9 payload bits kept
    return static_cast<std::uint16_t>(sign | 0x7E00u | ((magnitude >> 13) & 0x01FFu));
  }
  if (magnitude >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // ≥ 65520
  if (magnitude >= 0x38800000u) {  // normal in float16 (≥ 2⁻¹⁴)
    // Rebias the exponent (127 → 15) and round the 13 dropped mantissa bits; a carry
    // out of the mantissa steps the exponent up, which is the right answer.
    const std::uint32_t rebased = magnitude - ((127u - 15u) << 23);
    return static_cast<std::uint16_t>(sign | shift_right_round_even(rebased, 13));
  }
  if (magnitude <= 0x33000000u) return sign;  // ≤ 2⁻²⁵: rounds to ±0
  // Subnormal: value / 2⁻²⁴ rounded. value = m·2^(e−150) with the implicit bit in m,
  // so value / 2⁻²⁴ = m >> (126 − e); 102 ≤ e ≤ 112 gives shifts 14..24.
  const std::uint32_t exponent = magnitude >> 23;
  const std::uint32_t mantissa = (magnitude & 0x007FFFFFu) | 0x00800000u;
  return static_cast<std::uint16_t>(sign | shift_right_round_even(mantissa, 126u - exponent));
}

constexpr float float16_bits_to_float(std::uint16_t bits) {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exponent = (bits >> 10) & 0x1Fu;
  std::uint32_t mantissa = bits & 0x03FFu;
  if (exponent == 0x1Fu) {  // inf or NaN: payload moved to the top of float's mantissa
    return std::bit_cast<float>(sign | 0x7F800000u | (mantissa << 13));
  }
  if (exponent != 0) {
    return std::bit_cast<float>(sign | ((exponent + 127u - 15u) << 23) | (mantissa << 13));
  }
  if (mantissa == 0) return std::bit_cast<float>(sign);
  // Subnormal m·2⁻²⁴: normalize so the leading 1 becomes float's implicit bit.
  std::uint32_t float_exponent = 127u - 14u;
  while ((mantissa & 0x0400u) == 0) {
    mantissa <<= 1;
    --float_exponent;
  }
  return std::bit_cast<float>(sign | (float_exponent << 23) | ((mantissa & 0x03FFu) << 13));
}

// The float16 next to a finite one toward +inf (down: toward -inf); ±0 steps to the
// smallest subnormal of that direction, the largest finite one to infinity.
constexpr std::uint16_t next_float16_up(std::uint16_t bits) {
  if (bits == 0x8000u) return 0x0001u;
  return static_cast<std::uint16_t>((bits & 0x8000u) ? bits - 1u : bits + 1u);
}
constexpr std::uint16_t next_float16_down(std::uint16_t bits) {
  if (bits == 0x0000u) return 0x8001u;
  return static_cast<std::uint16_t>((bits & 0x8000u) ? bits + 1u : bits - 1u);
}

}  // namespace half_detail

// Brain floating point: float's exponent range, 8 significant bits.
struct bfloat16 {
  std::uint16_t bits = 0;

  constexpr bfloat16() = default;
  // Narrowing rounds (to nearest even): explicit, so it never happens by accident.
  constexpr explicit bfloat16(float value) : bits(half_detail::float_to_bfloat16_bits(value)) {}
  static constexpr bfloat16 from_bits(std::uint16_t bits) {
    bfloat16 h;
    h.bits = bits;
    return h;
  }
  // Widening is exact, so it is implicit.
  constexpr operator float() const { return half_detail::bfloat16_bits_to_float(bits); }  // NOLINT
};

// IEEE 754 binary16.
struct float16 {
  std::uint16_t bits = 0;

  constexpr float16() = default;
  constexpr explicit float16(float value) : bits(half_detail::float_to_float16_bits(value)) {}
  static constexpr float16 from_bits(std::uint16_t bits) {
    float16 h;
    h.bits = bits;
    return h;
  }
  constexpr operator float() const { return half_detail::float16_bits_to_float(bits); }  // NOLINT
};

static_assert(sizeof(bfloat16) == 2 && alignof(bfloat16) == 2);
static_assert(sizeof(float16) == 2 && alignof(float16) == 2);

// Two 4-bit integers 0..15 in one byte (int4 KV caches). A row of d values takes ⌈d / 2⌉
// bytes, in chunks of 32 channels (the last chunk has the m ≤ 32 left): in a chunk, byte
// i holds channel i in its low nibble and channel i + ⌈m / 2⌉ in its high one. So 16
// consecutive channels of a full chunk are the low (or the high) nibbles of 16
// consecutive bytes: one load, widened, and a mask or a shift, on any vector of up to 16
// lanes (int4_position says where channel c of a row of `count` is).
struct uint4x2 {
  std::uint8_t bits = 0;
};
static_assert(sizeof(uint4x2) == 1);

inline constexpr std::size_t kInt4Chunk = 32;
struct Int4Position {
  std::size_t byte = 0;
  bool high = false;  // the high nibble
};
constexpr Int4Position int4_position(std::size_t c, std::size_t count) {
  const std::size_t first = c / kInt4Chunk * kInt4Chunk;
  const std::size_t m = count - first < kInt4Chunk ? count - first : kInt4Chunk, half = (m + 1) / 2;
  const std::size_t w = c - first;
  return w < half ? Int4Position{first / 2 + w, false} : Int4Position{first / 2 + w - half, true};
}

// The element type of a storage buffer (a KV cache, later every kernel's inputs).
// int8 is for KV caches only: each cached row (one token's d values of one kv head)
// holds int8 values and one float scale, value = int8 · scale (qkv/kv_cache.hpp).
// int4 is for qkv::KVCache only: levels 0..15 with a scale and zero point per channel
// and group of tokens (keys) or per token and group of 32 channels (values).
// float8_e4m3fn / float8_e5m2 (qkv/float8.hpp) are for KV caches too: each element times
// a float scale, per tensor or per kv head (given as a per-row scale view whose strides
// repeat it), value = float8 · scale.
enum class StorageType { float32, bfloat16, float16, int8, int4, float8_e4m3fn, float8_e5m2 };

template <class T>
inline constexpr StorageType storage_type_of = StorageType::float32;
template <>
inline constexpr StorageType storage_type_of<bfloat16> = StorageType::bfloat16;
template <>
inline constexpr StorageType storage_type_of<float16> = StorageType::float16;
template <>
inline constexpr StorageType storage_type_of<std::int8_t> = StorageType::int8;
template <>
inline constexpr StorageType storage_type_of<uint4x2> = StorageType::int4;
template <>
inline constexpr StorageType storage_type_of<float8_e4m3fn> = StorageType::float8_e4m3fn;
template <>
inline constexpr StorageType storage_type_of<float8_e5m2> = StorageType::float8_e5m2;

constexpr bool is_float8(StorageType type) {
  return type == StorageType::float8_e4m3fn || type == StorageType::float8_e5m2;
}

constexpr int storage_bits(StorageType type) {
  return type == StorageType::float32                       ? 32
         : type == StorageType::int8 || is_float8(type) ? 8
         : type == StorageType::int4                    ? 4
                                                        : 16;
}
// Bytes of one element; int4 (half a byte): 1, the byte of a pair — count int4 rows'
// bytes with storage_row_bytes.
constexpr int storage_bytes(StorageType type) { return type == StorageType::int4 ? 1 : storage_bits(type) / 8; }
// Bytes of a row of `count` elements (int4: ⌈count / 2⌉).
constexpr int64_t storage_row_bytes(StorageType type, int64_t count) {
  return type == StorageType::int4 ? (count + 1) / 2 : count * storage_bytes(type);
}

constexpr const char* storage_name(StorageType type) {
  switch (type) {
    case StorageType::float32: return "float32";
    case StorageType::bfloat16: return "bfloat16";
    case StorageType::float16: return "float16";
    case StorageType::int8: return "int8";
    case StorageType::int4: return "int4";
    case StorageType::float8_e4m3fn: return "float8_e4m3fn";
    case StorageType::float8_e5m2: return "float8_e5m2";
  }
  return "unknown";
}

}  // namespace qkv
