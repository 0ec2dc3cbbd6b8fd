// The transformer's position-wise feed-forward block: Linear → GELU → Linear.
//   h = x·W₁ᵀ + b₁,   a = gelu(h),   y = a·W₂ᵀ + b₂
// backward:  da = dy·W₂,  dh = gelu'(h) ⊙ da,  dx = dh·W₁  (+ the Linear weight grads)
// The forward keeps gelu'(h) (computed with gelu(h), sharing its erf).
#pragma once

#include <cstdint>
#include <string>

#include "qkv/nn/linear.hpp"

namespace qkv::nn {

template <class T>
struct MlpSaved {
  Tensor<T, 2> hidden;      // h, before GELU [rows, hidden]
  Tensor<T, 2> activation;  // a = gelu(h)
  Tensor<T, 2> slope;       // gelu'(h), from the forward
  Tensor<T, 2> d_hidden;    // backward scratch
};

template <class T>
class Mlp {
 public:
  using Saved = MlpSaved<T>;

  Mlp() = default;
  Mlp(int64_t dim, int64_t hidden_dim, bool bias = true);

  int64_t dim() const { return fc1.in_features(); }
  int64_t hidden_dim() const { return fc1.out_features(); }

  void reset_parameters(Rng& rng);  // each Linear's default

  // x, y [rows, dim].
  void forward(Matrix<const T> x, Matrix<T> y, Saved& saved) const;
  // Writes dx (adds when `accumulate_dx`); accumulates parameter gradients.
  void backward(Matrix<const T> x, Saved& saved, Matrix<const T> dy, Matrix<T> dx,
                bool accumulate_dx = false);

  void collect(ParameterList<T>& list, const std::string& prefix);

  Linear<T> fc1, fc2;
};

}  // namespace qkv::nn
