// Softmax cross-entropy.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "nn_test_support.hpp"
#include "qkv/error.hpp"
#include "qkv/nn/cross_entropy.hpp"

namespace qkv::nn {
namespace {

TEST(CrossEntropy, ValueByHand) {
  // Row 0: logits (0, ln 3) → p = (1/4, 3/4), target 1: −ln(3/4).
  // Row 1: uniform over 2, target 0: ln 2.
  Tensor<double, 2> logits({2, 2});
  logits(0, 1) = std::log(3.0);
  const std::vector<int32_t> targets = {1, 0};
  Tensor<double, 2> grad({2, 2});
  const double loss = softmax_cross_entropy(logits.cview(), targets, grad.view());
  EXPECT_NEAR(loss, (-std::log(0.75) + std::log(2.0)) / 2, 1e-15);
  EXPECT_NEAR(grad(0, 0), 0.25 / 2, 1e-15);
  EXPECT_NEAR(grad(0, 1), -0.25 / 2, 1e-15);
  EXPECT_NEAR(grad(1, 0), -0.5 / 2, 1e-15);
}

TEST(CrossEntropy, GradientMatchesFiniteDifferences) {
  Rng rng(1);
  Tensor<double, 2> logits({6, 9}), grad({6, 9});
  testing::fill(logits, rng, 3.0);
  const std::vector<int32_t> targets = {0, 8, 3, kIgnoreIndex, 3, 5};
  auto loss = [&] { return softmax_cross_entropy(logits.cview(), targets); };
  softmax_cross_entropy(logits.cview(), targets, grad.view());
  testing::expect_gradient({logits.data(), logits.size()}, {grad.data(), grad.size()}, loss, "logits");
  for (int j = 0; j < 9; ++j) EXPECT_EQ(grad(3, j), 0.0);  // the ignored row
}

TEST(CrossEntropy, HugeLogitsDoNotOverflow) {
  Tensor<float, 2> logits({1, 3});
  logits(0, 0) = 1e30f;
  logits(0, 1) = -1e30f;
  const std::vector<int32_t> right = {0}, wrong = {1};
  EXPECT_EQ(softmax_cross_entropy(logits.cview(), right), 0.0);
  EXPECT_NEAR(softmax_cross_entropy(logits.cview(), wrong), 2e30, 1e24);
}

TEST(CrossEntropy, GradientMayOverwriteTheLogits) {
  Rng rng(2);
  Tensor<float, 2> logits({3, 4}), copy({3, 4}), grad({3, 4});
  testing::fill(logits, rng);
  copy = logits;
  const std::vector<int32_t> targets = {1, 2, 3};
  const double expected = softmax_cross_entropy(copy.cview(), targets, grad.view());
  EXPECT_EQ(softmax_cross_entropy(logits.cview(), targets, logits.view()), expected);
  for (std::size_t i = 0; i < grad.size(); ++i) EXPECT_EQ(logits[i], grad[i]);
}

TEST(CrossEntropy, AllIgnoredIsZeroAndBadTargetsThrow) {
  Tensor<float, 2> logits({2, 3}), grad({2, 3});
  const std::vector<int32_t> ignored = {kIgnoreIndex, kIgnoreIndex};
  EXPECT_EQ(softmax_cross_entropy(logits.cview(), ignored, grad.view()), 0.0);
  const std::vector<int32_t> bad = {0, 3};
  EXPECT_THROW(softmax_cross_entropy(logits.cview(), bad), Error);
  const std::vector<int32_t> short_targets = {0};
  EXPECT_THROW(softmax_cross_entropy(logits.cview(), short_targets), Error);
}

}  // namespace
}  // namespace qkv::nn
