// Modifiers' numerics: the reference's explicit-Jacobian backward through score_mod's
// derivative against finite differences, generic mods evaluated in double, and what
// non-finite mod results reach.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "finite_difference.hpp"
#include "modifier_check.hpp"

namespace qkv {
namespace {

using test::Case;
using test::CaseSpec;
using namespace test::modifiers;

// ---------------------------------------------------------------------------------------
// The reference as the oracle: its explicit-Jacobian backward (through the mod's
// derivative) against central differences of its own fp64 forward, the mods evaluated
// in double (`auto` score).
TEST(ModifierGradients, ReferenceBackwardMatchesFiniteDifferences) {
  const CaseSpec spec{.name = "fd", .batch = 2, .q_len = 4, .k_len = 6, .q_heads = 2,
                      .kv_heads = 1, .head_dim = 3, .v_dim = 2, .causal = Causal::bottom_right};
  Case<double> c(spec, 5);
  const std::vector<double> table{0.3, -0.2, 0.5, 0.1, -0.7, 0.4, 0.2, 0.0, -0.1, 0.6, 0.25};
  const double* bias = table.data();
  const auto mod = score_mod(
      [bias](auto s, int64_t b, int64_t h, int64_t i, int64_t j) {
        const double gain = 1.0 + 0.5 * static_cast<double>(h) - 0.25 * static_cast<double>(b);
        return 2.0 * std::tanh(gain * s / 2.0) + bias[i - j + 6];
      },
      [](auto s, int64_t b, int64_t h, int64_t, int64_t) {
        const double gain = 1.0 + 0.5 * static_cast<double>(h) - 0.25 * static_cast<double>(b);
        const double t = std::tanh(gain * s / 2.0);
        return gain * (1.0 - t * t);
      });
  const auto mask = mask_mod([](int64_t b, int64_t h, int64_t i, int64_t j) { return (i + j + b + h) % 3 != 1 || j == 0; });
  c.options.modifiers = {.score = mod, .mask = mask};
  c.options.execution.backend = Backend::reference;
  const auto dout = test::random_tensor<double, 4>({2, 4, 2, 2}, 6);
  Tensor<double, 4> out({2, 4, 2, 2}), dq(c.q.shape()), dk(c.k.shape()), dv(c.v.shape());
  Tensor<double, 3> lse({2, 2, 4});
  attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.view(),
                     .lse = lse.view()}, c.options);
  attention_backward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.cview(),
                      .lse = lse.cview(), .dout = dout.cview(), .dq = dq.view(), .dk = dk.view(),
                      .dv = dv.view()}, c.options);
  auto loss = [&] { return test::weighted_output(c, dout); };
  test::expect_gradient_matches(c.q, dq, 1e-6, 1e-7, loss, "dq");
  test::expect_gradient_matches(c.k, dk, 1e-6, 1e-7, loss, "dk");
  test::expect_gradient_matches(c.v, dv, 1e-6, 1e-7, loss, "dv");
  // The check has something to check.
  EXPECT_GT(std::max({test::max_abs(dq), test::max_abs(dk), test::max_abs(dv)}), 1e-2);
}

// A generic (`auto`) score_mod runs in double on the reference: adding 1e-10 to every
// logit moves the LSE by exactly that (a float evaluation would lose it).
TEST(ModifierGradients, ReferenceEvaluatesGenericModsInDouble) {
  const CaseSpec spec{.name = "fp64", .q_len = 3, .k_len = 5};
  Case<double> c(spec, 7);
  c.options.execution.backend = Backend::reference;
  Tensor<double, 4> out({1, 3, 1, 4});
  Tensor<double, 3> plain({1, 1, 3}), shifted({1, 1, 3});
  attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.view(),
                     .lse = plain.view()}, c.options);
  const auto shift = score_mod([](auto s, int64_t, int64_t, int64_t, int64_t) { return s + 1e-10; });
  c.options.modifiers.score = shift;
  attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.view(),
                     .lse = shifted.view()}, c.options);
  for (int64_t i = 0; i < 3; ++i) EXPECT_NEAR(shifted(0, 0, i) - plain(0, 0, i), 1e-10, 1e-14);
}

// ---------------------------------------------------------------------------------------
// Non-finite mod results.

// A NaN from score_mod poisons its query row only, on both backends; mask_mod's removed
// pairs never reach the row even when score_mod gives NaN there.
TEST(ModifierNumerics, NaNFromScoreModPoisonsOnlyItsRow) {
  const auto poison = score_mod([](float s, int64_t, int64_t h, int64_t i, int64_t j) {
    if (h == 1 && i == 70 && j == 3) return std::numeric_limits<float>::quiet_NaN();
    if (j == 100) return std::numeric_limits<float>::quiet_NaN();  // removed by the mask
    return s;
  });
  const auto no_key_100 = mask_mod([](int64_t, int64_t, int64_t, int64_t j) { return j != 100; },
                                   {.varies_with_head = false});
  Case<float> c(kShape, 19);
  c.options.modifiers = {.score = poison, .mask = no_key_100};
  const test::Results cpu = test::run_cpu(c, {kShape}, nullptr);
  const test::Reference ref = test::run_reference(c, nullptr);
  for (int64_t b = 0; b < kShape.batch; ++b)
    for (int64_t i = 0; i < kShape.q_len; ++i)
      for (int64_t h = 0; h < kShape.q_heads; ++h) {
        const bool poisoned = h == 1 && i == 70;
        EXPECT_EQ(std::isnan(cpu.lse(b, h, i)), poisoned) << b << " " << h << " " << i;
        EXPECT_EQ(std::isnan(ref.lse(b, h, i)), poisoned);
        for (int64_t x = 0; x < kShape.v_dim; ++x) {
          EXPECT_EQ(std::isnan(cpu.out(b, i, h, x)), poisoned);
          if (!poisoned) {
            EXPECT_NEAR(cpu.out(b, i, h, x), ref.out(b, i, h, x), 4e-6);
          }
        }
      }
}

// A row that mask_mod empties entirely: out 0, lse −inf, zero gradients, never NaN.
TEST(ModifierNumerics, RowsEmptiedByMaskModAreZero) {
  const auto odd_rows_see_nothing = mask_mod([](int64_t, int64_t, int64_t i, int64_t) { return i % 2 == 0; });
  Case<float> c(kShape, 20);
  c.options.modifiers.mask = odd_rows_see_nothing;
  const test::Results cpu = run(c);
  for (int64_t b = 0; b < kShape.batch; ++b)
    for (int64_t i = 1; i < kShape.q_len; i += 2)
      for (int64_t h = 0; h < kShape.q_heads; ++h) {
        EXPECT_EQ(cpu.lse(b, h, i), -std::numeric_limits<float>::infinity());
        for (int64_t x = 0; x < kShape.v_dim; ++x) EXPECT_EQ(cpu.out(b, i, h, x), 0.0f);
        for (int64_t x = 0; x < kShape.head_dim; ++x) EXPECT_EQ(cpu.dq(b, i, h, x), 0.0f);
      }
  EXPECT_TRUE(test::all_finite(cpu.dk) && test::all_finite(cpu.dv));
  expect_near_reference(c);
}

}  // namespace
}  // namespace qkv
