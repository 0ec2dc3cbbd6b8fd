// LayerNorm: normalization, gradients, the ε floor.
#include <gtest/gtest.h>

#include "nn_test_support.hpp"
#include "qkv/error.hpp"
#include "qkv/nn/layer_norm.hpp"

namespace qkv::nn {
namespace {

TEST(LayerNorm, NormalizesEachRow) {
  Rng rng(1);
  LayerNorm<double> norm(16);
  Tensor<double, 2> x({3, 16}), y({3, 16});
  testing::fill(x, rng, 5.0);
  for (int c = 0; c < 16; ++c) x(1, c) += 100.0;  // an offset row
  LayerNormSaved<double> saved;
  norm.forward(x.cview(), y.view(), saved);
  for (int r = 0; r < 3; ++r) {
    double mean = 0, var = 0;
    for (int c = 0; c < 16; ++c) mean += y(r, c) / 16;
    for (int c = 0; c < 16; ++c) var += (y(r, c) - mean) * (y(r, c) - mean) / 16;
    EXPECT_NEAR(mean, 0.0, 1e-12);
    // Var(x̂) = σ²/(σ² + ε): 1 up to ε/σ² ≈ 1e-5/25.
    EXPECT_NEAR(var, 1.0, 1e-6);
  }
}

TEST(LayerNorm, ConstantRowGivesBetaNotNaN) {
  LayerNorm<float> norm(4);
  for (int c = 0; c < 4; ++c) norm.bias.value[c] = static_cast<float>(c);
  Tensor<float, 2> x({1, 4}), y({1, 4});
  for (int c = 0; c < 4; ++c) x(0, c) = 3.0f;
  LayerNormSaved<float> saved;
  norm.forward(x.cview(), y.view(), saved);
  for (int c = 0; c < 4; ++c) EXPECT_EQ(y(0, c), static_cast<float>(c));
}

TEST(LayerNorm, GradientsMatchFiniteDifferences) {
  Rng rng(2);
  LayerNorm<double> norm(7);
  testing::fill(norm.gain.values(), rng);  // away from the (1, 0) start, so γ matters
  testing::fill(norm.bias.values(), rng);
  Tensor<double, 2> x({5, 7}), y({5, 7}), w({5, 7}), dx({5, 7});
  testing::fill(x, rng);
  testing::fill(w, rng);
  LayerNormSaved<double> saved;
  auto loss = [&] {
    norm.forward(x.cview(), y.view(), saved);
    return testing::weighted_sum({y.data(), y.size()}, {w.data(), w.size()});
  };
  ParameterList<double> list;
  norm.collect(list, "norm");
  zero_grad(list);
  loss();
  norm.backward(x.cview(), saved, w.cview(), dx.view());
  testing::expect_parameter_gradients(list, loss);
  testing::expect_gradient({x.data(), x.size()}, {dx.data(), dx.size()}, loss, "x");
}

TEST(LayerNorm, RejectsBadArguments) {
  EXPECT_THROW(LayerNorm<float>(0), Error);
  EXPECT_THROW(LayerNorm<float>(4, 0.0), Error);
  LayerNorm<float> norm(4);
  Tensor<float, 2> x({2, 3}), y({2, 3});
  LayerNormSaved<float> saved;
  EXPECT_THROW(norm.forward(x.cview(), y.view(), saved), Error);
}

}  // namespace
}  // namespace qkv::nn
