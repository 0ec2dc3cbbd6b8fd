// Branch-free float exp and erf that the compiler vectorizes (no libm calls in the loop),
// for GELU over whole activations. Accuracy (checked over a dense grid against the
// double-precision libm in tests/nn/test_gelu_mlp.cpp):
//   exp_approx: relative error < 4e-7 for x in [−87, 88]; 0 below, +inf-free above
//   erf_approx: absolute error < 3e-7 everywhere (Numerical Recipes' erfc Chebyshev fit,
//               fractional error < 1.2e-7, evaluated in float)
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace qkv::nn::detail {

inline float exp_approx(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;   // ln 2 split so n·kLn2Hi is exact
  constexpr float kLn2Lo = 1.42860682030941723212e-6f;
  constexpr float kRound = 12582912.0f;          // 1.5·2²³: adding it rounds to an integer
  x = std::min(std::max(x, -87.0f), 88.0f);
  // x = n·ln 2 + r with |r| ≤ ln2/2, then e^x = 2ⁿ·e^r.
  const float shifted = x * kLog2e + kRound;
  const float n = shifted - kRound;
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  // e^r by its Taylor series to r⁶/720 (truncation < 2.5e-8 relative for |r| ≤ 0.347).
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2ⁿ from the exponent bits: n ∈ [−126, 127] after the clamp.
  const auto exponent = static_cast<int32_t>(std::bit_cast<uint32_t>(shifted) - std::bit_cast<uint32_t>(kRound));
  const float scale = std::bit_cast<float>(static_cast<uint32_t>((exponent + 127) << 23));
  return p * scale;
}

// erf(x) = 1 − erfc(x) for x ≥ 0 and −erf(−x) below, with
// erfc(z) ≈ t·exp(−z² − 1.26551223 + t·(1.00002368 + …)),  t = 1/(1 + z/2).
inline float erf_approx(float x) {
  const float z = std::fabs(x);
  const float t = 1.0f / (1.0f + 0.5f * z);
  float poly = 0.17087277f;
  poly = poly * t - 0.82215223f;
  poly = poly * t + 1.48851587f;
  poly = poly * t - 1.13520398f;
  poly = poly * t + 0.27886807f;
  poly = poly * t - 0.18628806f;
  poly = poly * t + 0.09678418f;
  poly = poly * t + 0.37409196f;
  poly = poly * t + 1.00002368f;
  poly = poly * t - 1.26551223f;
  const float erfc = t * exp_approx(-z * z + poly);
  return std::copysign(1.0f - erfc, x);
}

}  // namespace qkv::nn::detail
