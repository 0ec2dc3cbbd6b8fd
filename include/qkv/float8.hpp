// 8-bit floating-point storage types for KV caches: qkv::float8_e4m3fn and
// qkv::float8_e5m2, the two formats of the OCP 8-bit float spec that PyTorch
// (torch.float8_e4m3fn / torch.float8_e5m2), ml_dtypes, vLLM and SGLang use.
//
//   float8_e4m3fn  1 sign, 4 exponent (bias 7), 3 mantissa bits; largest finite ±448,
//                  smallest normal 2⁻⁶, subnormals down to 2⁻⁹; no infinities; NaN is
//                  S.1111.111 (0x7F / 0xFF), the only NaN ("fn": finite + NaN).
//   float8_e5m2    1 sign, 5 exponent (bias 15), 2 mantissa bits: IEEE-style, the top
//                  byte of a float16; largest finite ±57344, smallest normal 2⁻¹⁴,
//                  subnormals down to 2⁻¹⁶; ±inf (0x7C) and NaNs (0x7D..0x7F).
//
// Widening to float is exact for every bit pattern. Narrowing (float8_*(float)) rounds
// to nearest, ties to even — the same bits as torch's `.to(float8_*)` for every value
// within the format's range — but SATURATES finite values beyond the largest finite one
// to ±448 / ±57344, as vLLM's and SGLang's cache writes do (torch 2.13's CPU cast
// saturates e4m3fn too, but also turns ±inf into ±448, and gives inf for e5m2 at ≥ 61440). A KV cache stores x / scale with a
// scale chosen from the data, so a later token beyond the range is clipped, not turned
// into a NaN that would poison every query that sees it. NaN stays NaN (the quiet
// pattern with the input's sign); ±inf becomes ±inf in e5m2 and NaN in e4m3fn, which
// has no infinity — a non-finite input is never made finite.
//
// Layout: exactly one byte, so arrays of them are the same bytes as PyTorch's float8
// tensors and ml_dtypes' arrays.
#pragma once

#include <bit>
#include <cstdint>

namespace qkv {

namespace float8_detail {

// The parameters of one format: exponent bias, mantissa bits, the largest finite
// magnitude's code, and whether the format has infinities (e5m2) or not (e4m3fn).
struct Format {
  int bias;
  int mantissa_bits;
  std::uint8_t max_finite;  // magnitude code of the largest finite value
  std::uint8_t nan;         // magnitude code of the NaN narrowing produces
  bool has_inf;             // e5m2: 0x7C is inf
};
inline constexpr Format kE4M3FN{7, 3, 0x7E, 0x7F, false};
inline constexpr Format kE5M2{15, 2, 0x7B, 0x7E, true};

// n >> shift, rounded to nearest, ties to even (shift ≥ 1; 0 when shift > 31).
constexpr std::uint32_t shift_round_even(std::uint32_t n, int shift) {
  if (shift > 31) return 0;
  const std::uint32_t kept = n >> shift;
  const std::uint32_t rest = n & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1);
  return kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
}

constexpr std::uint8_t from_float(float value, Format f) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  const auto sign = static_cast<std::uint8_t>((bits >> 24) & 0x80u);
  const std::uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return sign | f.nan;  // NaN
  if (magnitude == 0x7F800000u) return sign | (f.has_inf ? static_cast<std::uint8_t>(f.max_finite + 1) : f.nan);
  const int exponent = static_cast<int>(magnitude >> 23);  // float's biased exponent, 0..254
  std::uint32_t code = 0;
  if (exponent - 127 + f.bias >= 1) {
    // Normal in the format (or beyond it): rebias the float's bits and drop 23 −
    // mantissa_bits of them, rounded; a carry into the exponent is the next binade.
    const std::uint32_t rebased = magnitude - (static_cast<std::uint32_t>(127 - f.bias) << 23);
    code = shift_round_even(rebased, 23 - f.mantissa_bits);
  } else {
    // The format's subnormal range: the float is significand · 2^(e − 150) (float
    // subnormals: e = 1), counted in units of 2^(1 − bias − mantissa_bits) and rounded
    // (the largest round up to the smallest normal, whose code follows theirs).
    const int e = exponent != 0 ? exponent : 1;
    const std::uint32_t significand = (magnitude & 0x7FFFFFu) | (exponent != 0 ? 0x800000u : 0u);
    code = shift_round_even(significand, 150 + 1 - f.bias - f.mantissa_bits - e);
  }
  if (code > f.max_finite) code = f.max_finite;  // finite values saturate
  return sign | static_cast<std::uint8_t>(code);
}

constexpr float to_float(std::uint8_t code, Format f) {
  const std::uint32_t sign = static_cast<std::uint32_t>(code & 0x80u) << 24;
  const std::uint32_t magnitude = code & 0x7Fu;
  const int exponent = static_cast<int>(magnitude >> f.mantissa_bits);
  const std::uint32_t mantissa = magnitude & ((1u << f.mantissa_bits) - 1u);
  if (f.has_inf ? magnitude >= 0x7Cu : magnitude == 0x7Fu) {
    const bool inf = f.has_inf && magnitude == 0x7Cu;
    return std::bit_cast<float>(sign | (inf ? 0x7F800000u : 0x7FC00000u));
  }
  if (exponent == 0) {  // subnormal: mantissa · 2^(1 − bias − mantissa_bits), exact in float
    const float unit = std::bit_cast<float>(static_cast<std::uint32_t>(127 + 1 - f.bias - f.mantissa_bits) << 23);
    return std::bit_cast<float>(sign | std::bit_cast<std::uint32_t>(static_cast<float>(mantissa) * unit));
  }
  return std::bit_cast<float>(sign | (static_cast<std::uint32_t>(exponent - f.bias + 127) << 23) |
                              (mantissa << (23 - f.mantissa_bits)));
}

}  // namespace float8_detail

struct float8_e4m3fn {
  std::uint8_t bits = 0;

  constexpr float8_e4m3fn() = default;
  constexpr explicit float8_e4m3fn(float value) : bits(float8_detail::from_float(value, float8_detail::kE4M3FN)) {}
  static constexpr float8_e4m3fn from_bits(std::uint8_t bits) {
    float8_e4m3fn x;
    x.bits = bits;
    return x;
  }
  static constexpr float kMax = 448.0f;
  constexpr operator float() const { return float8_detail::to_float(bits, float8_detail::kE4M3FN); }  // NOLINT
};

struct float8_e5m2 {
  std::uint8_t bits = 0;

  constexpr float8_e5m2() = default;
  constexpr explicit float8_e5m2(float value) : bits(float8_detail::from_float(value, float8_detail::kE5M2)) {}
  static constexpr float8_e5m2 from_bits(std::uint8_t bits) {
    float8_e5m2 x;
    x.bits = bits;
    return x;
  }
  static constexpr float kMax = 57344.0f;
  constexpr operator float() const { return float8_detail::to_float(bits, float8_detail::kE5M2); }  // NOLINT
};

static_assert(sizeof(float8_e4m3fn) == 1 && sizeof(float8_e5m2) == 1);
static_assert(float(float8_e4m3fn(448.0f)) == 448.0f && float(float8_e4m3fn(1e9f)) == 448.0f);
static_assert(float(float8_e5m2(57344.0f)) == 57344.0f && float(float8_e5m2(-1e9f)) == -57344.0f);
static_assert(float(float8_e4m3fn::from_bits(0x01)) == 0x1p-9f && float(float8_e5m2::from_bits(0x01)) == 0x1p-16f);

}  // namespace qkv
