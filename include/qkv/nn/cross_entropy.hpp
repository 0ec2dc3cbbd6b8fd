// Softmax cross-entropy over the last dimension, averaged over rows.
//
//   loss = (1/R) Σ_r [ lse(z_r) − z_r[t_r] ],    lse(z) = log Σ_j exp(z_j)
//   ∂loss/∂z_r = (softmax(z_r) − onehot(t_r)) / R
//
// R counts the rows whose target is not kIgnoreIndex; ignored rows get zero gradient.
// Each row's max is subtracted before exp (no overflow); sums in double.
#pragma once

#include <cstdint>
#include <span>

#include "qkv/nn/parameter.hpp"

namespace qkv::nn {

inline constexpr int32_t kIgnoreIndex = -1;

// logits [R, V], targets[R] in [0, V) or kIgnoreIndex. Returns the mean loss (nats);
// writes the gradient into `dlogits` [R, V] unless it is empty (which may alias logits).
// All rows ignored: loss 0, zero gradient.
double softmax_cross_entropy(Matrix<const float> logits, std::span<const int32_t> targets,
                             Matrix<float> dlogits = {});
double softmax_cross_entropy(Matrix<const double> logits, std::span<const int32_t> targets,
                             Matrix<double> dlogits = {});

}  // namespace qkv::nn
