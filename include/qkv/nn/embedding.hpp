// Token and learned absolute position embeddings.
//
//   Embedding:          out[r, :]    = table[id_r, :]         d table[id_r, :] += dout[r, :]
//   PositionEmbedding:  x[b, t, :]  += table[t, :]            d table[t, :]    += Σ_b dx[b, t, :]
//                       (or table[start_b + t, :] for tokens fed after start_b earlier ones)
// Gradient sums are accumulated in double and added to the gradient once.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "qkv/nn/parameter.hpp"
#include "qkv/nn/random.hpp"

namespace qkv::nn {

template <class T>
class Embedding {
 public:
  Embedding() = default;
  Embedding(int64_t num_embeddings, int64_t dim);

  int64_t num_embeddings() const { return num_; }
  int64_t dim() const { return dim_; }

  // N(0, 1), as PyTorch's nn.Embedding; models often rescale (see Transformer).
  void reset_parameters(Rng& rng);

  // out [ids.size(), dim] = rows of the table. An id outside [0, num) throws qkv::Error.
  void forward(std::span<const int32_t> ids, Matrix<T> out) const;
  // Scatter-adds dout's rows into the table's gradient.
  void backward(std::span<const int32_t> ids, Matrix<const T> dout);

  void collect(ParameterList<T>& list, const std::string& prefix);

  Parameter<T> weight;  // [num, dim]

 private:
  int64_t num_ = 0, dim_ = 0;
};

template <class T>
class PositionEmbedding {
 public:
  PositionEmbedding() = default;
  PositionEmbedding(int64_t max_positions, int64_t dim);

  int64_t max_positions() const { return max_; }
  int64_t dim() const { return dim_; }

  void reset_parameters(Rng& rng);  // N(0, 1)

  // x [B, N, dim] += table[0:N] broadcast over B; N ≤ max_positions.
  void forward(TensorView<T, 3> x) const;
  // x[b] += table[start[b] : start[b] + N]: tokens that continue sequences already holding
  // start[b] tokens (incremental decoding). start.size() = B; each start[b] + N must be
  // ≤ max_positions, else qkv::Error and x unchanged.
  void forward(TensorView<T, 3> x, std::span<const int64_t> start) const;
  // table gradient[t] += Σ_b dx[b, t].
  void backward(TensorView<const T, 3> dx);

  void collect(ParameterList<T>& list, const std::string& prefix);

  Parameter<T> weight;  // [max_positions, dim]

 private:
  int64_t max_ = 0, dim_ = 0;
};

}  // namespace qkv::nn
