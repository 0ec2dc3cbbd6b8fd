// MultiHeadAttention: forward against a naive double implementation written here from
// the formulas, every input and parameter gradient against finite differences, for
// self-attention (causal), cross-attention with GQA/kdim/vdim/masks/padding, and MQA.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "nn_test_support.hpp"
#include "qkv/error.hpp"
#include "qkv/nn/multihead_attention.hpp"

namespace qkv::nn {
namespace {

using Tensor3 = Tensor<double, 3>;

struct Case {
  const char* name;
  MultiHeadAttentionConfig config;
  int64_t batch, q_len, k_len;
  bool self;            // query = key = value
  bool keep_mask;       // a boolean mask [B, 1, Nq, Nk]
  bool bias_mask;       // an additive mask [1, H, 1, Nk]
  bool key_lengths;     // per-batch key padding
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// y = x·Wᵀ + b over rows.
std::vector<double> project(const Linear<double>& linear, const Tensor3& x) {
  const int64_t rows = x.shape()[0] * x.shape()[1], in = x.shape()[2];
  const int64_t out = linear.out_features();
  std::vector<double> y(static_cast<std::size_t>(rows * out));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double sum = linear.has_bias() ? linear.bias.value[o] : 0.0;
      for (int64_t i = 0; i < in; ++i) sum += x[r * in + i] * linear.weight.value[o * in + i];
      y[r * out + o] = sum;
    }
  }
  return y;
}

// softmax(Q·Kᵀ/√d + mask)·V per head, then the output projection; also returns P.
struct Naive {
  std::vector<double> out, weights;  // out [B, Nq, E], weights [B, H, Nq, Nk]
};

Naive naive_attention(const MultiHeadAttention<double>& mha, const Tensor3& query,
                      const Tensor3& key, const Tensor3& value, const Case& c,
                      const Tensor<std::uint8_t, 4>& keep, const Tensor<float, 4>& bias,
                      const std::vector<int64_t>& lengths) {
  const auto& cfg = mha.config();
  const int64_t B = c.batch, Nq = c.q_len, Nk = c.k_len, H = cfg.num_heads;
  const int64_t Hkv = cfg.num_kv_heads, d = mha.head_dim(), E = cfg.embed_dim;
  const auto q = project(mha.q_proj, query), k = project(mha.k_proj, key), v = project(mha.v_proj, value);
  std::vector<double> context(static_cast<std::size_t>(B * Nq * H * d), 0.0);
  Naive result;
  result.weights.assign(static_cast<std::size_t>(B * H * Nq * Nk), 0.0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / Hkv);
      for (int64_t i = 0; i < Nq; ++i) {
        std::vector<double> s(static_cast<std::size_t>(Nk), -std::numeric_limits<double>::infinity());
        double max = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < Nk; ++j) {
          if (cfg.causal == Causal::top_left && j > i) continue;
          if (c.key_lengths && j >= lengths[b]) continue;
          if (c.keep_mask && keep(b, 0, i, j) == 0) continue;
          double dot = 0;
          for (int64_t e = 0; e < d; ++e) dot += q[((b * Nq + i) * H + h) * d + e] * k[((b * Nk + j) * Hkv + g) * d + e];
          s[j] = dot / std::sqrt(static_cast<double>(d)) + (c.bias_mask ? bias(0, h, 0, j) : 0.0f);
          max = std::max(max, s[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j < Nk; ++j) sum += std::isinf(s[j]) ? 0.0 : std::exp(s[j] - max);
        for (int64_t j = 0; j < Nk; ++j) {
          const double p = std::isinf(s[j]) ? 0.0 : std::exp(s[j] - max) / sum;
          result.weights[((b * H + h) * Nq + i) * Nk + j] = p;
          for (int64_t e = 0; e < d; ++e) context[((b * Nq + i) * H + h) * d + e] += p * v[((b * Nk + j) * Hkv + g) * d + e];
        }
      }
    }
  }
  Tensor3 context_tensor({B, Nq, H * d});
  std::copy(context.begin(), context.end(), context_tensor.data());
  result.out = project(mha.out_proj, context_tensor);
  EXPECT_EQ(static_cast<int64_t>(result.out.size()), B * Nq * E);
  return result;
}

class MultiHeadAttentionCases : public ::testing::TestWithParam<Case> {};

