// AdamW, element by element in double, in torch.optim.AdamW's order of operations.
#include "qkv/nn/adamw.hpp"

#include <cmath>
#include <string>

#include "check.hpp"
#include "parallel.hpp"

namespace qkv::nn {

template <class T>
AdamW<T>::AdamW(ParameterList<T> parameters, const AdamWConfig& config)
    : parameters_(std::move(parameters)), config_(config) {
  const std::string fn = "AdamW";
  detail::expect(config.lr >= 0 && std::isfinite(config.lr), fn,
                 "config.lr: expected finite and ≥ 0, got " + std::to_string(config.lr));
  detail::expect(config.beta1 >= 0 && config.beta1 < 1, fn,
                 "config.beta1: expected in [0, 1), got " + std::to_string(config.beta1));
  detail::expect(config.beta2 >= 0 && config.beta2 < 1, fn,
                 "config.beta2: expected in [0, 1), got " + std::to_string(config.beta2));
  detail::expect(config.eps > 0, fn, "config.eps: expected > 0, got " + std::to_string(config.eps));
  detail::expect(config.weight_decay >= 0, fn, "config.weight_decay: expected ≥ 0, got " +
                                                   std::to_string(config.weight_decay));
  for (const auto& named : parameters_) {
    detail::expect(named.parameter != nullptr, fn, "parameters: " + named.name + " is null");
    m_.emplace_back(typename Tensor<T, 1>::Shape{named.parameter->numel()});
    v_.emplace_back(typename Tensor<T, 1>::Shape{named.parameter->numel()});
  }
}

template <class T>
void AdamW<T>::step(double lr) {
  detail::expect(lr >= 0 && std::isfinite(lr), "AdamW::step",
                 "lr: expected finite and ≥ 0, got " + std::to_string(lr));
  ++steps_;
  const double t = static_cast<double>(steps_);
  const double b1 = config_.beta1, b2 = config_.beta2;
  const double step_size = lr / (1.0 - std::pow(b1, t));
  const double sqrt_correction2 = std::sqrt(1.0 - std::pow(b2, t));
  for (std::size_t i = 0; i < parameters_.size(); ++i) {
    Parameter<T>& p = *parameters_[i].parameter;
    const double decay = p.decay ? 1.0 - lr * config_.weight_decay : 1.0;
    T* value = p.value.data();
    const T* grad = p.grad.data();
    T* m = m_[i].data();
    T* v = v_[i].data();
    // Element-wise: blocks on the thread pool.
    detail::parallel_blocks(p.numel(), 16384, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        const double g = grad[j];
        const double m_new = b1 * static_cast<double>(m[j]) + (1.0 - b1) * g;
        const double v_new = b2 * static_cast<double>(v[j]) + (1.0 - b2) * g * g;
        m[j] = static_cast<T>(m_new);
        v[j] = static_cast<T>(v_new);
        const double denominator = std::sqrt(v_new) / sqrt_correction2 + config_.eps;
        value[j] = static_cast<T>(static_cast<double>(value[j]) * decay -
                                  step_size * m_new / denominator);
      }
    });
  }
}

template <class T>
void AdamW<T>::set_steps(int64_t steps) {
  detail::expect(steps >= 0, "AdamW::set_steps",
                 "steps: expected ≥ 0, got " + std::to_string(steps));
  steps_ = steps;
}

template class AdamW<float>;
template class AdamW<double>;

}  // namespace qkv::nn
