// The reference backward (explicit Jacobian) against central finite differences of the
// reference forward, in double, for every option; and the zero-gradient contract for
// fully masked rows.
#include <gtest/gtest.h>

#include <cmath>

#include "attention_cases.hpp"
#include "finite_difference.hpp"

namespace qkv {
namespace {

using test::Case;
using test::CaseSpec;

// Central differences: error h²/6·|L'''| + ε·|L|/h. With h = 1e-5, |L| ≲ 10 and smooth
// L (third derivatives ≲ 10): ≈ 2e-10 + 2e-10. The tolerance, 1e-8, leaves 25× margin and is
// still ~1e6 times smaller than a wrong-term error (gradients are O(0.1–1)).
constexpr double kStep = 1e-5;
constexpr double kTolerance = 1e-8;

// L = Σ out ⊙ g (test::weighted_output) for a fixed random g.
void expect_gradient_matches(Case<double>& c, Tensor<double, 4>& input,
                             const Tensor<double, 4>& analytic, const Tensor<double, 4>& g,
                             const char* name) {
  const auto loss = [&] { return test::weighted_output(c, g); };
  test::expect_gradient_matches(input, analytic, kStep, kTolerance, loss, name);
}

class ReferenceBackward : public ::testing::TestWithParam<CaseSpec> {};

TEST_P(ReferenceBackward, MatchesFiniteDifferences) {
  Case<double> c(GetParam());
  const CaseSpec& s = c.spec;
  const auto g = test::random_tensor<double, 4>({s.batch, s.q_len, s.q_heads, s.v_dim}, 77);
  Tensor<double, 4> out(g.shape());
  Tensor<double, 3> lse({s.batch, s.q_heads, s.q_len});
  attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.view(),
                     .lse = lse.view()},
                    c.options);
  Tensor<double, 4> dq(c.q.shape()), dk(c.k.shape()), dv(c.v.shape());
  attention_backward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.cview(),
                      .lse = lse.cview(), .dout = g.cview(), .dq = dq.view(), .dk = dk.view(),
                      .dv = dv.view()},
                     c.options);
  EXPECT_TRUE(test::all_finite(dq) && test::all_finite(dk) && test::all_finite(dv));
  expect_gradient_matches(c, c.q, dq, g, "dq");
  expect_gradient_matches(c, c.k, dk, g, "dk");
  expect_gradient_matches(c, c.v, dv, g, "dv");
}

INSTANTIATE_TEST_SUITE_P(Cases, ReferenceBackward, ::testing::ValuesIn(test::small_cases()),
                         [](const auto& param_info) { return param_info.param.name; });

TEST(ReferenceBackwardNumerics, FullyMaskedRowsGiveZeroGradients) {
  // Batch 1 has no valid keys at all; in batch 0 the bias removes every key of row 2.
  CaseSpec spec{.name = "masked", .batch = 2, .q_len = 3, .k_len = 3, .key_padding = true};
  Case<double> c(spec);
  c.key_lengths = {3, 0};
  c.options.key_lengths = c.key_lengths;
  Tensor<float, 4> bias({1, 1, 3, 3});
  for (int64_t j = 0; j < 3; ++j) bias(0, 0, 2, j) = -INFINITY;
  c.options.mask.bias = bias.cview();

  const auto g = test::random_tensor<double, 4>({2, 3, 1, 4}, 5);
  Tensor<double, 4> out(g.shape());
  Tensor<double, 3> lse({2, 1, 3});
  attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.view(),
                     .lse = lse.view()},
                    c.options);
  Tensor<double, 4> dq(c.q.shape()), dk(c.k.shape()), dv(c.v.shape());
  test::fill(dq, 9.0);  // written, not accumulated: the 9s must go
  attention_backward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.cview(),
                      .lse = lse.cview(), .dout = g.cview(), .dq = dq.view(), .dk = dk.view(),
                      .dv = dv.view()},
                     c.options);
  for (int64_t c_ = 0; c_ < 4; ++c_) {
    EXPECT_EQ(dq(0, 2, 0, c_), 0.0);
    for (int64_t i = 0; i < 3; ++i) {
      EXPECT_EQ(dq(1, i, 0, c_), 0.0);
      EXPECT_EQ(dk(1, i, 0, c_), 0.0);
      EXPECT_EQ(dv(1, i, 0, c_), 0.0);
    }
    EXPECT_NE(dq(0, 0, 0, c_), 0.0);
  }
  EXPECT_TRUE(test::all_finite(dq) && test::all_finite(dk) && test::all_finite(dv));
}

TEST(ReferenceBackwardNumerics, HugeLogitsGiveFiniteVanishingGradients) {
  // Saturated softmax: J(P) = 0, so dQ and dK vanish while dV still routes dO.
  Tensor<float, 4> q({1, 1, 1, 512}), k({1, 2, 1, 512}), v({1, 2, 1, 512});
  for (int64_t c = 0; c < 512; ++c) {
    q(0, 0, 0, c) = 1000.0f;
    k(0, 0, 0, c) = 1000.0f;
    k(0, 1, 0, c) = -1000.0f;
    v(0, 0, 0, c) = 1.0f;
  }
  Tensor<float, 4> out({1, 1, 1, 512}), dout({1, 1, 1, 512});
  Tensor<float, 3> lse({1, 1, 1});
  test::fill(dout, 1.0f);
  AttentionOptions options;
  options.scale = 1.0;
  attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                     .lse = lse.view()},
                    options);
  Tensor<float, 4> dq(q.shape()), dk(k.shape()), dv(v.shape());
  attention_backward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.cview(),
                      .lse = lse.cview(), .dout = dout.cview(), .dq = dq.view(), .dk = dk.view(),
                      .dv = dv.view()},
                     options);
  for (int64_t c = 0; c < 512; ++c) {
    EXPECT_EQ(dq(0, 0, 0, c), 0.0f);
    EXPECT_EQ(dk(0, 0, 0, c), 0.0f);
    EXPECT_EQ(dv(0, 0, 0, c), 1.0f);
    EXPECT_EQ(dv(0, 1, 0, c), 0.0f);
  }
}

}  // namespace
}  // namespace qkv
