// GELU (Hendrycks & Gimpel, 2016), the exact form PyTorch uses by default:
//   gelu(x) = x·Φ(x) = x/2 · (1 + erf(x/√2))
//   gelu'(x) = Φ(x) + x·φ(x),   φ(x) = exp(−x²/2)/√(2π)
// double: through libm's erf/exp. float: through branch-free approximations the compiler
// vectorizes (erf to < 3e-7 absolute, exp to < 4e-7 relative), ~10× faster than erff.
#pragma once

#include <span>

namespace qkv::nn {

// y = gelu(x); spans of equal length (else qkv::Error). y may alias x. A non-empty
// `derivative` also receives gelu'(x), so a backward needs no second erf.
void gelu_forward(std::span<const float> x, std::span<float> y,
                  std::span<float> derivative = {});
void gelu_forward(std::span<const double> x, std::span<double> y,
                  std::span<double> derivative = {});

// dx = gelu'(x) ⊙ dy; dx may alias dy.
void gelu_backward(std::span<const float> x, std::span<const float> dy, std::span<float> dx);
void gelu_backward(std::span<const double> x, std::span<const double> dy,
                   std::span<double> dx);

}  // namespace qkv::nn