TEST_P(MultiHeadAttentionCases, ForwardMatchesNaiveAndGradientsMatchFiniteDifferences) {
  const Case c = GetParam();
  Rng rng(7);
  MultiHeadAttention<double> mha(c.config);
  mha.reset_parameters(rng);
  // Non-zero biases, so their gradients and the forward's use of them are exercised.
  for (Linear<double>* p : {&mha.q_proj, &mha.k_proj, &mha.v_proj, &mha.out_proj}) {
    if (p->has_bias()) testing::fill(p->bias.values(), rng, 0.5);
  }
  const auto& cfg = mha.config();
  const int64_t E = cfg.embed_dim, B = c.batch, Nq = c.q_len, Nk = c.k_len;
  Tensor3 query({B, Nq, E}), key({B, Nk, cfg.key_dim}), value({B, Nk, cfg.value_dim});
  testing::fill(query, rng);
  testing::fill(key, rng);
  testing::fill(value, rng);

  Tensor<std::uint8_t, 4> keep({B, 1, Nq, Nk});
  for (std::size_t i = 0; i < keep.size(); ++i) keep[i] = rng.uniform() < 0.7 ? 1 : 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < Nq; ++i) keep(b, 0, i, 0) = 1;  // no row fully masked
  }
  Tensor<float, 4> bias({1, cfg.num_heads, 1, Nk});
  testing::fill(bias, rng);
  const std::vector<int64_t> lengths = {Nk, Nk - 2};
  AttentionMasking masking;
  if (c.keep_mask) masking.mask.keep = keep.cview();
  if (c.bias_mask) masking.mask.bias = bias.cview();
  if (c.key_lengths) masking.key_lengths = lengths;

  // Forward, with the weights, against the naive implementation.
  Tensor3 out({B, Nq, E});
  MultiHeadAttentionSaved<double> saved;
  Tensor<double, 4> weights({B, cfg.num_heads, Nq, Nk});
  const Tensor3& k_in = c.self ? query : key;
  const Tensor3& v_in = c.self ? query : value;
  mha.forward(query.cview(), k_in.cview(), v_in.cview(), out.view(), saved, masking, weights.view());
  const Naive naive = naive_attention(mha, query, k_in, v_in, c, keep, bias, lengths);
  for (std::size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], naive.out[i], 1e-12) << i;
  for (std::size_t i = 0; i < weights.size(); ++i) ASSERT_NEAR(weights[i], naive.weights[i], 1e-13) << i;

  // Backward against finite differences of L = Σ w ⊙ out.
  Tensor3 w({B, Nq, E});
  testing::fill(w, rng);
  auto loss = [&] {
    MultiHeadAttentionSaved<double> scratch;
    mha.forward(query.cview(), (c.self ? query : key).cview(), (c.self ? query : value).cview(),
                out.view(), scratch, masking);
    return testing::weighted_sum({out.data(), out.size()}, {w.data(), w.size()});
  };
  ParameterList<double> list;
  mha.collect(list, "attn");
  zero_grad(list);
  mha.forward(query.cview(), k_in.cview(), v_in.cview(), out.view(), saved, masking);
  if (c.self) {
    Tensor3 dx({B, Nq, E});
    mha.backward(query.cview(), saved, w.cview(), dx.view());
    testing::expect_parameter_gradients(list, loss);
    testing::expect_gradient({query.data(), query.size()}, {dx.data(), dx.size()}, loss, "x");
  } else {
    Tensor3 dq({B, Nq, E}), dk({B, Nk, cfg.key_dim}), dv({B, Nk, cfg.value_dim});
    mha.backward(query.cview(), key.cview(), value.cview(), saved, w.cview(),
                 {.query = dq.view(), .key = dk.view(), .value = dv.view()});
    testing::expect_parameter_gradients(list, loss);
    testing::expect_gradient({query.data(), query.size()}, {dq.data(), dq.size()}, loss, "query");
    testing::expect_gradient({key.data(), key.size()}, {dk.data(), dk.size()}, loss, "key");
    testing::expect_gradient({value.data(), value.size()}, {dv.data(), dv.size()}, loss, "value");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Configurations, MultiHeadAttentionCases,
    ::testing::Values(
        Case{"SelfCausal", {.embed_dim = 8, .num_heads = 2, .causal = Causal::top_left}, 2, 5, 5,
             true, false, false, false},
        Case{"CrossGqaKdimVdimMaskedPadded",
             {.embed_dim = 8, .num_heads = 4, .num_kv_heads = 2, .key_dim = 5, .value_dim = 3},
             2, 4, 6, false, true, false, true},
        Case{"CrossMqaNoBiasAdditiveMask",
             {.embed_dim = 6, .num_heads = 3, .num_kv_heads = 1, .bias = false}, 2, 3, 4, false,
             false, true, false},
        Case{"SelfGqaCausalPadded",
             {.embed_dim = 12, .num_heads = 4, .num_kv_heads = 2, .causal = Causal::top_left},
             2, 6, 6, true, false, true, true}),
    [](const ::testing::TestParamInfo<Case>& param_info) { return std::string(param_info.param.name); });

