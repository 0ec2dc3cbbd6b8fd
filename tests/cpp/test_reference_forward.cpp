// The reference forward against a second, independent reading of the definitions (long
// double, a dense visibility matrix built from each rule as documented), and the
// numerics contract of DESIGN.md §3.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "attention_cases.hpp"

namespace qkv {
namespace {

using test::Case;
using test::CaseSpec;

// Is key j visible to query (b, h, i)? Straight from the documentation of each option.
bool visible(const Case<double>& c, int64_t b, int64_t h, int64_t i, int64_t j) {
  const CaseSpec& s = c.spec;
  const int64_t valid = s.key_padding ? c.key_lengths[b] : s.k_len;
  if (j >= valid) return false;
  if (s.causal == Causal::top_left && j > i) return false;
  if (s.causal == Causal::bottom_right && j > i + (valid - s.q_len)) return false;
  if (s.keep_mask && c.keep(b, 0, i, j) == 0) return false;
  if (s.bias_mask && c.bias(0, h, i, j) == -INFINITY) return false;
  return true;
}

// out and lse by the definition, in long double.
void brute_force(const Case<double>& c, Tensor<double, 4>& out, Tensor<double, 3>& lse) {
  const CaseSpec& s = c.spec;
  const long double scale = s.scale ? *s.scale : 1.0L / std::sqrt(static_cast<long double>(s.head_dim));
  const int64_t group = s.q_heads / s.kv_heads;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.q_heads; ++h)
      for (int64_t i = 0; i < s.q_len; ++i) {
        std::vector<long double> logit(s.k_len, 0.0L);
        long double max = -INFINITY;
        for (int64_t j = 0; j < s.k_len; ++j) {
          if (!visible(c, b, h, i, j)) continue;
          long double dot = 0.0L;
          for (int64_t x = 0; x < s.head_dim; ++x) dot += c.q(b, i, h, x) * static_cast<long double>(c.k(b, j, h / group, x));
          logit[j] = scale * dot + (s.bias_mask ? c.bias(0, h, i, j) : 0.0f);
          max = std::max(max, logit[j]);
        }
        long double sum = 0.0L;
        for (int64_t j = 0; j < s.k_len; ++j)
          if (visible(c, b, h, i, j)) sum += std::exp(logit[j] - max);
        for (int64_t x = 0; x < s.v_dim; ++x) {
          long double acc = 0.0L;
          for (int64_t j = 0; j < s.k_len; ++j)
            if (visible(c, b, h, i, j)) acc += std::exp(logit[j] - max) / sum * c.v(b, j, h / group, x);
          out(b, i, h, x) = sum == 0.0L ? 0.0 : static_cast<double>(acc);
        }
        lse(b, h, i) = sum == 0.0L ? -INFINITY : static_cast<double>(max + std::log(sum));
      }
}

class ReferenceForward : public ::testing::TestWithParam<CaseSpec> {};

TEST_P(ReferenceForward, MatchesDefinition) {
  const Case<double> c(GetParam());
  const CaseSpec& s = c.spec;
  Tensor<double, 4> out({s.batch, s.q_len, s.q_heads, s.v_dim}), expected(out.shape());
  Tensor<double, 3> lse({s.batch, s.q_heads, s.q_len}), expected_lse(lse.shape());
  Tensor<double, 4> weights({s.batch, s.q_heads, s.q_len, s.k_len});
  attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.view(),
                     .lse = lse.view(), .weights = weights.view()},
                    c.options);
  brute_force(c, expected, expected_lse);
  // Both sides accumulate at least in double over ≤ 5 terms of magnitude ≲ 10: 1e-13 is
  // a hundred times the rounding of either.
  EXPECT_LE(test::max_abs_diff(out, expected), 1e-13);
  for (std::size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(expected_lse[i])) {
      EXPECT_EQ(lse[i], expected_lse[i]);
    } else {
      EXPECT_NEAR(lse[i], expected_lse[i], 1e-13);
    }
  }
  // Weights: rows sum to 1 (or 0 when fully masked); removed keys weigh exactly 0.
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.q_heads; ++h)
      for (int64_t i = 0; i < s.q_len; ++i) {
        double sum = 0.0;
        bool any = false;
        for (int64_t j = 0; j < s.k_len; ++j) {
          if (!visible(c, b, h, i, j)) {
            EXPECT_EQ(weights(b, h, i, j), 0.0);
          }
          any = any || visible(c, b, h, i, j);
          sum += weights(b, h, i, j);
        }
        EXPECT_NEAR(sum, any ? 1.0 : 0.0, 1e-15 * static_cast<double>(s.k_len));
      }
}

