// AdamW: Adam with decoupled weight decay (Kingma & Ba, 2015; Loshchilov & Hutter, 2019),
// the same update as torch.optim.AdamW:
//
//   t += 1
//   p ← p − lr·λ·p                        (only parameters with `decay`)
//   m ← β₁·m + (1 − β₁)·g,   v ← β₂·v + (1 − β₂)·g²
//   p ← p − (lr / (1 − β₁ᵗ)) · m / (√v / √(1 − β₂ᵗ) + ε)
//
// Moments are kept in the parameter type T; each element's arithmetic is done in
// double. The moments and t are the optimizer's whole state (see checkpoint.hpp).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "qkv/nn/parameter.hpp"

namespace qkv::nn {

struct AdamWConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;  // λ
};

template <class T>
class AdamW {
 public:
  // The list's parameters must outlive the optimizer. Throws qkv::Error on a config
  // outside lr ≥ 0, 0 ≤ β < 1, ε > 0, λ ≥ 0.
  AdamW(ParameterList<T> parameters, const AdamWConfig& config);

  // One update of every parameter from its current gradient, at learning rate `lr`
  // (a schedule's value for this step).
  void step(double lr);
  void step() { step(config_.lr); }

  int64_t steps() const { return steps_; }
  void set_steps(int64_t steps);  // restoring a checkpoint

  const AdamWConfig& config() const { return config_; }
  const ParameterList<T>& parameters() const { return parameters_; }
  // First and second moment of parameter i (in list order).
  std::span<T> first_moment(std::size_t i) { return {m_[i].data(), m_[i].size()}; }
  std::span<T> second_moment(std::size_t i) { return {v_[i].data(), v_[i].size()}; }
  std::span<const T> first_moment(std::size_t i) const { return {m_[i].data(), m_[i].size()}; }
  std::span<const T> second_moment(std::size_t i) const {
    return {v_[i].data(), v_[i].size()};
  }

 private:
  ParameterList<T> parameters_;
  AdamWConfig config_;
  std::vector<Tensor<T, 1>> m_, v_;
  int64_t steps_ = 0;
};

}  // namespace qkv::nn
