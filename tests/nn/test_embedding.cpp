// Token and position embeddings.
#include <gtest/gtest.h>

#include <vector>

#include "nn_test_support.hpp"
#include "qkv/error.hpp"
#include "qkv/nn/embedding.hpp"

namespace qkv::nn {
namespace {

TEST(Embedding, LooksUpRowsAndScatterAddsGradients) {
  Rng rng(1);
  Embedding<double> table(6, 3);
  table.reset_parameters(rng);
  const std::vector<int32_t> ids = {4, 0, 4, 5};  // a repeated id gets both gradients
  Tensor<double, 2> out({4, 3}), w({4, 3});
  testing::fill(w, rng);
  auto loss = [&] {
    table.forward(ids, out.view());
    return testing::weighted_sum({out.data(), out.size()}, {w.data(), w.size()});
  };
  loss();
  for (int r = 0; r < 4; ++r) {
    for (int c = 0; c < 3; ++c) EXPECT_EQ(out(r, c), table.weight.value[ids[r] * 3 + c]);
  }
  ParameterList<double> list;
  table.collect(list, "tok");
  zero_grad(list);
  table.backward(ids, w.cview());
  testing::expect_parameter_gradients(list, loss);
  for (int c = 0; c < 3; ++c) EXPECT_EQ(table.weight.grad[1 * 3 + c], 0.0);  // unused id
}

TEST(Embedding, RejectsIdsOutsideTheTable) {
  Embedding<float> table(5, 2);
  Tensor<float, 2> out({1, 2});
  const std::vector<int32_t> bad = {5};
  EXPECT_THROW(
      {
        try {
          table.forward(bad, out.view());
        } catch (const Error& e) {
          EXPECT_STREQ(e.what(), "qkv::nn::Embedding::forward: ids[0]: expected in [0, 5), got 5");
          throw;
        }
      },
      Error);
  const std::vector<int32_t> negative = {-1};
  EXPECT_THROW(table.backward(negative, out.cview()), Error);
}

TEST(PositionEmbedding, AddsPositionsAndSumsGradientsOverTheBatch) {
  Rng rng(2);
  PositionEmbedding<double> positions(8, 3);
  positions.reset_parameters(rng);
  Tensor<double, 3> x({2, 5, 3}), x0({2, 5, 3}), w({2, 5, 3});
  testing::fill(x0, rng);
  testing::fill(w, rng);
  auto loss = [&] {
    x = x0;
    positions.forward(x.view());
    return testing::weighted_sum({x.data(), x.size()}, {w.data(), w.size()});
  };
  loss();
  for (int b = 0; b < 2; ++b) {
    for (int t = 0; t < 5; ++t) {
      for (int c = 0; c < 3; ++c) EXPECT_EQ(x(b, t, c), x0(b, t, c) + positions.weight.value[t * 3 + c]);
    }
  }
  ParameterList<double> list;
  positions.collect(list, "pos");
  zero_grad(list);
  positions.backward(w.cview());
  // Positions 5..7 are unused: their gradient is 0 and FD agrees; check all rows.
  const std::vector<double> analytic(positions.weight.grads().begin(), positions.weight.grads().end());
  testing::expect_gradient(positions.weight.values(), analytic, loss, "pos.weight");
  Tensor<double, 3> too_long({1, 9, 3});
  EXPECT_THROW(positions.forward(too_long.view()), Error);
}

}  // namespace
}  // namespace qkv::nn
