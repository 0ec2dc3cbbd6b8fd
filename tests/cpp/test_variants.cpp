// Attention variants (sliding window, ALiBi, soft-cap, sinks, dropout), alone and
// combined with masks, GQA, key_lengths and varlen: the cpu kernels against the fp64
// reference; the reference's explicit-Jacobian backward against finite differences;
// window tiles skipped by the plan; dropout's statistics, determinism and errors.
//
// Tolerance, cpu vs reference: 4e-6·max(1, max|ref|) for outputs and LSE, 2e-5·max(1,
// max|ref|) for gradients. The fp32 kernels sum ≤ 200 terms blockwise (observed errors
// 1e-7 to 2e-6 on these O(1) values); a variant applied wrongly is off by O(0.1).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/dropout.hpp"
#include "core/tile_plan.hpp"
#include "cpu_check.hpp"
#include "finite_difference.hpp"

namespace qkv {
namespace {

using test::Case;
using test::CaseSpec;

struct Variant {
  std::string name;
  CaseSpec spec;
  Window window;
  bool alibi = false, sinks = false;
  float softcap = 0.0f, dropout = 0.0f;
};

std::ostream& operator<<(std::ostream& out, const Variant& v) { return out << v.name; }

// Inputs plus the variant's per-head arrays, with the options pointing at them.
struct VariantCase {
  Case<float> c;
  std::vector<float> slopes, sinks;

