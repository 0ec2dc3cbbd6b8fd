// The softmax and its derivative, as the textbook writes them.
//
//   s = softmax(x),  s_i = exp(x_i - m) / Σ_j exp(x_j - m),  m = max_j x_j
//   log_softmax(x)_i = x_i - m - log Σ_j exp(x_j - m)
//   J(s) = ∂s/∂x = diag(s) - s·sᵀ            symmetric, rows sum to 0
//   Jᵀ·g = J·g = s ⊙ (g - ⟨s, g⟩)            O(n) instead of O(n²)
//
// Subtracting the max keeps every exponent ≤ 0, so nothing overflows:
// softmax((1, 2, 3, 1e6)) is exactly (0, 0, 0, 1). Sums are accumulated in double.
// Entries equal to -inf are excluded; if every entry is -inf the result is all zeros
// (log_softmax: all -inf), the same convention as a fully masked attention row.
// Spans must have matching lengths (J: n·n, row-major), else qkv::Error.
#pragma once

#include <span>

namespace qkv {

void softmax(std::span<const float> x, std::span<float> s);
void softmax(std::span<const double> x, std::span<double> s);

void log_softmax(std::span<const float> x, std::span<float> out);
void log_softmax(std::span<const double> x, std::span<double> out);

// J = diag(s) - s·sᵀ as an n×n row-major matrix.
void softmax_jacobian(std::span<const float> s, std::span<float> jacobian);
void softmax_jacobian(std::span<const double> s, std::span<double> jacobian);

// ∂L/∂x = Jᵀ·g = s ⊙ (g - ⟨s, g⟩) for s = softmax(x) and g = ∂L/∂s.
void softmax_backward(std::span<const float> s, std::span<const float> g, std::span<float> dx);
void softmax_backward(std::span<const double> s, std::span<const double> g,
                      std::span<double> dx);

}  // namespace qkv
