// LayerNorm over each row; the backward mirrors the forward term by term. Rows are
// independent and run in blocks on the thread pool; the parameter gradients sum over
// rows per block, then over blocks in order (the same bits for any thread count).
#include "qkv/nn/layer_norm.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "check.hpp"
#include "parallel.hpp"

namespace qkv::nn {

template <class T>
LayerNorm<T>::LayerNorm(int64_t dim, double eps) : dim_(dim), eps_(eps) {
  detail::expect(dim >= 1, "LayerNorm", "dim: expected ≥ 1, got " + std::to_string(dim));
  detail::expect(eps > 0 && std::isfinite(eps), "LayerNorm",
                 "eps: expected finite and > 0, got " + std::to_string(eps));
  gain = Parameter<T>({dim}, /*decay=*/false);
  bias = Parameter<T>({dim}, /*decay=*/false);
  reset_parameters();
}

template <class T>
void LayerNorm<T>::reset_parameters() {
  std::ranges::fill(gain.values(), T(1));
  std::ranges::fill(bias.values(), T(0));
}

template <class T>
void LayerNorm<T>::forward(Matrix<const T> x, Matrix<T> y, Saved& saved) const {
  detail::check_matrix("LayerNorm::forward", "x", x, -1, dim_);
  detail::check_matrix("LayerNorm::forward", "y", y, x.shape[0], dim_);
  const int64_t rows = x.shape[0];
  detail::ensure_shape(saved.mean, {rows});
  detail::ensure_shape(saved.rstd, {rows});
  const double n = static_cast<double>(dim_);
  detail::parallel_blocks(rows, detail::kRowBlock, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      // μ = mean(x), σ² = mean((x − μ)²): two passes, so no cancellation.
      double sum = 0.0;
      for (int64_t c = 0; c < dim_; ++c) sum += static_cast<double>(x(r, c));
      const double mean = sum / n;
      double squares = 0.0;
      for (int64_t c = 0; c < dim_; ++c) {
        const double centered = static_cast<double>(x(r, c)) - mean;
        squares += centered * centered;
      }
      const double rstd = 1.0 / std::sqrt(squares / n + eps_);
      saved.mean[r] = static_cast<T>(mean);
      saved.rstd[r] = static_cast<T>(rstd);
      // y = γ ⊙ x̂ + β,  x̂ = (x − μ)·r.
      for (int64_t c = 0; c < dim_; ++c) {
        const double normalized = (static_cast<double>(x(r, c)) - mean) * rstd;
        y(r, c) = static_cast<T>(normalized * static_cast<double>(gain.value[c]) +
                                 static_cast<double>(bias.value[c]));
      }
    }
  });
}

template <class T>
void LayerNorm<T>::backward(Matrix<const T> x, const Saved& saved, Matrix<const T> dy,
                            Matrix<T> dx, bool accumulate_dx) {
  const std::string fn = "LayerNorm::backward";
  detail::check_matrix(fn, "x", x, -1, dim_);
  const int64_t rows = x.shape[0];
  detail::check_matrix(fn, "dy", dy, rows, dim_);
  detail::check_matrix(fn, "dx", dx, rows, dim_);
  detail::expect(saved.mean.size() == static_cast<std::size_t>(rows), fn,
                 "saved: not filled by a forward over these rows");
  const double n = static_cast<double>(dim_);
  const int64_t blocks = detail::block_count(rows, detail::kRowBlock);
  // Per block: Σ dy ⊙ x̂ (for dγ) and Σ dy (for dβ), in double.
  std::vector<double> d_gain(static_cast<std::size_t>(blocks * dim_), 0.0), d_bias(d_gain.size(), 0.0);
  detail::parallel_blocks(rows, detail::kRowBlock, [&](int64_t begin, int64_t end) {
    double* block_gain = d_gain.data() + (begin / detail::kRowBlock) * dim_;
    double* block_bias = d_bias.data() + (begin / detail::kRowBlock) * dim_;
    for (int64_t r = begin; r < end; ++r) {
      const double mean = saved.mean[r], rstd = saved.rstd[r];
      // In the forward y = γ ⊙ x̂ + β, so now dβ += dy, dγ += dy ⊙ x̂ and g = γ ⊙ dy;
      // x̂ = (x − μ)·r with μ and r depending on x gives
      // dx = r·(g − mean(g) − x̂·mean(g ⊙ x̂)).
      double mean_g = 0.0, mean_g_xhat = 0.0;
      for (int64_t c = 0; c < dim_; ++c) {
        const double xhat = (static_cast<double>(x(r, c)) - mean) * rstd;
        const double g = static_cast<double>(gain.value[c]) * static_cast<double>(dy(r, c));
        mean_g += g;
        mean_g_xhat += g * xhat;
        block_bias[c] += static_cast<double>(dy(r, c));
        block_gain[c] += static_cast<double>(dy(r, c)) * xhat;
      }
      mean_g /= n;
      mean_g_xhat /= n;
      for (int64_t c = 0; c < dim_; ++c) {
        const double xhat = (static_cast<double>(x(r, c)) - mean) * rstd;
        const double g = static_cast<double>(gain.value[c]) * static_cast<double>(dy(r, c));
        const T value = static_cast<T>(rstd * (g - mean_g - xhat * mean_g_xhat));
        dx(r, c) = accumulate_dx ? dx(r, c) + value : value;
      }
    }
  });
  for (int64_t c = 0; c < dim_; ++c) {
    double sum_gain = 0.0, sum_bias = 0.0;
    for (int64_t block = 0; block < blocks; ++block) {
      sum_gain += d_gain[block * dim_ + c];
      sum_bias += d_bias[block * dim_ + c];
    }
    gain.grad[c] = static_cast<T>(gain.grad[c] + sum_gain);
    bias.grad[c] = static_cast<T>(bias.grad[c] + sum_bias);
  }
}

template <class T>
void LayerNorm<T>::collect(ParameterList<T>& list, const std::string& prefix) {
  list.push_back({prefix + ".weight", &gain});
  list.push_back({prefix + ".bias", &bias});
}

template class LayerNorm<float>;
template class LayerNorm<double>;

}  // namespace qkv::nn