TEST_P(ReferenceForward, FloatMatchesDoubleToFloatRounding) {
  const Case<double> c(GetParam());
  const CaseSpec& s = c.spec;
  // The same inputs rounded to float.
  Tensor<float, 4> qf(c.q.shape()), kf(c.k.shape()), vf(c.v.shape());
  for (std::size_t i = 0; i < qf.size(); ++i) qf[i] = static_cast<float>(c.q[i]);
  for (std::size_t i = 0; i < kf.size(); ++i) kf[i] = static_cast<float>(c.k[i]);
  for (std::size_t i = 0; i < vf.size(); ++i) vf[i] = static_cast<float>(c.v[i]);
  Tensor<double, 4> q64(c.q.shape()), k64(c.k.shape()), v64(c.v.shape());
  for (std::size_t i = 0; i < qf.size(); ++i) q64[i] = qf[i];
  for (std::size_t i = 0; i < kf.size(); ++i) k64[i] = kf[i];
  for (std::size_t i = 0; i < vf.size(); ++i) v64[i] = vf[i];
  Tensor<float, 4> out32({s.batch, s.q_len, s.q_heads, s.v_dim});
  Tensor<double, 4> out64(out32.shape());
  attention_forward({.q = qf.cview(), .k = kf.cview(), .v = vf.cview(), .out = out32.view()},
                    c.options);
  attention_forward({.q = q64.cview(), .k = k64.cview(), .v = v64.cview(), .out = out64.view()},
                    c.options);
  // The float path computes in double and rounds once: within half an ulp of |out| ≲ 4.
  EXPECT_LE(test::max_abs_diff(out32, out64), 4.0 * std::numeric_limits<float>::epsilon());
}

INSTANTIATE_TEST_SUITE_P(Cases, ReferenceForward, ::testing::ValuesIn(test::small_cases()),
                         [](const auto& param_info) { return param_info.param.name; });

TEST(ReferenceForwardLayout, TorchStridesGiveTheSameResult) {
  const CaseSpec spec{.name = "layout", .batch = 2, .q_len = 5, .k_len = 6, .q_heads = 4,
                      .kv_heads = 2, .head_dim = 7, .v_dim = 3, .causal = Causal::top_left};
  const Case<float> c(spec);
  Tensor<float, 4> out({2, 5, 4, 3});
  attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.view()},
                    c.options);
  auto q = test::to_bhsd(c.q), k = test::to_bhsd(c.k), v = test::to_bhsd(c.v);
  Tensor<float, 4> out_bhsd({2, 4, 5, 3});
  attention_forward({.q = test::bhsd_view(q), .k = test::bhsd_view(k), .v = test::bhsd_view(v),
                     .out = test::bhsd_view(out_bhsd)},
                    c.options);
  EXPECT_EQ(test::max_abs_diff(test::to_bhsd(out), out_bhsd), 0.0);
}

TEST(ReferenceForwardLayout, NonContiguousBatchIsRead) {
  // q lives in every other batch slot of a larger buffer: batch stride doubled.
  auto big = test::random_tensor<float, 4>({4, 3, 2, 5}, 9);
  const auto k = test::random_tensor<float, 4>({2, 3, 2, 5}, 10);
  const auto v = test::random_tensor<float, 4>({2, 3, 2, 5}, 11);
  View4<const float> q_strided(big.data(), {2, 3, 2, 5}, {2 * 30, 10, 5, 1});
  Tensor<float, 4> q_copy({2, 3, 2, 5});
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < 30; ++i) q_copy[b * 30 + i] = big[2 * b * 30 + i];
  Tensor<float, 4> a({2, 3, 2, 5}), b({2, 3, 2, 5});
  attention_forward({.q = q_strided, .k = k.cview(), .v = v.cview(), .out = a.view()});
  attention_forward({.q = q_copy.cview(), .k = k.cview(), .v = v.cview(), .out = b.view()});
  EXPECT_EQ(test::max_abs_diff(a, b), 0.0);
}

// DESIGN.md §3: a query row whose keys are all masked gives output 0 and LSE -inf.
TEST(ReferenceNumerics, FullyMaskedRowIsZeroWithMinusInfLse) {
  const auto q = test::random_tensor<float, 4>({2, 3, 1, 4}, 1);
  const auto k = test::random_tensor<float, 4>({2, 3, 1, 4}, 2);
  const auto v = test::random_tensor<float, 4>({2, 3, 1, 4}, 3);
  Tensor<std::uint8_t, 4> keep({1, 1, 3, 3});
  for (std::size_t i = 0; i < keep.size(); ++i) keep[i] = 1;
  for (int64_t j = 0; j < 3; ++j) keep(0, 0, 1, j) = 0;  // row 1 sees nothing
  const std::vector<int64_t> lengths{3, 0};               // batch 1 has no valid keys
  AttentionOptions options;
  options.mask.keep = keep.cview();
  options.key_lengths = lengths;
  Tensor<float, 4> out({2, 3, 1, 4});
  Tensor<float, 3> lse({2, 1, 3});
  attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                     .lse = lse.view()},
                    options);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < 3; ++i) {
      const bool masked = b == 1 || i == 1;
      for (int64_t c = 0; c < 4; ++c) {
        if (masked) {
          EXPECT_EQ(out(b, i, 0, c), 0.0f);
        }
        EXPECT_TRUE(std::isfinite(out(b, i, 0, c)));
      }
      if (masked) {
        EXPECT_EQ(lse(b, 0, i), -INFINITY);
      } else {
        EXPECT_TRUE(std::isfinite(lse(b, 0, i)));
      }
    }
}