  explicit VariantCase(const Variant& v, std::uint64_t seed = 3) : c(v.spec, seed) {
    c.options.window = v.window;
    c.options.softcap = v.softcap;
    c.options.dropout = {.p = v.dropout, .seed = 1234, .offset = 7};
    for (int64_t h = 0; h < v.spec.q_heads; ++h) {
      slopes.push_back(std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(v.spec.q_heads)));
      sinks.push_back(0.5f * static_cast<float>(h) - 0.3f);
    }
    if (v.alibi) c.options.alibi_slopes = slopes;
    if (v.sinks) c.options.sinks = sinks;
  }
};

void expect_near_reference(const Variant& v, int threads) {
  VariantCase vc(v);
  const CaseSpec& s = v.spec;
  const auto dout = test::random_tensor<float, 4>({s.batch, s.q_len, s.q_heads, s.v_dim}, 4);
  std::vector<float> dsinks(static_cast<std::size_t>(s.q_heads)), dsinks_ref(dsinks.size());
  const test::Results cpu = test::run_cpu(vc.c, {s, false, false, threads}, &dout,
                                          v.sinks ? std::span<float>(dsinks) : std::span<float>());
  const test::Reference ref =
      test::run_reference(vc.c, &dout, v.sinks ? std::span<float>(dsinks_ref) : std::span<float>());
  EXPECT_LE(test::error(cpu.out, ref.out), test::relative_tolerance(4e-6, ref.out)) << "out";
  EXPECT_LE(test::error(cpu.lse, ref.lse), test::relative_tolerance(4e-6, ref.lse)) << "lse";
  EXPECT_LE(test::error(cpu.dq, ref.dq), test::relative_tolerance(2e-5, ref.dq)) << "dq";
  EXPECT_LE(test::error(cpu.dk, ref.dk), test::relative_tolerance(2e-5, ref.dk)) << "dk";
  EXPECT_LE(test::error(cpu.dv, ref.dv), test::relative_tolerance(2e-5, ref.dv)) << "dv";
  for (std::size_t h = 0; h < dsinks.size(); ++h)
    EXPECT_NEAR(dsinks[h], dsinks_ref[h], 2e-5 * std::max(1.0f, std::abs(dsinks_ref[h]))) << "dsinks " << h;
}

std::vector<Variant> variants() {
  const CaseSpec base{.name = "", .batch = 2, .q_len = 150, .k_len = 170, .q_heads = 4,
                      .kv_heads = 2, .head_dim = 32, .v_dim = 24};
  CaseSpec causal = base;
  causal.causal = Causal::bottom_right;
  CaseSpec masked = base;
  masked.keep_mask = masked.bias_mask = masked.key_padding = true;
  CaseSpec top_left = base;
  top_left.causal = Causal::top_left;
  top_left.key_padding = true;
  return {
      {"window_both_sides", base, {40, 20}},
      {"window_left_causal_br", causal, {70, -1}},
      {"window_top_left_padding", top_left, {30, 0}},
      {"alibi", base, {}, true},
      {"alibi_causal_padding", top_left, {}, true},
      {"softcap", base, {}, false, false, 2.5f},
      {"softcap_masked", masked, {}, false, false, 1.0f},
      {"sinks", base, {}, false, true},
      {"sinks_masked_window", masked, {16, 16}, false, true},
      {"dropout", base, {}, false, false, 0.0f, 0.3f},
      {"dropout_causal", causal, {}, false, false, 0.0f, 0.1f},
      {"everything", masked, {50, 10}, true, true, 3.0f, 0.2f},
  };
}

class Variants : public ::testing::TestWithParam<Variant> {};

TEST_P(Variants, CpuMatchesReference) {
  for (int threads : {1, 3}) expect_near_reference(GetParam(), threads);
}

TEST_P(Variants, BitwiseIdenticalForAnyThreadCount) {
  VariantCase vc(GetParam());
  const CaseSpec& s = GetParam().spec;
  const auto dout = test::random_tensor<float, 4>({s.batch, s.q_len, s.q_heads, s.v_dim}, 4);
  const test::Results one = test::run_cpu(vc.c, {s, false, false, 1}, &dout);
  const test::Results three = test::run_cpu(vc.c, {s, false, false, 3}, &dout);
  auto same = [](const auto& a, const auto& b) {
    return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  EXPECT_TRUE(same(one.out, three.out) && same(one.lse, three.lse) && same(one.dq, three.dq) &&
              same(one.dk, three.dk) && same(one.dv, three.dv));
}

INSTANTIATE_TEST_SUITE_P(All, Variants, ::testing::ValuesIn(variants()),
                         [](const auto& param_info) { return param_info.param.name; });

// The reference's backward (explicit Jacobian, with the sink as one more entry) against
// central differences of its own forward in fp64, dsinks included.
TEST(VariantGradients, ReferenceBackwardMatchesFiniteDifferences) {
  const CaseSpec spec{.name = "fd", .batch = 1, .q_len = 4, .k_len = 6, .q_heads = 2,
                      .kv_heads = 1, .head_dim = 3, .v_dim = 2, .causal = Causal::bottom_right,
                      .bias_mask = true};
  Case<double> c(spec, 5);
  std::vector<float> slopes{0.25f, 0.5f}, sinks{0.3f, -0.7f};
  c.options.window = {3, 1};
  c.options.softcap = 1.5f;
  c.options.alibi_slopes = slopes;
  c.options.sinks = sinks;
  c.options.dropout = {.p = 0.25f, .seed = 9, .offset = 1};
  c.options.execution.backend = Backend::reference;
  const auto dout = test::random_tensor<double, 4>({1, 4, 2, 2}, 6);
  Tensor<double, 4> out({1, 4, 2, 2}), dq(c.q.shape()), dk(c.k.shape()), dv(c.v.shape());
  Tensor<double, 3> lse({1, 2, 4});
  std::vector<float> dsinks(2), dslopes(2);
  attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.view(),
                     .lse = lse.view()}, c.options);
  attention_backward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.cview(),
                      .lse = lse.cview(), .dout = dout.cview(), .dq = dq.view(), .dk = dk.view(),
                      .dv = dv.view(), .dsinks = dsinks, .dalibi_slopes = dslopes}, c.options);
  auto loss = [&] { return test::weighted_output(c, dout); };
  test::expect_gradient_matches(c.q, dq, 1e-6, 1e-7, loss, "dq");
  test::expect_gradient_matches(c.k, dk, 1e-6, 1e-7, loss, "dk");
  test::expect_gradient_matches(c.v, dv, 1e-6, 1e-7, loss, "dv");
  // Sinks are float: a larger step, a looser bound.
  test::expect_gradient_matches(sinks, dsinks, 1e-3f, 1e-5, loss, "dsinks");
  // Slopes are float: a step of 2⁻¹² is exact on these slopes (0.25, 0.5), and the
  // central difference's truncation error, step²·f'''/6 with f''' ~ distance³ ≲ 10², stays
  // near 10⁻⁶.
  test::expect_gradient_matches(slopes, dslopes, 1.0f / 4096.0f, 1e-5, loss, "dalibi_slopes");
  EXPECT_GT(std::abs(dslopes[0]) + std::abs(dslopes[1]), 1e-3);  // not trivially zero
}

