#include "qkv/nn/parameter.hpp"

#include <algorithm>
#include <string>

#include "check.hpp"
#include "../core/checked_size.hpp"

namespace qkv::nn {

template <class T>
Parameter<T>::Parameter(std::vector<int64_t> shape_, bool decay_)
    : shape(std::move(shape_)), decay(decay_) {
  detail::expect(shape.size() == 1 || shape.size() == 2, "Parameter",
                 "shape: expected rank 1 or 2, got rank " + std::to_string(shape.size()));
  for (int64_t extent : shape)
    detail::expect(extent >= 0, "Parameter", "shape: negative extent " + std::to_string(extent));
  // A layer's sizes come from its config (Linear(in, out), Embedding(n, dim)): a product
  // that wraps would allocate a tiny tensor that init() then overruns.
  const int64_t count = shape.size() == 1 ? shape[0]
                                          : qkv::detail::checked_product("Parameter", "the parameter's elements",
                                                                    {{"shape[0]", shape[0]}, {"shape[1]", shape[1]}});
  const std::size_t bytes = qkv::detail::checked_bytes("Parameter", "the parameter", {{"elements", count}}, 2 * sizeof(T));
  qkv::detail::allocate_or_throw("Parameter", "the value and gradient", bytes, [&] {
    value = Tensor<T, 1>({count});
    grad = Tensor<T, 1>({count});
  });
}

template <class T>
Matrix<T> Parameter<T>::matrix() {
  detail::expect(shape.size() == 2, "Parameter::matrix", "the parameter is not rank 2");
  return Matrix<T>::contiguous(value.data(), {shape[0], shape[1]});
}

template <class T>
Matrix<const T> Parameter<T>::matrix() const {
  detail::expect(shape.size() == 2, "Parameter::matrix", "the parameter is not rank 2");
  return Matrix<const T>::contiguous(value.data(), {shape[0], shape[1]});
}

template <class T>
Matrix<T> Parameter<T>::grad_matrix() {
  detail::expect(shape.size() == 2, "Parameter::grad_matrix", "the parameter is not rank 2");
  return Matrix<T>::contiguous(grad.data(), {shape[0], shape[1]});
}

template <class T>
void zero_grad(const ParameterList<T>& parameters) {
  for (const auto& named : parameters) {
    std::fill(named.parameter->grad.data(),
              named.parameter->grad.data() + named.parameter->grad.size(), T(0));
  }
}

template <class T>
int64_t count_parameters(const ParameterList<T>& parameters) {
  int64_t total = 0;
  for (const auto& named : parameters) total += named.parameter->numel();
  return total;
}

template struct Parameter<float>;
template struct Parameter<double>;
template void zero_grad(const ParameterList<float>&);
template void zero_grad(const ParameterList<double>&);
template int64_t count_parameters(const ParameterList<float>&);
template int64_t count_parameters(const ParameterList<double>&);

}  // namespace qkv::nn
