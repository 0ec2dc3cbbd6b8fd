// Why 1/√d: for q, k with i.i.d. N(0, 1) entries, Var(q·k) = d, and Var(q·k/√d) = 1.
// The logits are taken from the library itself: with one key and an additive bias of 0,
// attention's log-sum-exp over a single key is exactly that key's scaled logit.
#include <gtest/gtest.h>

#include <cmath>

#include "test_support.hpp"

namespace qkv {
namespace {

// Sample variance of n i.i.d. draws of X = q·k = Σ_c q_c·k_c:
//   Var(X) = d, and the fourth cumulant of one product q_c·k_c is E[q⁴]E[k⁴] − 3 = 9 − 3 = 6,
//   so κ₄(X) = 6d and Var(sample variance) ≈ (κ₄ + 2σ⁴)/n = (6d + 2d²)/n.
// The relative standard error is sqrt((2 + 6/d)/n); we allow 5 of them, so a correct
// library fails this with probability below 1e-6 for any seed.
double allowed_relative_error(int64_t d, int64_t n) {
  return 5.0 * std::sqrt((2.0 + 6.0 / static_cast<double>(d)) / static_cast<double>(n));
}

double sample_variance(const Tensor<double, 3>& x) {
  double mean = 0.0, m2 = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) mean += x[i];
  mean /= static_cast<double>(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) m2 += (x[i] - mean) * (x[i] - mean);
  return m2 / static_cast<double>(x.size() - 1);
}

// n logits q_i·k_i·scale, one per query row, via the lse of single-key attention.
Tensor<double, 3> logits(int64_t d, int64_t n, double scale, std::uint64_t seed) {
  // n independent (q, k) pairs: batch n, one query, one key, one head.
  auto q = test::random_tensor<double, 4>({n, 1, 1, d}, seed);
  auto k = test::random_tensor<double, 4>({n, 1, 1, d}, seed + 1);
  Tensor<double, 4> v({n, 1, 1, 1}), out({n, 1, 1, 1});
  Tensor<double, 3> lse({n, 1, 1});
  AttentionOptions options;
  options.scale = scale;
  attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                     .lse = lse.view()},
                    options);
  return lse;
}

TEST(LogitVariance, GrowsLikeHeadDimWithoutScaleAndStaysOneWithIt) {
  constexpr int64_t kSamples = 20000;
  for (int64_t d : {16, 64, 256, 1024}) {
    const double tolerance = allowed_relative_error(d, kSamples);
    const double unscaled = sample_variance(logits(d, kSamples, 1.0, 100 + d));
    const double scaled =
        sample_variance(logits(d, kSamples, 1.0 / std::sqrt(static_cast<double>(d)), 100 + d));
    EXPECT_NEAR(unscaled / static_cast<double>(d), 1.0, tolerance) << "d = " << d;
    EXPECT_NEAR(scaled, 1.0, tolerance) << "d = " << d;
  }
}

}  // namespace
}  // namespace qkv
