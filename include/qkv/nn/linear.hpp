// Linear: y = x·Wᵀ + b, as PyTorch's nn.Linear (W is [out, in]), one BLAS GEMM each way.
//
//   forward    y[r, o]  = Σ_i x[r, i]·W[o, i] + b[o]          y  = x·Wᵀ + b
//   backward   dx[r, i] = Σ_o dy[r, o]·W[o, i]                dx = dy·W
//              dW[o, i] += Σ_r dy[r, o]·x[r, i]               dW += dyᵀ·x
//              db[o]    += Σ_r dy[r, o]
//
// Rows are any batch of feature vectors (a [B, N, E] activation is B·N rows). Views must
// have contiguous rows (stride 1 along features); the row stride is free.
#pragma once

#include <cstdint>
#include <string>

#include "qkv/nn/parameter.hpp"
#include "qkv/nn/random.hpp"

namespace qkv::nn {

template <class T>
class Linear {
 public:
  Linear() = default;
  Linear(int64_t in_features, int64_t out_features, bool bias = true);

  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }
  bool has_bias() const { return !bias.empty(); }

  // PyTorch's default: W and b ~ U(−1/√in, 1/√in) (Kaiming-uniform with a = √5).
  void reset_parameters(Rng& rng);

  // y [rows, out] = x [rows, in]·Wᵀ + b. Throws qkv::Error on a shape mismatch.
  void forward(Matrix<const T> x, Matrix<T> y) const;

  // Given x (the forward's input) and dy = ∂L/∂y: accumulates dW (and db), and writes
  // dx = dy·W — or adds it into dx when `accumulate_dx`. An empty dx skips it.
  void backward(Matrix<const T> x, Matrix<const T> dy, Matrix<T> dx,
                bool accumulate_dx = false);

  void collect(ParameterList<T>& list, const std::string& prefix);

  Parameter<T> weight;  // [out, in]
  Parameter<T> bias;    // [out]; empty when built without bias

 private:
  int64_t in_features_ = 0;
  int64_t out_features_ = 0;
};

}  // namespace qkv::nn
