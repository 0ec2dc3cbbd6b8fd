// Shared helpers for the qkv::nn tests: seeded random fills and a finite-difference
// gradient check.
//
// Gradient checks run in double. The central difference (f(x+h) − f(x−h)) / 2h has
// truncation error ~h²·|f'''|/6 ≈ 1e-12 for h = 1e-6 and rounding error
// ~ε·|f|/h ≈ 2e-16·|f|/1e-6 ≈ 1e-10 for |f| ≲ 1 (our losses are O(1)). The default
// tolerance |analytic − numeric| ≤ 1e-7 + 1e-6·|numeric| sits two orders of magnitude
// above that noise, and many orders below what a wrong term in a backward gives
// (a dropped or mis-scaled term moves a gradient by O(|gradient|)).
#pragma once

#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "qkv/nn/parameter.hpp"
#include "qkv/nn/random.hpp"

namespace qkv::nn::testing {

// A path in the temporary directory that no other test process uses (several build
// trees may run these tests at once).
inline std::filesystem::path temp_path(const std::string& name) {
  return std::filesystem::path(::testing::TempDir()) /
         (name + "-" + std::to_string(::getpid()) + ".safetensors");
}

template <class T>
void fill(std::span<T> values, Rng& rng, double scale = 1.0) {
  fill_normal(values, 0.0, scale, rng);
}

template <class T, int R>
void fill(Tensor<T, R>& tensor, Rng& rng, double scale = 1.0) {
  fill(std::span<T>(tensor.data(), tensor.size()), rng, scale);
}

// Σ w ⊙ y: a scalar loss whose gradient with respect to y is w.
inline double weighted_sum(std::span<const double> y, std::span<const double> w) {
  double sum = 0;
  for (std::size_t i = 0; i < y.size(); ++i) sum += y[i] * w[i];
  return sum;
}

struct Tolerance {
  double h = 1e-6;
  double atol = 1e-7;
  double rtol = 1e-6;
};

// Checks analytic[i] against the central difference of `loss` in values[i], for every i
// (or every `stride`-th i). `loss` recomputes the scalar from the current values.
inline void expect_gradient(std::span<double> values, std::span<const double> analytic,
                            const std::function<double()>& loss, const std::string& what,
                            Tolerance tol = {}, std::size_t stride = 1,
                            bool require_nonzero = true) {
  ASSERT_EQ(values.size(), analytic.size()) << what;
  double worst = 0;
  std::size_t worst_index = 0;
  double worst_numeric = 0;
  double largest = 0;
  for (std::size_t i = 0; i < values.size(); i += stride) {
    const double saved = values[i];
    values[i] = saved + tol.h;
    const double up = loss();
    values[i] = saved - tol.h;
    const double down = loss();
    values[i] = saved;
    const double numeric = (up - down) / (2 * tol.h);
    const double excess = std::fabs(analytic[i] - numeric) - (tol.atol + tol.rtol * std::fabs(numeric));
    largest = std::max(largest, std::fabs(numeric));
    if (excess > worst) {
      worst = excess;
      worst_index = i;
      worst_numeric = numeric;
    }
  }
  EXPECT_LE(worst, 0.0) << what << "[" << worst_index << "]: analytic " << analytic[worst_index]
                        << ", finite difference " << worst_numeric;
  // A check where every gradient is zero would pass a backward that does nothing.
  if (require_nonzero) {
    EXPECT_GT(largest, 1e-4) << what << ": every finite difference is ~0; the check is vacuous";
  }
}

// The gradient check for every parameter in `list` (grads must hold the analytic
// gradient of `loss` at the current values). A key projection's bias is exempt from the
// non-zero requirement: it adds q·b_K to every logit of a row alike, which the softmax
// ignores, so its true gradient is exactly 0 (the check then confirms that).
inline void expect_parameter_gradients(const ParameterList<double>& list,
                                       const std::function<double()>& loss,
                                       Tolerance tol = {}, std::size_t max_checks_each = 64) {
  for (const auto& [name, parameter] : list) {
    const std::vector<double> analytic(parameter->grads().begin(), parameter->grads().end());
    const std::size_t stride =
        std::max<std::size_t>(1, analytic.size() / std::max<std::size_t>(1, max_checks_each));
    const bool key_bias = name.ends_with("k_proj.bias");
    expect_gradient(parameter->values(), analytic, loss, name, tol, stride, !key_bias);
  }
}

}  // namespace qkv::nn::testing
