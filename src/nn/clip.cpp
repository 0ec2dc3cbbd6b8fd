// Global gradient-norm clipping.
#include "qkv/nn/clip.hpp"

#include <cmath>
#include <string>

#include "check.hpp"

namespace qkv::nn {
namespace {

template <class T>
double norm_impl(const ParameterList<T>& parameters) {
  double squares = 0.0;
  for (const auto& named : parameters) {
    for (T g : named.parameter->grads()) squares += static_cast<double>(g) * g;
  }
  return std::sqrt(squares);
}

template <class T>
double clip_impl(const ParameterList<T>& parameters, double max_norm) {
  detail::expect(max_norm > 0, "clip_grad_norm",
                 "max_norm: expected > 0, got " + std::to_string(max_norm));
  const double norm = norm_impl(parameters);
  if (std::isfinite(norm) && norm > max_norm) {
    const double factor = max_norm / (norm + 1e-6);
    for (const auto& named : parameters) {
      for (T& g : named.parameter->grads()) g = static_cast<T>(g * factor);
    }
  }
  return norm;
}

}  // namespace

double clip_grad_norm(const ParameterList<float>& parameters, double max_norm) {
  return clip_impl(parameters, max_norm);
}
double clip_grad_norm(const ParameterList<double>& parameters, double max_norm) {
  return clip_impl(parameters, max_norm);
}
double grad_norm(const ParameterList<float>& parameters) { return norm_impl(parameters); }
double grad_norm(const ParameterList<double>& parameters) { return norm_impl(parameters); }

}  // namespace qkv::nn
