// Token and position embeddings: table lookups forward, scatter-adds backward.
#include "qkv/nn/embedding.hpp"

#include <string>
#include <vector>

#include "check.hpp"

namespace qkv::nn {

template <class T>
Embedding<T>::Embedding(int64_t num_embeddings, int64_t dim) : num_(num_embeddings), dim_(dim) {
  detail::expect(num_embeddings >= 1, "Embedding",
                 "num_embeddings: expected ≥ 1, got " + std::to_string(num_embeddings));
  detail::expect(dim >= 1, "Embedding", "dim: expected ≥ 1, got " + std::to_string(dim));
  weight = Parameter<T>({num_embeddings, dim}, /*decay=*/true);
}

template <class T>
void Embedding<T>::reset_parameters(Rng& rng) {
  fill_normal(weight.values(), 0.0, 1.0, rng);
}

template <class T>
void Embedding<T>::forward(std::span<const int32_t> ids, Matrix<T> out) const {
  const int64_t rows = static_cast<int64_t>(ids.size());
  detail::check_matrix("Embedding::forward", "out", out, rows, dim_);
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t id = ids[r];
    if (id < 0 || id >= num_) {
      detail::fail("Embedding::forward", "ids[" + std::to_string(r) + "]: expected in [0, " +
                                             std::to_string(num_) + "), got " +
                                             std::to_string(id));
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = weight.value.data() + static_cast<int64_t>(ids[r]) * dim_;
    for (int64_t c = 0; c < dim_; ++c) out(r, c) = row[c];
  }
}

template <class T>
void Embedding<T>::backward(std::span<const int32_t> ids, Matrix<const T> dout) {
  const int64_t rows = static_cast<int64_t>(ids.size());
  detail::check_matrix("Embedding::backward", "dout", dout, rows, dim_);
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t id = ids[r];
    if (id < 0 || id >= num_) {
      detail::fail("Embedding::backward", "ids[" + std::to_string(r) + "]: expected in [0, " +
                                              std::to_string(num_) + "), got " +
                                              std::to_string(id));
    }
  }
  // A frequent id collects thousands of rows: sum them in double (one row of sums per
  // distinct id in this batch, not per table row), then add each sum once.
  std::vector<int32_t> slot_of(static_cast<std::size_t>(num_), -1);
  std::vector<int32_t> distinct;
  for (int64_t r = 0; r < rows; ++r) {
    if (slot_of[ids[r]] < 0) {
      slot_of[ids[r]] = static_cast<int32_t>(distinct.size());
      distinct.push_back(ids[r]);
    }
  }
  std::vector<double> sums(distinct.size() * static_cast<std::size_t>(dim_), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    double* row = sums.data() + static_cast<int64_t>(slot_of[ids[r]]) * dim_;
    for (int64_t c = 0; c < dim_; ++c) row[c] += static_cast<double>(dout(r, c));
  }
  for (std::size_t slot = 0; slot < distinct.size(); ++slot) {
    T* grad = weight.grad.data() + static_cast<int64_t>(distinct[slot]) * dim_;
    const double* row = sums.data() + static_cast<int64_t>(slot) * dim_;
    for (int64_t c = 0; c < dim_; ++c) grad[c] = static_cast<T>(grad[c] + row[c]);
  }
}

template <class T>
void Embedding<T>::collect(ParameterList<T>& list, const std::string& prefix) {
  list.push_back({prefix + ".weight", &weight});
}

template <class T>
PositionEmbedding<T>::PositionEmbedding(int64_t max_positions, int64_t dim)
    : max_(max_positions), dim_(dim) {
  detail::expect(max_positions >= 1, "PositionEmbedding",
                 "max_positions: expected ≥ 1, got " + std::to_string(max_positions));
  detail::expect(dim >= 1, "PositionEmbedding", "dim: expected ≥ 1, got " + std::to_string(dim));
  weight = Parameter<T>({max_positions, dim}, /*decay=*/true);
}

template <class T>
void PositionEmbedding<T>::reset_parameters(Rng& rng) {
  fill_normal(weight.values(), 0.0, 1.0, rng);
}

namespace {

template <class T>
void check_positions(const std::string& fn, const char* name, const TensorView<T, 3>& x,
                     int64_t max, int64_t dim) {
  detail::expect(x.shape[1] <= max, fn, std::string(name) + ".shape[1] (seq): expected ≤ " +
                                            std::to_string(max) + " (max_positions), got " +
                                            std::to_string(x.shape[1]));
  detail::expect(x.shape[2] == dim, fn, std::string(name) + ".shape[2] (features): expected " +
                                            std::to_string(dim) + ", got " +
                                            std::to_string(x.shape[2]));
  detail::expect(x.numel() == 0 || x.data != nullptr, fn, std::string(name) + " is empty");
}

}  // namespace

template <class T>
void PositionEmbedding<T>::forward(TensorView<T, 3> x) const {
  const std::vector<int64_t> start(static_cast<std::size_t>(x.shape[0]), 0);
  forward(x, start);
}

template <class T>
void PositionEmbedding<T>::forward(TensorView<T, 3> x, std::span<const int64_t> start) const {
  const std::string fn = "PositionEmbedding::forward";
  check_positions(fn, "x", x, max_, dim_);
  detail::expect(static_cast<int64_t>(start.size()) == x.shape[0], fn,
                 "start.size(): expected " + std::to_string(x.shape[0]) + " (x.shape[0]), got " +
                     std::to_string(start.size()));
  for (std::size_t b = 0; b < start.size(); ++b) {
    detail::expect(start[b] >= 0 && start[b] + x.shape[1] <= max_, fn,
                   "start[" + std::to_string(b) + "] + x.shape[1]: expected positions in [0, " +
                       std::to_string(max_) + ") (max_positions), got " +
                       std::to_string(start[b]) + " + " + std::to_string(x.shape[1]));
  }
  for (int64_t b = 0; b < x.shape[0]; ++b) {
    for (int64_t t = 0; t < x.shape[1]; ++t) {
      const T* row = weight.value.data() + (start[static_cast<std::size_t>(b)] + t) * dim_;
      for (int64_t c = 0; c < dim_; ++c) x(b, t, c) += row[c];
    }
  }
}

template <class T>
void PositionEmbedding<T>::backward(TensorView<const T, 3> dx) {
  check_positions("PositionEmbedding::backward", "dx", dx, max_, dim_);
  std::vector<double> sums(static_cast<std::size_t>(dx.shape[1] * dim_), 0.0);
  for (int64_t b = 0; b < dx.shape[0]; ++b) {
    for (int64_t t = 0; t < dx.shape[1]; ++t) {
      for (int64_t c = 0; c < dim_; ++c) sums[t * dim_ + c] += static_cast<double>(dx(b, t, c));
    }
  }
  for (std::size_t i = 0; i < sums.size(); ++i) {
    weight.grad[i] = static_cast<T>(weight.grad[i] + sums[i]);
  }
}

template <class T>
void PositionEmbedding<T>::collect(ParameterList<T>& list, const std::string& prefix) {
  list.push_back({prefix + ".weight", &weight});
}

template class Embedding<float>;
template class Embedding<double>;
template class PositionEmbedding<float>;
template class PositionEmbedding<double>;

}  // namespace qkv::nn
