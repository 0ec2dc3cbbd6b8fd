// The decoder-only transformer: whole-model gradients against finite differences, the
// loss at initialization, causality.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "nn_test_support.hpp"
#include "qkv/error.hpp"
#include "qkv/nn/transformer.hpp"

namespace qkv::nn {
namespace {

TransformerConfig tiny(int64_t kv_heads = 0) {
  return {.vocab_size = 7, .context = 6, .embed_dim = 8, .num_heads = 2,
          .num_kv_heads = kv_heads, .num_layers = 2, .mlp_dim = 12};
}

TEST(Transformer, GradientsOfTheWholeModelMatchFiniteDifferences) {
  for (int64_t kv_heads : {0, 1}) {
    Transformer<double> model(tiny(kv_heads));
    Rng rng(11);
    model.reset_parameters(rng);
    ParameterList<double> list = model.parameters();
    // GPT-2's init is tiny (0.02): spread the weights so every path carries gradient.
    for (const auto& [name, p] : list) testing::fill(p->values(), rng, 0.4);
    const std::vector<int32_t> ids = {1, 4, 2, 6, 0, 3, 5, 5, 2, 1};
    const std::vector<int32_t> targets = {4, 2, 6, 0, 3, 1, 5, 2, 1, 0};
    auto loss = [&] { return model.forward_loss(ids, targets, 2, 5); };
    zero_grad(list);
    loss();
    model.backward();
    testing::expect_parameter_gradients(list, loss, {}, /*max_checks_each=*/24);
  }
}

TEST(Transformer, InitialLossIsAboutLogVocab) {
  // With N(0, 0.02²) weights the logits are ~0 and the prediction ~uniform.
  Transformer<float> model({.vocab_size = 50, .context = 16, .embed_dim = 32, .num_heads = 4,
                            .num_layers = 2});
  Rng rng(1);
  model.reset_parameters(rng);
  std::vector<int32_t> ids(64), targets(64);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<int32_t>(rng.below(50));
    targets[i] = static_cast<int32_t>(rng.below(50));
  }
  EXPECT_NEAR(model.forward_loss(ids, targets, 4, 16), std::log(50.0), 0.05);
}

TEST(Transformer, IsCausal) {
  // Changing the last token changes no logit before it.
  Transformer<double> model(tiny());
  Rng rng(2);
  model.reset_parameters(rng);
  for (const auto& [name, p] : model.parameters()) testing::fill(p->values(), rng, 0.4);
  std::vector<int32_t> ids = {1, 2, 3, 4, 5, 6};
  const Tensor<double, 2> before = [&] {
    const auto logits = model.forward(ids, 1, 6);
    Tensor<double, 2> copy({6, 7});
    for (int i = 0; i < 6; ++i) {
      for (int v = 0; v < 7; ++v) copy(i, v) = logits(i, v);
    }
    return copy;
  }();
  ids[5] = 0;
  const auto after = model.forward(ids, 1, 6);
  for (int i = 0; i < 5; ++i) {
    for (int v = 0; v < 7; ++v) EXPECT_EQ(after(i, v), before(i, v)) << i;
  }
  bool changed = false;
  for (int v = 0; v < 7; ++v) changed = changed || after(5, v) != before(5, v);
  EXPECT_TRUE(changed);
}

TEST(Transformer, AttentionWeightsAreCausalDistributions) {
  Transformer<float> model({.vocab_size = 7, .context = 6, .embed_dim = 8, .num_heads = 2,
                            .num_layers = 2});
  Rng rng(3);
  model.reset_parameters(rng);
  const std::vector<int32_t> ids = {1, 2, 3, 4};
  const Tensor<float, 4> w = model.attention_weights(ids, 1);
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 4; ++i) {
      float sum = 0;
      for (int j = 0; j < 4; ++j) {
        if (j > i) {
          EXPECT_EQ(w(0, h, i, j), 0.0f);
        }
        sum += w(0, h, i, j);
      }
      EXPECT_NEAR(sum, 1.0f, 1e-6f);
    }
  }
  // The training activations are gone: a backward now would be wrong, so it throws.
  EXPECT_THROW(model.backward(), Error);
  EXPECT_THROW(model.attention_weights(ids, 2), Error);
}

TEST(Transformer, RejectsBadInputs) {
  EXPECT_THROW(Transformer<float>({.vocab_size = 5, .context = 4, .embed_dim = 6, .num_heads = 4,
                                   .num_layers = 1}),
               Error);
  Transformer<float> model({.vocab_size = 5, .context = 4, .embed_dim = 8, .num_heads = 2,
                            .num_layers = 1});
  const std::vector<int32_t> ids = {0, 1, 2, 3, 4};
  EXPECT_THROW(model.forward(ids, 1, 5), Error);  // longer than the context
  EXPECT_THROW(model.forward(ids, 2, 2), Error);  // ids.size() ≠ batch·seq
  const std::vector<int32_t> bad = {0, 9};
  EXPECT_THROW(model.forward(bad, 1, 2), Error);  // id outside the vocabulary
}

}  // namespace
}  // namespace qkv::nn
