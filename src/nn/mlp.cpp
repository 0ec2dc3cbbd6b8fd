// MLP: Linear → GELU → Linear; the backward runs the three steps in reverse.
#include "qkv/nn/mlp.hpp"

#include <span>

#include "check.hpp"
#include "parallel.hpp"
#include "qkv/nn/gelu.hpp"

namespace qkv::nn {

template <class T>
Mlp<T>::Mlp(int64_t dim, int64_t hidden_dim, bool bias)
    : fc1(dim, hidden_dim, bias), fc2(hidden_dim, dim, bias) {}

template <class T>
void Mlp<T>::reset_parameters(Rng& rng) {
  fc1.reset_parameters(rng);
  fc2.reset_parameters(rng);
}

template <class T>
void Mlp<T>::forward(Matrix<const T> x, Matrix<T> y, Saved& saved) const {
  detail::check_matrix("Mlp::forward", "x", x, -1, dim());
  const int64_t rows = x.shape[0];
  detail::ensure_shape(saved.hidden, {rows, hidden_dim()});
  detail::ensure_shape(saved.activation, {rows, hidden_dim()});
  detail::ensure_shape(saved.slope, {rows, hidden_dim()});
  fc1.forward(x, saved.hidden.view());                                    // h = x·W₁ᵀ + b₁
  gelu_forward(std::span<const T>(saved.hidden.data(), saved.hidden.size()),
               std::span<T>(saved.activation.data(), saved.activation.size()),
               std::span<T>(saved.slope.data(), saved.slope.size()));    // a = gelu(h)
  fc2.forward(saved.activation.view(), y);                                // y = a·W₂ᵀ + b₂
}

template <class T>
void Mlp<T>::backward(Matrix<const T> x, Saved& saved, Matrix<const T> dy, Matrix<T> dx,
                      bool accumulate_dx) {
  const int64_t rows = x.shape[0];
  detail::expect(saved.hidden.shape()[0] == rows && saved.hidden.shape()[1] == hidden_dim(),
                 "Mlp::backward", "saved: not filled by a forward over these rows");
  detail::ensure_shape(saved.d_hidden, {rows, hidden_dim()});
  fc2.backward(saved.activation.view(), dy, saved.d_hidden.view());        // da = dy·W₂
  T* d_hidden = saved.d_hidden.data();
  const T* slope = saved.slope.data();
  detail::parallel_blocks(static_cast<int64_t>(saved.d_hidden.size()), 16384,
                          [&](int64_t begin, int64_t end) {
                            for (int64_t i = begin; i < end; ++i) d_hidden[i] *= slope[i];
                          });  // dh = gelu'(h) ⊙ da
  fc1.backward(x, saved.d_hidden.view(), dx, accumulate_dx);              // dx = dh·W₁
}

template <class T>
void Mlp<T>::collect(ParameterList<T>& list, const std::string& prefix) {
  fc1.collect(list, prefix + ".fc1");
  fc2.collect(list, prefix + ".fc2");
}

template class Mlp<float>;
template class Mlp<double>;

}  // namespace qkv::nn