TEST(MultiHeadAttention, InitIsXavierForInputProjectionsAndZeroBiases) {
  Rng rng(3);
  MultiHeadAttention<float> mha({.embed_dim = 64, .num_heads = 4, .key_dim = 32});
  mha.reset_parameters(rng);
  const double q_bound = std::sqrt(6.0 / (64 + 64)), k_bound = std::sqrt(6.0 / (32 + 64));
  for (float x : mha.q_proj.weight.values()) ASSERT_LE(std::fabs(x), q_bound);
  for (float x : mha.k_proj.weight.values()) ASSERT_LE(std::fabs(x), k_bound);
  double k_max = 0;
  for (float x : mha.k_proj.weight.values()) k_max = std::max(k_max, static_cast<double>(std::fabs(x)));
  EXPECT_GT(k_max, 0.9 * k_bound);  // uses the whole range
  for (float x : mha.out_proj.weight.values()) ASSERT_LE(std::fabs(x), 1.0 / 8.0);
  for (const Linear<float>* p : {&mha.q_proj, &mha.k_proj, &mha.v_proj, &mha.out_proj}) {
    for (float b : p->bias.values()) ASSERT_EQ(b, 0.0f);
  }
}

TEST(MultiHeadAttention, RejectsBadConfigurationsAndShapes) {
  EXPECT_THROW(MultiHeadAttention<float>({.embed_dim = 10, .num_heads = 4}), Error);
  EXPECT_THROW(MultiHeadAttention<float>({.embed_dim = 12, .num_heads = 4, .num_kv_heads = 3}), Error);
  MultiHeadAttention<float> mha({.embed_dim = 8, .num_heads = 2});
  Tensor<float, 3> x({1, 3, 8}), out({1, 3, 8}), wrong({1, 3, 6});
  MultiHeadAttentionSaved<float> saved;
  try {
    mha.forward(wrong.cview(), out.view(), saved);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "qkv::nn::MultiHeadAttention::forward: query.shape[2] (features): expected 8, got 6");
  }
  Tensor<float, 3> dx({1, 3, 8});
  MultiHeadAttentionSaved<float> empty;
  EXPECT_THROW(mha.backward(x.cview(), empty, out.cview(), dx.view()), Error);
}

TEST(MultiHeadAttention, FloatAgreesWithDouble) {
  // The float layer (BLAS sgemm + the automatic attention backend) against the double
  // one on the same weights: each output is a few dot products of O(1) terms, so a
  // handful of float roundings, ~1e-6 relative; 1e-4 absolute leaves room and still
  // catches any layout or indexing error (those are O(1)).
  Rng rng(5);
  const MultiHeadAttentionConfig config{.embed_dim = 32, .num_heads = 4, .num_kv_heads = 2,
                                        .causal = Causal::top_left};
  MultiHeadAttention<double> reference(config);
  reference.reset_parameters(rng);
  MultiHeadAttention<float> fast(config);
  ParameterList<double> dl;
  ParameterList<float> fl;
  reference.collect(dl, "a");
  fast.collect(fl, "a");
  for (std::size_t i = 0; i < dl.size(); ++i) {
    testing::fill(dl[i].parameter->values(), rng, 0.3);
    for (std::size_t j = 0; j < dl[i].parameter->value.size(); ++j) {
      fl[i].parameter->value[j] = static_cast<float>(dl[i].parameter->value[j]);
    }
  }
  Tensor<double, 3> xd({3, 17, 32}), outd({3, 17, 32}), dxd({3, 17, 32});
  Tensor<float, 3> xf({3, 17, 32}), outf({3, 17, 32}), dxf({3, 17, 32});
  testing::fill(xd, rng);
  for (std::size_t i = 0; i < xd.size(); ++i) xf[i] = static_cast<float>(xd[i]);
  MultiHeadAttentionSaved<double> sd;
  MultiHeadAttentionSaved<float> sf;
  reference.forward(xd.cview(), outd.view(), sd);
  fast.forward(xf.cview(), outf.view(), sf);
  for (std::size_t i = 0; i < outd.size(); ++i) ASSERT_NEAR(outf[i], outd[i], 1e-4) << i;
  reference.backward(xd.cview(), sd, outd.cview(), dxd.view());
  fast.backward(xf.cview(), sf, outf.cview(), dxf.view());
  for (std::size_t i = 0; i < dxd.size(); ++i) ASSERT_NEAR(dxf[i], dxd[i], 1e-4) << i;
  for (std::size_t p = 0; p < dl.size(); ++p) {
    for (std::size_t j = 0; j < dl[p].parameter->grad.size(); ++j) {
      ASSERT_NEAR(fl[p].parameter->grad[j], dl[p].parameter->grad[j], 1e-3) << dl[p].name << "[" << j << "]";
    }
  }
}

}  // namespace
}  // namespace qkv::nn
