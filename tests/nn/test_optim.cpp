// AdamW against its formulas evaluated by hand here; gradient clipping.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "nn_test_support.hpp"
#include "qkv/error.hpp"
#include "qkv/nn/adamw.hpp"
#include "qkv/nn/clip.hpp"

namespace qkv::nn {
namespace {

TEST(AdamW, TwoStepsByHand) {
  Parameter<double> weight({2}, /*decay=*/true), bias({1}, /*decay=*/false);
  weight.value[0] = 1.0;
  weight.value[1] = -2.0;
  bias.value[0] = 0.5;
  ParameterList<double> list = {{"w", &weight}, {"b", &bias}};
  const AdamWConfig config{.lr = 0.1, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.5};
  AdamW<double> adam(list, config);
  const std::vector<std::vector<double>> grads = {{0.3, -0.4, 2.0}, {-0.1, 0.2, 1.0}};
  // Reference: the update written out for each scalar (p, decays?).
  std::vector<double> p = {1.0, -2.0, 0.5}, m(3, 0.0), v(3, 0.0);
  const std::vector<bool> decays = {true, true, false};
  for (int t = 1; t <= 2; ++t) {
    weight.grad[0] = grads[t - 1][0];
    weight.grad[1] = grads[t - 1][1];
    bias.grad[0] = grads[t - 1][2];
    adam.step();
    for (int i = 0; i < 3; ++i) {
      const double g = grads[t - 1][i];
      if (decays[i]) p[i] *= 1 - 0.1 * 0.5;
      m[i] = 0.9 * m[i] + 0.1 * g;
      v[i] = 0.99 * v[i] + 0.01 * g * g;
      const double m_hat = m[i] / (1 - std::pow(0.9, t)), v_hat = v[i] / (1 - std::pow(0.99, t));
      p[i] -= 0.1 * m_hat / (std::sqrt(v_hat) + 1e-8);
    }
    EXPECT_NEAR(weight.value[0], p[0], 1e-14) << "step " << t;
    EXPECT_NEAR(weight.value[1], p[1], 1e-14) << "step " << t;
    EXPECT_NEAR(bias.value[0], p[2], 1e-14) << "step " << t;
  }
  EXPECT_EQ(adam.steps(), 2);
  // First step of Adam moves each scalar by ≈ lr·sign(g) (bias-corrected m/√v = ±1).
  EXPECT_NEAR(adam.first_moment(1)[0], m[2], 1e-15);
  EXPECT_NEAR(adam.second_moment(1)[0], v[2], 1e-15);
}

TEST(AdamW, RejectsBadConfigs) {
  Parameter<float> p({1}, true);
  ParameterList<float> list = {{"p", &p}};
  EXPECT_THROW(AdamW<float>(list, {.lr = -1}), Error);
  EXPECT_THROW(AdamW<float>(list, {.beta1 = 1.0}), Error);
  EXPECT_THROW(AdamW<float>(list, {.eps = 0}), Error);
  AdamW<float> adam(list, {});
  EXPECT_THROW(adam.step(NAN), Error);
  EXPECT_THROW(adam.set_steps(-1), Error);
}

TEST(Clip, ScalesOnlyAboveTheThreshold) {
  Parameter<double> a({2}, true), b({1}, false);
  ParameterList<double> list = {{"a", &a}, {"b", &b}};
  a.grad[0] = 3;
  a.grad[1] = 0;
  b.grad[0] = 4;  // ‖g‖ = 5
  EXPECT_DOUBLE_EQ(grad_norm(list), 5.0);
  EXPECT_DOUBLE_EQ(clip_grad_norm(list, 10.0), 5.0);
  EXPECT_EQ(a.grad[0], 3.0);  // below the threshold: untouched
  EXPECT_DOUBLE_EQ(clip_grad_norm(list, 1.0), 5.0);
  EXPECT_NEAR(grad_norm(list), 1.0, 1e-6);  // max_norm / (n + 1e-6) · n
  EXPECT_NEAR(a.grad[0] / b.grad[0], 0.75, 1e-15);  // direction kept
  b.grad[0] = NAN;
  EXPECT_TRUE(std::isnan(clip_grad_norm(list, 1.0)));
  EXPECT_NEAR(a.grad[0], 0.6, 1e-6);  // untouched by a NaN norm
  EXPECT_THROW(clip_grad_norm(list, 0.0), Error);
}

TEST(Rng, IsReproducibleAndRestorable) {
  Rng a(42), b(42);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(a.next_u64(), b.next_u64());
  const Rng::State state = a.state();
  const double x = a.normal();
  Rng c(0);
  c.set_state(state);
  EXPECT_EQ(c.normal(), x);
  EXPECT_THROW(c.set_state(Rng::State{}), Error);
  // Moments of 20000 normals: mean within 4σ/√n, variance within 5%.
  double sum = 0, squares = 0;
  for (int i = 0; i < 20000; ++i) {
    const double z = a.normal();
    sum += z;
    squares += z * z;
  }
  EXPECT_NEAR(sum / 20000, 0.0, 4.0 / std::sqrt(20000.0));
  EXPECT_NEAR(squares / 20000, 1.0, 0.05);
  for (int i = 0; i < 1000; ++i) ASSERT_LT(a.below(7), 7u);
}

}  // namespace
}  // namespace qkv::nn
