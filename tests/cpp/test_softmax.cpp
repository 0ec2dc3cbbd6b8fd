// The textbook claims about the softmax and its Jacobian, checked on the public API.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "test_support.hpp"

namespace qkv {
namespace {

std::vector<double> random_vector(std::size_t n, std::uint64_t seed, double stddev = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, stddev);
  std::vector<double> x(n);
  for (double& value : x) value = normal(rng);
  return x;
}

TEST(Softmax, HugeLogitIsExactlyOneHotInFloat) {
  const std::vector<float> x{1.0f, 2.0f, 3.0f, 1e6f};
  std::vector<float> s(4);
  softmax(x, s);
  EXPECT_EQ(s, (std::vector<float>{0.0f, 0.0f, 0.0f, 1.0f}));
}

TEST(Softmax, SumsToOneAndIsShiftInvariant) {
  const auto x = random_vector(37, 1, 3.0);
  std::vector<double> s(x.size()), shifted_s(x.size()), shifted(x);
  for (double& value : shifted) value += 1234.5;
  softmax(x, s);
  softmax(shifted, shifted_s);
  double sum = 0.0;
  for (std::size_t i = 0; i < s.size(); ++i) {
    sum += s[i];
    // Shift invariance holds up to the rounding of x + 1234.5 (≈ 1e-13 relative).
    EXPECT_NEAR(s[i], shifted_s[i], 1e-12);
  }
  EXPECT_NEAR(sum, 1.0, 1e-15 * static_cast<double>(s.size()));
}

TEST(Softmax, MinusInfinityEntriesTakeNoPart) {
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> s(3), log_s(3);
  softmax(std::vector<double>{0.0, -inf, 0.0}, s);
  EXPECT_EQ(s, (std::vector<double>{0.5, 0.0, 0.5}));
  softmax(std::vector<double>{-inf, -inf, -inf}, s);  // a fully masked row
  EXPECT_EQ(s, (std::vector<double>{0.0, 0.0, 0.0}));
  log_softmax(std::vector<double>{-inf, -inf, -inf}, log_s);
  for (double value : log_s) EXPECT_EQ(value, -inf);
}

TEST(Softmax, LogSoftmaxIsExactWhereSoftmaxUnderflows) {
  const std::vector<double> x{0.0, -2000.0};
  std::vector<double> out(2), s(2);
  log_softmax(x, out);
  softmax(x, s);
  EXPECT_EQ(s[1], 0.0);             // exp(-2000) underflows…
  EXPECT_DOUBLE_EQ(out[1], -2000.0);  // …its log does not
  EXPECT_DOUBLE_EQ(out[0], 0.0);
}

TEST(Softmax, NaNPoisonsOnlyItsOwnRow) {
  std::vector<float> s(3);
  softmax(std::vector<float>{1.0f, std::nanf(""), 2.0f}, s);
  for (float value : s) EXPECT_TRUE(std::isnan(value));
}

TEST(SoftmaxJacobian, OfOneHotIsZeroMatrix) {
  const std::vector<float> x{1.0f, 2.0f, 3.0f, 1e6f};
  std::vector<float> s(4), jacobian(16);
  softmax(x, s);
  softmax_jacobian(s, jacobian);
  for (float value : jacobian) EXPECT_EQ(value, 0.0f);
}

TEST(SoftmaxJacobian, IsSymmetricWithRowsSummingToZero) {
  const auto x = random_vector(11, 2, 2.0);
  const std::size_t n = x.size();
  std::vector<double> s(n), jacobian(n * n);
  softmax(x, s);
  softmax_jacobian(s, jacobian);
  for (std::size_t i = 0; i < n; ++i) {
    double row_sum = 0.0;
    for (std::size_t j = 0; j < n; ++j) {
      EXPECT_EQ(jacobian[i * n + j], jacobian[j * n + i]);
      row_sum += jacobian[i * n + j];
    }
    // Σ_j J_ij = s_i − s_i·Σ_j s_j = s_i·(1 − 1): zero up to the rounding of Σ s_j.
    EXPECT_NEAR(row_sum, 0.0, 1e-15 * static_cast<double>(n));
  }
}

TEST(SoftmaxJacobian, MatchesFiniteDifferencesOfSoftmax) {
  const auto x = random_vector(6, 3);
  const std::size_t n = x.size();
  std::vector<double> s(n), jacobian(n * n), plus(n), minus(n);
  softmax(x, s);
  softmax_jacobian(s, jacobian);
  const double h = 1e-6;  // central differences: error O(h²) ≈ 1e-12 plus rounding 1e-16/h
  for (std::size_t j = 0; j < n; ++j) {
    auto xp = x, xm = x;
    xp[j] += h;
    xm[j] -= h;
    softmax(xp, plus);
    softmax(xm, minus);
    for (std::size_t i = 0; i < n; ++i) {
      EXPECT_NEAR(jacobian[i * n + j], (plus[i] - minus[i]) / (2 * h), 1e-9);
    }
  }
}

TEST(SoftmaxBackward, EqualsJacobianTimesVector) {
  for (std::size_t n : {1u, 2u, 7u, 64u}) {
    const auto x = random_vector(n, 10 + n, 2.0), g = random_vector(n, 20 + n);
    std::vector<double> s(n), jacobian(n * n), via_vector(n);
    softmax(x, s);
    softmax_jacobian(s, jacobian);
    softmax_backward(s, g, via_vector);
    for (std::size_t i = 0; i < n; ++i) {
      double via_matrix = 0.0;
      for (std::size_t j = 0; j < n; ++j) via_matrix += jacobian[j * n + i] * g[j];  // Jᵀ·g
      // Both sum n products of magnitude ≤ max|g|: rounding ≤ n·ε·max|g| (ε = 2⁻⁵²).
      EXPECT_NEAR(via_vector[i], via_matrix, 1e-14 * static_cast<double>(n) * 4.0);
    }
  }
}

TEST(SoftmaxMath, RejectsMismatchedSizes) {
  std::vector<float> x(3), s(4), j(8);
  EXPECT_THROW(softmax(x, s), Error);
  EXPECT_THROW(log_softmax(x, s), Error);
  EXPECT_THROW(softmax_jacobian(x, j), Error);
  EXPECT_THROW(softmax_backward(x, s, x), Error);
  try {
    softmax(x, s);
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "qkv::softmax: s.size(): expected 3 (as x.size()), got 4");
  }
}

}  // namespace
}  // namespace qkv
