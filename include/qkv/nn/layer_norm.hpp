// LayerNorm over the last dimension (Ba, Kiros & Hinton, 2016), as PyTorch's.
//
//   μ = mean(x),  σ² = mean((x − μ)²) (biased),  r = 1/√(σ² + ε),  x̂ = (x − μ)·r
//   y = γ ⊙ x̂ + β
// backward, with g = γ ⊙ dy:
//   dx = r·(g − mean(g) − x̂·mean(g ⊙ x̂)),   dγ += Σ_rows dy ⊙ x̂,   dβ += Σ_rows dy
// Row statistics are accumulated in double.
#pragma once

#include <cstdint>
#include <string>

#include "qkv/nn/parameter.hpp"

namespace qkv::nn {

template <class T>
struct LayerNormSaved {
  Tensor<T, 1> mean, rstd;  // per row
};

template <class T>
class LayerNorm {
 public:
  using Saved = LayerNormSaved<T>;

  LayerNorm() = default;
  explicit LayerNorm(int64_t dim, double eps = 1e-5);

  int64_t dim() const { return dim_; }
  double eps() const { return eps_; }

  void reset_parameters();  // γ = 1, β = 0

  // x, y [rows, dim]; y may alias x.
  void forward(Matrix<const T> x, Matrix<T> y, Saved& saved) const;
  // Writes dx (or adds into it when `accumulate_dx`); accumulates dγ, dβ.
  void backward(Matrix<const T> x, const Saved& saved, Matrix<const T> dy, Matrix<T> dx,
                bool accumulate_dx = false);

  void collect(ParameterList<T>& list, const std::string& prefix);

  Parameter<T> gain;  // γ [dim]
  Parameter<T> bias;  // β [dim]

 private:
  int64_t dim_ = 0;
  double eps_ = 1e-5;
};

}  // namespace qkv::nn