TEST(ReferenceNumerics, EmptyKeySequenceIsFullyMasked) {
  Tensor<float, 4> q({1, 2, 1, 3}), k({1, 0, 1, 3}), v({1, 0, 1, 3}), out({1, 2, 1, 3});
  Tensor<float, 3> lse({1, 1, 2});
  test::fill(out, 5.0f);
  attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                     .lse = lse.view()});
  for (std::size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i], 0.0f);
  for (std::size_t i = 0; i < lse.size(); ++i) EXPECT_EQ(lse[i], -INFINITY);
}

TEST(ReferenceNumerics, HugeLogitsAndLargeHeadDimStayFinite) {
  // Logits of order 1e6: q = 1000·e, keys of norm 1000 along different axes.
  for (int64_t d : {64, 512}) {
    Tensor<float, 4> q({1, 2, 1, d}), k({1, 3, 1, d}), v({1, 3, 1, d}), out({1, 2, 1, d});
    Tensor<float, 3> lse({1, 1, 2});
    for (int64_t c = 0; c < d; ++c) {
      q(0, 0, 0, c) = 1000.0f;
      q(0, 1, 0, c) = c % 2 ? 1000.0f : -1000.0f;
      k(0, 0, 0, c) = 1000.0f;
      k(0, 1, 0, c) = -1000.0f;
      k(0, 2, 0, c) = c % 2 ? 1000.0f : -1000.0f;
      for (int64_t j = 0; j < 3; ++j) v(0, j, 0, c) = static_cast<float>(j + 1);
    }
    AttentionOptions options;
    options.scale = 1.0;  // unscaled: logits of ±1e6·d
    attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                       .lse = lse.view()},
                      options);
    EXPECT_TRUE(test::all_finite(out)) << "d = " << d;
    EXPECT_TRUE(test::all_finite(lse)) << "d = " << d;
    // Saturated: each query picks the one key aligned with it.
    for (int64_t c = 0; c < d; ++c) {
      EXPECT_EQ(out(0, 0, 0, c), 1.0f);
      EXPECT_EQ(out(0, 1, 0, c), 3.0f);
    }
    EXPECT_FLOAT_EQ(lse(0, 0, 0), 1e6f * static_cast<float>(d));
  }
}

TEST(ReferenceNumerics, NaNPropagatesOnlyToRowsItTouches) {
  auto q = test::random_tensor<float, 4>({1, 3, 2, 4}, 1);
  auto k = test::random_tensor<float, 4>({1, 3, 2, 4}, 2);
  const auto v = test::random_tensor<float, 4>({1, 3, 2, 4}, 3);
  q(0, 1, 0, 2) = std::nanf("");  // query row 1 of head 0
  Tensor<float, 4> out({1, 3, 2, 4});
  attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view()});
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t c = 0; c < 4; ++c)
        EXPECT_EQ(std::isnan(out(0, i, h, c)), i == 1 && h == 0) << i << " " << h << " " << c;

  // A NaN key that causality hides from row 0 does not reach row 0.
  auto q2 = test::random_tensor<float, 4>({1, 3, 1, 4}, 4);
  auto k2 = test::random_tensor<float, 4>({1, 3, 1, 4}, 5);
  auto v2 = test::random_tensor<float, 4>({1, 3, 1, 4}, 6);
  k2(0, 2, 0, 0) = std::nanf("");
  v2(0, 2, 0, 1) = INFINITY;
  AttentionOptions causal;
  causal.causal = Causal::top_left;
  Tensor<float, 4> out2({1, 3, 1, 4});
  attention_forward({.q = q2.cview(), .k = k2.cview(), .v = v2.cview(), .out = out2.view()},
                    causal);
  for (int64_t c = 0; c < 4; ++c) {
    EXPECT_TRUE(std::isfinite(out2(0, 0, 0, c)));
    EXPECT_TRUE(std::isfinite(out2(0, 1, 0, c)));
    EXPECT_TRUE(std::isnan(out2(0, 2, 0, c)));
  }
}

TEST(ReferenceNumerics, CheckFiniteNamesTheFirstBadElement) {
  auto q = test::random_tensor<float, 4>({1, 3, 2, 4}, 1);
  const auto k = test::random_tensor<float, 4>({1, 3, 2, 4}, 2);
  auto v = test::random_tensor<float, 4>({1, 3, 2, 4}, 3);
  v(0, 2, 1, 3) = -INFINITY;
  Tensor<float, 4> out({1, 3, 2, 4});
  AttentionOptions options;
  options.execution.check_finite = true;
  try {
    attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view()},
                      options);
    FAIL() << "expected qkv::Error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "qkv::attention_forward: check_finite: v[0, 2, 1, 3] is -inf");
  }
}

}  // namespace
}  // namespace qkv