// ∂L/∂alibi_slopes: the cpu kernels (both backward schedules: two passes with few heads,
// one pass with B·Hkv ≥ 4 per core) against the fp64 reference, with causal alignment,
// key_lengths, GQA and soft-cap. Tolerance 2e-5·max(1, |ref|), like the other gradients:
// the slope gradient sums Nq·Nk terms dS·distance, but blockwise in float (≤ 64 per
// column, then double per tile), so its error grows with the block, not with N.
struct SlopeCase {
  std::string name;
  CaseSpec spec;
  float softcap = 0.0f;
};

std::vector<float> slope_gradient(const Case<float>& c, const std::vector<float>& slopes,
                                  Backend backend, int threads, float softcap) {
  const CaseSpec& s = c.spec;
  AttentionOptions options = c.options;
  options.alibi_slopes = slopes;
  options.softcap = softcap;
  options.execution.backend = backend;
  options.execution.threads = threads;
  Tensor<float, 4> out({s.batch, s.q_len, s.q_heads, s.v_dim}), dq(c.q.shape()), dk(c.k.shape()),
      dv(c.v.shape());
  Tensor<float, 3> lse({s.batch, s.q_heads, s.q_len});
  const auto dout = test::random_tensor<float, 4>({s.batch, s.q_len, s.q_heads, s.v_dim}, 11);
  attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.view(),
                     .lse = lse.view()}, options);
  std::vector<float> dslopes(slopes.size(), -1.0f);
  attention_backward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.cview(),
                      .lse = lse.cview(), .dout = dout.cview(), .dq = dq.view(), .dk = dk.view(),
                      .dv = dv.view(), .dalibi_slopes = dslopes}, options);
  return dslopes;
}

TEST(VariantGradients, AlibiSlopesCpuMatchesReference) {
  const CaseSpec two_pass{.name = "two_pass", .batch = 2, .q_len = 150, .k_len = 170, .q_heads = 4,
                          .kv_heads = 2, .head_dim = 32, .v_dim = 24, .causal = Causal::bottom_right,
                          .key_padding = true};
  CaseSpec single_pass = two_pass;  // B·Hkv = 16 ≥ 4 per core on any machine up to 4 cores
  single_pass.name = "single_pass";
  single_pass.batch = 4;
  single_pass.q_heads = 8;
  single_pass.kv_heads = 4;
  single_pass.q_len = 70;
  single_pass.k_len = 90;
  CaseSpec top_left = two_pass;
  top_left.causal = Causal::top_left;
  for (const SlopeCase& sc : {SlopeCase{"two_pass", two_pass}, SlopeCase{"single_pass", single_pass},
                              SlopeCase{"top_left_softcap", top_left, 2.0f}}) {
    SCOPED_TRACE(sc.name);
    const Case<float> c(sc.spec, 21);
    std::vector<float> slopes;
    for (int64_t h = 0; h < sc.spec.q_heads; ++h) slopes.push_back(0.05f + 0.1f * static_cast<float>(h));
    const std::vector<float> ref = slope_gradient(c, slopes, Backend::reference, 1, sc.softcap);
    double scale = 1.0;
    for (float g : ref) scale = std::max(scale, static_cast<double>(std::abs(g)));
    for (int threads : {1, 3}) {
      const std::vector<float> cpu = slope_gradient(c, slopes, Backend::cpu, threads, sc.softcap);
      for (std::size_t h = 0; h < ref.size(); ++h)
        EXPECT_NEAR(cpu[h], ref[h], 2e-5 * scale) << "head " << h << ", threads " << threads;
      if (threads == 3) {  // and the same bits for any thread count
        const std::vector<float> one = slope_gradient(c, slopes, Backend::cpu, 1, sc.softcap);
        EXPECT_EQ(std::memcmp(one.data(), cpu.data(), one.size() * sizeof(float)), 0);
      }
    }
    // Not a vacuous comparison: the gradient is far from 0 on these rows.
    EXPECT_GT(scale, 1e-2);
  }
}

