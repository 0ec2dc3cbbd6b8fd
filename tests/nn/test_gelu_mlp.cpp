// GELU (exact values, the float approximations' accuracy, gradients) and the MLP.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "fast_math.hpp"
#include "nn_test_support.hpp"
#include "qkv/error.hpp"
#include "qkv/nn/gelu.hpp"
#include "qkv/nn/mlp.hpp"

namespace qkv::nn {
namespace {

TEST(Gelu, KnownValues) {
  // x·Φ(x) with Φ(1) = 0.841344746068542948..., Φ(−1) = 1 − Φ(1), Φ(0) = 1/2.
  const std::vector<double> x = {-1.0, 0.0, 1.0, 2.0, -30.0, 30.0};
  std::vector<double> y(x.size());
  gelu_forward(x, y);
  EXPECT_NEAR(y[0], -0.158655253931457051, 1e-15);
  EXPECT_EQ(y[1], 0.0);
  EXPECT_NEAR(y[2], 0.841344746068542948, 1e-15);
  EXPECT_NEAR(y[3], 2.0 * 0.977249868051820792, 1e-15);
  EXPECT_NEAR(y[4], 0.0, 1e-15);
  EXPECT_EQ(y[5], 30.0);
}

TEST(Gelu, FloatApproximationsMeetTheirStatedAccuracy) {
  // fast_math.hpp promises: erf to < 3e-7 absolute, exp to < 4e-7 relative in [−87, 88].
  double erf_error = 0, exp_error = 0;
  for (double v = -10; v <= 10; v += 1.0 / 1024) {
    const auto x = static_cast<float>(v);
    erf_error = std::max(erf_error, std::fabs(detail::erf_approx(x) - std::erf(static_cast<double>(x))));
  }
  for (double v = -87; v <= 88; v += 1.0 / 256) {
    const auto x = static_cast<float>(v);
    exp_error = std::max(exp_error, std::fabs(detail::exp_approx(x) / std::exp(static_cast<double>(x)) - 1));
  }
  EXPECT_LT(erf_error, 3e-7);
  EXPECT_LT(exp_error, 4e-7);
  EXPECT_EQ(detail::exp_approx(-1000.0f), detail::exp_approx(-87.0f));  // clamped, no NaN
  EXPECT_TRUE(std::isfinite(detail::exp_approx(1000.0f)));
  EXPECT_EQ(detail::erf_approx(0.0f), 0.0f);
}

TEST(Gelu, FloatMatchesDoubleIncludingTheSlope) {
  // Over activations of any realistic size, the float path (approximations, then float
  // rounding) stays within 1e-6 of the double one: |x|·3e-7/2 for Φ plus a few ulps.
  std::vector<float> xf;
  std::vector<double> xd;
  for (double v = -8; v <= 8; v += 1.0 / 64) {
    xf.push_back(static_cast<float>(v));
    xd.push_back(v);
  }
  std::vector<float> yf(xf.size()), sf(xf.size());
  std::vector<double> yd(xd.size()), sd(xd.size());
  gelu_forward(xf, yf, sf);
  gelu_forward(xd, yd, sd);
  for (std::size_t i = 0; i < xf.size(); ++i) {
    EXPECT_NEAR(yf[i], yd[i], 1e-6 * (1 + std::fabs(xd[i]))) << "x = " << xd[i];
    EXPECT_NEAR(sf[i], sd[i], 1e-6 * (1 + std::fabs(xd[i]))) << "x = " << xd[i];
  }
}

TEST(Gelu, DerivativeMatchesFiniteDifferences) {
  Rng rng(1);
  std::vector<double> x(40), y(40), w(40), dx(40);
  testing::fill(std::span<double>(x), rng, 2.0);
  testing::fill(std::span<double>(w), rng);
  auto loss = [&] {
    gelu_forward(x, y);
    return testing::weighted_sum(y, w);
  };
  gelu_backward(x, w, dx);
  testing::expect_gradient(x, dx, loss, "x");
  // The slope the forward can return is the same derivative.
  std::vector<double> slope(40);
  gelu_forward(x, y, slope);
  for (std::size_t i = 0; i < x.size(); ++i) EXPECT_DOUBLE_EQ(slope[i] * w[i], dx[i]);
}

TEST(Gelu, RejectsMismatchedSpans) {
  std::vector<float> x(3), y(2);
  EXPECT_THROW(gelu_forward(x, y), Error);
  EXPECT_THROW(gelu_backward(x, x, y), Error);
}

TEST(Mlp, GradientsMatchFiniteDifferences) {
  Rng rng(2);
  Mlp<double> mlp(5, 12);
  mlp.reset_parameters(rng);
  Tensor<double, 2> x({4, 5}), y({4, 5}), w({4, 5}), dx({4, 5});
  testing::fill(x, rng);
  testing::fill(w, rng);
  MlpSaved<double> saved;
  auto loss = [&] {
    mlp.forward(x.cview(), y.view(), saved);
    return testing::weighted_sum({y.data(), y.size()}, {w.data(), w.size()});
  };
  ParameterList<double> list;
  mlp.collect(list, "mlp");
  ASSERT_EQ(list.size(), 4u);
  zero_grad(list);
  loss();
  mlp.backward(x.cview(), saved, w.cview(), dx.view());
  testing::expect_parameter_gradients(list, loss);
  testing::expect_gradient({x.data(), x.size()}, {dx.data(), dx.size()}, loss, "x");
}

}  // namespace
}  // namespace qkv::nn
