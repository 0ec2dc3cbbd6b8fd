// Linear: y = x·Wᵀ + b. Forward and backward are each one GEMM (plus the bias).
#include "qkv/nn/linear.hpp"

#include <cmath>
#include <string>
#include <vector>

#include "check.hpp"
#include "gemm.hpp"
#include "parallel.hpp"

namespace qkv::nn {

using detail::Op;

template <class T>
Linear<T>::Linear(int64_t in_features, int64_t out_features, bool with_bias)
    : in_features_(in_features), out_features_(out_features) {
  detail::expect(in_features >= 1, "Linear", "in_features: expected ≥ 1, got " +
                                                 std::to_string(in_features));
  detail::expect(out_features >= 1, "Linear", "out_features: expected ≥ 1, got " +
                                                  std::to_string(out_features));
  weight = Parameter<T>({out_features, in_features}, /*decay=*/true);
  if (with_bias) bias = Parameter<T>({out_features}, /*decay=*/false);
}

template <class T>
void Linear<T>::reset_parameters(Rng& rng) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features_));
  fill_uniform(weight.values(), -bound, bound, rng);
  if (has_bias()) fill_uniform(bias.values(), -bound, bound, rng);
}

template <class T>
void Linear<T>::forward(Matrix<const T> x, Matrix<T> y) const {
  detail::check_matrix("Linear::forward", "x", x, -1, in_features_);
  detail::check_matrix("Linear::forward", "y", y, x.shape[0], out_features_);
  // y = b (broadcast over rows), then y += x·Wᵀ.
  T beta = T(0);
  if (has_bias()) {
    detail::parallel_blocks(y.shape[0], detail::kRowBlock, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t o = 0; o < out_features_; ++o) y(r, o) = bias.value[o];
      }
    });
    beta = T(1);
  }
  detail::gemm(Op::none, Op::transpose, T(1), x, weight.matrix(), beta, y);
}

template <class T>
void Linear<T>::backward(Matrix<const T> x, Matrix<const T> dy, Matrix<T> dx,
                         bool accumulate_dx) {
  const std::string fn = "Linear::backward";
  detail::check_matrix(fn, "x", x, -1, in_features_);
  detail::check_matrix(fn, "dy", dy, x.shape[0], out_features_);
  if (!dx.empty()) detail::check_matrix(fn, "dx", dx, x.shape[0], in_features_);

  // dW += dyᵀ·x   ([out, rows]·[rows, in])
  detail::gemm(Op::transpose, Op::none, T(1), dy, x, T(1), weight.grad_matrix());
  // db += Σ_rows dy, summed in double: a float running sum over thousands of rows
  // would lose digits that the weight gradient (a GEMM with blocked sums) keeps.
  // Per row block a partial sum, then the blocks in order: the same bits for any
  // thread count.
  if (has_bias()) {
    const int64_t rows = dy.shape[0], out = out_features_;
    std::vector<double> partial(static_cast<std::size_t>(detail::block_count(rows, detail::kRowBlock) * out), 0.0);
    detail::parallel_blocks(rows, detail::kRowBlock, [&](int64_t begin, int64_t end) {
      double* sums = partial.data() + (begin / detail::kRowBlock) * out;
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t o = 0; o < out; ++o) sums[o] += static_cast<double>(dy(r, o));
      }
    });
    for (int64_t o = 0; o < out; ++o) {
      double sum = 0.0;
      for (std::size_t block = 0; block < partial.size() / out; ++block) sum += partial[block * out + o];
      bias.grad[o] = static_cast<T>(bias.grad[o] + sum);
    }
  }
  // dx = dy·W   ([rows, out]·[out, in])
  if (!dx.empty()) {
    detail::gemm(Op::none, Op::none, T(1), dy, weight.matrix(), accumulate_dx ? T(1) : T(0),
                 dx);
  }
}

template <class T>
void Linear<T>::collect(ParameterList<T>& list, const std::string& prefix) {
  list.push_back({prefix + ".weight", &weight});
  if (has_bias()) list.push_back({prefix + ".bias", &bias});
}

template class Linear<float>;
template class Linear<double>;

}  // namespace qkv::nn