TEST(VariantErrors, AlibiSlopeGradientNeedsSlopesOfTheRightSize) {
  const CaseSpec spec{.name = "e", .batch = 1, .q_len = 8, .k_len = 8, .q_heads = 2, .kv_heads = 1,
                      .head_dim = 4, .v_dim = 4};
  Case<float> c(spec, 1);
  Tensor<float, 4> out({1, 8, 2, 4}), dq(c.q.shape()), dk(c.k.shape()), dv(c.v.shape());
  Tensor<float, 3> lse({1, 2, 8});
  attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.view(),
                     .lse = lse.view()}, c.options);
  std::vector<float> dslopes(2, 7.0f), three(3, 7.0f), slopes{0.1f, 0.2f};
  auto call = [&](std::span<float> grad) {
    attention_backward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.cview(),
                        .lse = lse.cview(), .dout = out.cview(), .dq = dq.view(), .dk = dk.view(),
                        .dv = dv.view(), .dalibi_slopes = grad}, c.options);
  };
  auto expect_error = [&](std::span<float> grad, const char* words) {
    try {
      call(grad);
      ADD_FAILURE() << "no error";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find(words), std::string::npos) << error.what();
    }
    for (float g : grad) EXPECT_EQ(g, 7.0f);  // nothing written
  };
  expect_error(dslopes, "options.alibi_slopes is empty");
  c.options.alibi_slopes = slopes;
  expect_error(three, "one value per query head (2), got 3");
}

// Window 512 at N = 4096: only the tiles near the diagonal are computed.
TEST(VariantPlan, WindowSkipsTilesOutsideIt) {
  detail::MaskRule rule;
  rule.causal = Causal::top_left;
  rule.sequences = {.count = 1, .dense_q_len = 4096, .dense_k_len = 4096};
  rule.window = {512, 0};
  const detail::Extents e{.batch = 1, .q_len = 4096, .k_len = 4096, .q_heads = 1, .kv_heads = 1,
                          .head_dim = 8, .v_dim = 8};
  const detail::TilePlan plan(rule, e, 64, 64, 1);
  for (int64_t qb = 0; qb < 64; ++qb) {
    EXPECT_LE(plan.busy_key_blocks(0, 0, qb), 10) << qb;  // 512/64 + the two edges
    EXPECT_EQ(plan.at(0, 0, qb, qb), detail::Tile::partial);
    if (qb >= 10) {
      EXPECT_EQ(plan.at(0, 0, qb, qb - 10), detail::Tile::empty);
    }
    if (qb >= 4) {
      EXPECT_EQ(plan.at(0, 0, qb, qb - 4), detail::Tile::full);
    }
  }
}

// A sink on a row whose keys are all removed takes all the weight: out 0, lse = sink.
TEST(VariantNumerics, SinkOnAFullyMaskedRow) {
  const CaseSpec spec{.name = "sink", .q_len = 3, .k_len = 5, .q_heads = 2, .kv_heads = 2,
                      .head_dim = 4, .v_dim = 4, .keep_mask = true};
  Variant v{"sink", spec, {}, false, true};
  VariantCase vc(v);
  for (int64_t j = 0; j < 5; ++j) vc.c.keep(0, 0, 1, j) = 0;
  const test::Results cpu = test::run_cpu(vc.c, {spec}, nullptr);
  for (int64_t h = 0; h < 2; ++h) {
    EXPECT_FLOAT_EQ(cpu.lse(0, h, 1), vc.sinks[h]);
    for (int64_t x = 0; x < 4; ++x) EXPECT_EQ(cpu.out(0, 1, h, x), 0.0f);
  }
}

// Soft-capping bounds every logit by c: with c = 2 and logits of ~1e3, no row is
// one-hot (the largest weight stays ≤ e^4/(e^4 + (n−1)) of a uniform row's spread).
TEST(VariantNumerics, SoftcapBoundsTheLogits) {
  const CaseSpec spec{.name = "cap", .q_len = 8, .k_len = 64, .head_dim = 16, .v_dim = 16, .scale = 1.0};
  Variant v{"cap", spec, {}, false, false, 2.0f};
  VariantCase vc(v);
  for (std::size_t i = 0; i < vc.c.q.size(); ++i) vc.c.q[i] *= 30.0f;
  for (std::size_t i = 0; i < vc.c.k.size(); ++i) vc.c.k[i] *= 30.0f;
  const test::Results cpu = test::run_cpu(vc.c, {spec}, nullptr);
  for (int64_t i = 0; i < 8; ++i) {
    // lse ≤ c + log n and ≥ −c + log n.
    EXPECT_LE(cpu.lse(0, 0, i), 2.0f + std::log(64.0f) + 1e-5f);
    EXPECT_GE(cpu.lse(0, 0, i), -2.0f + std::log(64.0f) - 1e-5f);
  }
}

// Dropout: the keep rate is 1 − p within 5 binomial standard deviations, the mask is the
// same bits for the same seed and thread count independent, and averaging the output
// over seeds approaches the undropped output (unbiased: E[Z] = 1).
TEST(VariantDropout, KeepRateSeedsAndUnbiasedness) {
  const CaseSpec spec{.name = "drop", .q_len = 128, .k_len = 128, .head_dim = 8, .v_dim = 1};
  Case<float> c(spec, 2);
  test::fill(c.v, 1.0f);  // out = Σ_j P_ij Z_ij: its mean over rows estimates E[Z]·1
  const float p = 0.3f;
  c.options.dropout = {.p = p, .seed = 42, .offset = 0};
  const test::Results a = test::run_cpu(c, {spec}, nullptr);
  const test::Results b = test::run_cpu(c, {spec, false, false, 1}, nullptr);
  EXPECT_EQ(std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(float)), 0);
  // Keep rate straight from the hash: 128 × 128 decisions.
  const uint32_t threshold = detail::dropout_threshold(p);
  int64_t kept = 0;
  const uint32_t head = detail::dropout_head_key(42, 0, 0, 0);
  for (int64_t i = 0; i < 128; ++i)
    for (int64_t j = 0; j < 128; ++j) kept += detail::dropout_bits(detail::dropout_row_key(head, i), j) >= threshold;
  const double n = 128.0 * 128.0, sd = std::sqrt(n * p * (1 - p));
  EXPECT_NEAR(static_cast<double>(kept), n * (1 - p), 5 * sd);
  // Unbiased: over 64 seeds, the mean output (E = 1 per row) within 5 standard errors.
  double sum = 0.0, sum_sq = 0.0;
  int count = 0;
  for (uint64_t seed = 0; seed < 64; ++seed) {
    c.options.dropout.seed = seed;
    const test::Results r = test::run_cpu(c, {spec}, nullptr);
    for (std::size_t i = 0; i < r.out.size(); ++i) {
      sum += r.out[i];
      sum_sq += static_cast<double>(r.out[i]) * r.out[i];
      ++count;
    }
  }
  const double mean = sum / count, var = sum_sq / count - mean * mean;
  EXPECT_NEAR(mean, 1.0, 5 * std::sqrt(var / count));
  c.options.dropout.seed = 43;
  const test::Results other = test::run_cpu(c, {spec}, nullptr);
  EXPECT_NE(std::memcmp(a.out.data(), other.out.data(), a.out.size() * sizeof(float)), 0);
}

TEST(VariantErrors, BadVariantsAreNamed) {
  const CaseSpec spec{.name = "err", .q_len = 3, .k_len = 3, .q_heads = 2, .kv_heads = 2};
  auto expect_error = [&](const std::function<void(AttentionOptions&)>& spoil, const char* what) {
    Case<float> c(spec, 1);
    spoil(c.options);
    Tensor<float, 4> out({1, 3, 2, 4});
    test::fill(out, 5.0f);
    try {
      attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.view()}, c.options);
      ADD_FAILURE() << "no error for " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
    for (std::size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], 5.0f);
  };
  static const std::vector<float> one{1.0f}, nan2{1.0f, NAN};
  expect_error([](AttentionOptions& o) { o.window = {-2, 0}; }, "options.window");
  expect_error([](AttentionOptions& o) { o.alibi_slopes = one; }, "options.alibi_slopes: expected one value per query head (2)");
  expect_error([](AttentionOptions& o) { o.sinks = nan2; }, "options.sinks[1]: expected a finite value");
  expect_error([](AttentionOptions& o) { o.softcap = -1.0f; }, "options.softcap");
  expect_error([](AttentionOptions& o) { o.dropout.p = 1.0f; }, "options.dropout.p");
}

}  // namespace
}  // namespace qkv
