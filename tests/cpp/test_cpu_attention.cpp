// The fused cpu backend against the fp64 reference, forward and backward, over shapes,
// layouts, masks, GQA, thread counts and every compiled SIMD target.
//
// Tolerance (the rule): max |cpu − ref64| ≤ 2·max |plain32 − ref64| + floor,
// where plain32 is an unfused fp32 implementation (tests/cpp/plain_fp32.hpp) on the same
// inputs. floor = 8·ε₃₂·max(1, max |ref64|) ≈ 1e-6 for O(1) values: a few roundings that
// the plain loop may happen to avoid on tiny problems (e.g. N = 1, where it is exact).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <thread>

#include "cpu/cpu_backend.hpp"
#include "cpu/work_order.hpp"
#include "hwy/targets.h"
#include "plain_fp32.hpp"

namespace qkv {
namespace {

using test::Case;
using test::CaseSpec;

struct CpuCase {
  CaseSpec spec;
  bool bhsd = false;          // PyTorch memory layout
  bool strided_batch = false; // q lives in every other batch slot of a bigger buffer
  int threads = 2;
};

std::ostream& operator<<(std::ostream& out, const CpuCase& c) { return out << c.spec.name; }

struct Results {
  Tensor<float, 4> out, dq, dk, dv;
  Tensor<float, 3> lse;
};

template <class T>
Tensor<T, 4> widen(const Tensor<float, 4>& t) {
  Tensor<T, 4> w(t.shape());
  for (std::size_t i = 0; i < t.size(); ++i) w[i] = static_cast<T>(t[i]);
  return w;
}

// Runs forward (and backward when dout is given) on the cpu backend, in the case's layout.
Results run_cpu(const Case<float>& c, const CpuCase& how, const Tensor<float, 4>* dout) {
  const CaseSpec& s = c.spec;
  AttentionOptions options = c.options;
  options.execution.backend = Backend::cpu;
  options.execution.threads = how.threads;
  Results r{Tensor<float, 4>({s.batch, s.q_len, s.q_heads, s.v_dim}), Tensor<float, 4>(c.q.shape()),
            Tensor<float, 4>(c.k.shape()), Tensor<float, 4>(c.v.shape()),
            Tensor<float, 3>({s.batch, s.q_heads, s.q_len})};
  if (how.bhsd) {
    auto q = test::to_bhsd(c.q), k = test::to_bhsd(c.k), v = test::to_bhsd(c.v);
    auto out = test::to_bhsd(r.out);
    attention_forward({.q = test::bhsd_view(q), .k = test::bhsd_view(k), .v = test::bhsd_view(v),
                       .out = test::bhsd_view(out), .lse = r.lse.view()},
                      options);
    // back to [B, S, H, D] for comparison
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t i = 0; i < s.q_len; ++i)
        for (int64_t h = 0; h < s.q_heads; ++h)
          for (int64_t x = 0; x < s.v_dim; ++x) r.out(b, i, h, x) = out(b, h, i, x);
    if (dout == nullptr) return r;
    auto go = test::to_bhsd(*dout), o = test::to_bhsd(r.out);
    auto dq = test::to_bhsd(r.dq), dk = test::to_bhsd(r.dk), dv = test::to_bhsd(r.dv);
    attention_backward({.q = test::bhsd_view(q), .k = test::bhsd_view(k), .v = test::bhsd_view(v),
                        .out = test::bhsd_view(o), .lse = r.lse.cview(), .dout = test::bhsd_view(go),
                        .dq = test::bhsd_view(dq), .dk = test::bhsd_view(dk), .dv = test::bhsd_view(dv)},
                       options);
    auto back = [](const Tensor<float, 4>& from, Tensor<float, 4>& to) {
      const auto& sh = to.shape();
      for (int64_t b = 0; b < sh[0]; ++b)
        for (int64_t i = 0; i < sh[1]; ++i)
          for (int64_t h = 0; h < sh[2]; ++h)
            for (int64_t x = 0; x < sh[3]; ++x) to(b, i, h, x) = from(b, h, i, x);
    };
    back(dq, r.dq);
    back(dk, r.dk);
    back(dv, r.dv);
    return r;
  }
  View4<const float> q = c.q.cview();
  Tensor<float, 4> wide;
  if (how.strided_batch) {  // same values, batch stride doubled
    wide = Tensor<float, 4>({2 * s.batch, s.q_len, s.q_heads, s.head_dim});
    const std::size_t per_batch = c.q.size() / static_cast<std::size_t>(s.batch);
    for (int64_t b = 0; b < s.batch; ++b)
      std::memcpy(wide.data() + 2 * b * per_batch, c.q.data() + b * per_batch, per_batch * sizeof(float));
    q.data = wide.data();
    q.strides[0] *= 2;
  }
  attention_forward({.q = q, .k = c.k.cview(), .v = c.v.cview(), .out = r.out.view(), .lse = r.lse.view()},
                    options);
  if (dout != nullptr) {
    attention_backward({.q = q, .k = c.k.cview(), .v = c.v.cview(), .out = r.out.cview(),
                        .lse = r.lse.cview(), .dout = dout->cview(), .dq = r.dq.view(),
                        .dk = r.dk.view(), .dv = r.dv.view()},
                       options);
  }
  return r;
}

struct Reference {
  Tensor<double, 4> out, dq, dk, dv;
  Tensor<double, 3> lse;
};

Reference run_reference(const Case<float>& c, const Tensor<float, 4>* dout) {
  const CaseSpec& s = c.spec;
  const auto q = widen<double>(c.q), k = widen<double>(c.k), v = widen<double>(c.v);
  Reference r{Tensor<double, 4>({s.batch, s.q_len, s.q_heads, s.v_dim}), Tensor<double, 4>(c.q.shape()),
              Tensor<double, 4>(c.k.shape()), Tensor<double, 4>(c.v.shape()),
              Tensor<double, 3>({s.batch, s.q_heads, s.q_len})};
  attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = r.out.view(), .lse = r.lse.view()},
                    c.options);
  if (dout != nullptr) {
    const auto g = widen<double>(*dout);
    attention_backward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = r.out.cview(),
                        .lse = r.lse.cview(), .dout = g.cview(), .dq = r.dq.view(), .dk = r.dk.view(),
                        .dv = r.dv.view()},
                       c.options);
  }
  return r;
}

template <int R>
double max_abs(const Tensor<double, R>& t) {
  double m = 0.0;
  for (std::size_t i = 0; i < t.size(); ++i)
    if (std::isfinite(t[i])) m = std::max(m, std::abs(t[i]));
  return m;
}

// max |x − ref| treating equal infinities (−inf LSE of masked rows) as exact.
template <int R>
double error(const Tensor<float, R>& x, const Tensor<double, R>& ref) {
  double worst = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (std::isinf(ref[i]) && static_cast<double>(x[i]) == ref[i]) continue;
    const double e = std::abs(static_cast<double>(x[i]) - ref[i]);
    if (std::isnan(e)) return INFINITY;
    worst = std::max(worst, e);
  }
  return worst;
}

template <int R>
void expect_within_rule(const char* name, const Tensor<float, R>& cpu, const Tensor<float, R>& plain,
                        const Tensor<double, R>& ref) {
  const double floor = 8.0 * std::numeric_limits<float>::epsilon() * std::max(1.0, max_abs(ref));
  const double cpu_error = error(cpu, ref), plain_error = error(plain, ref);
  EXPECT_LE(cpu_error, 2.0 * plain_error + floor)
      << name << ": cpu error " << cpu_error << ", plain fp32 error " << plain_error;
}

// Reference backward builds an Nk×Nk Jacobian per query row: keep it affordable.
bool backward_affordable(const CaseSpec& s) {
  return static_cast<double>(s.batch * s.q_heads * s.q_len) * static_cast<double>(s.k_len * s.k_len) < 3e8;
}

void check_case(const CpuCase& how) {
  const Case<float> c(how.spec, 1234);
  const CaseSpec& s = c.spec;
  const bool backward = backward_affordable(s);
  const auto dout = test::random_tensor<float, 4>({s.batch, s.q_len, s.q_heads, s.v_dim}, 99);
  const Results cpu = run_cpu(c, how, backward ? &dout : nullptr);
  const test::PlainResult plain = test::plain_fp32(c, backward ? &dout : nullptr);
  const Reference ref = run_reference(c, backward ? &dout : nullptr);
  expect_within_rule("out", cpu.out, plain.out, ref.out);
  expect_within_rule("lse", cpu.lse, plain.lse, ref.lse);
  if (!backward) return;
  expect_within_rule("dq", cpu.dq, plain.dq, ref.dq);
  expect_within_rule("dk", cpu.dk, plain.dk, ref.dk);
  expect_within_rule("dv", cpu.dv, plain.dv, ref.dv);
}

std::vector<CpuCase> cpu_cases() {
  std::vector<CpuCase> cases;
  for (const CaseSpec& spec : test::small_cases()) cases.push_back({spec});
  auto add = [&](CaseSpec spec, bool bhsd = false, bool strided = false, int threads = 2) {
    cases.push_back({spec, bhsd, strided, threads});
  };
  add({.name = "n1_d1", .q_len = 1, .k_len = 1, .head_dim = 1, .v_dim = 1});
  add({.name = "n7_d3_causal", .q_len = 7, .k_len = 7, .head_dim = 3, .v_dim = 3, .causal = Causal::top_left});
  add({.name = "n63_d59_bhsd", .q_len = 63, .k_len = 63, .head_dim = 59, .v_dim = 59}, true);
  add({.name = "n64_d64_gqa_causal", .batch = 2, .q_len = 64, .k_len = 64, .q_heads = 4, .kv_heads = 2,
       .head_dim = 64, .v_dim = 64, .causal = Causal::top_left});
  add({.name = "n65_d111_mask", .q_len = 65, .k_len = 65, .head_dim = 111, .v_dim = 111, .keep_mask = true},
      false, true);
  add({.name = "n65x130_d128_bottom_right", .q_len = 65, .k_len = 130, .head_dim = 128, .v_dim = 128,
       .causal = Causal::bottom_right});
  add({.name = "n130x63_d256_bias", .q_len = 130, .k_len = 63, .q_heads = 2, .kv_heads = 1, .head_dim = 256,
       .v_dim = 256, .bias_mask = true}, true);
  add({.name = "n1x65_d80_decode", .batch = 3, .q_len = 1, .k_len = 65, .q_heads = 4, .kv_heads = 1,
       .head_dim = 80, .v_dim = 80, .causal = Causal::bottom_right, .key_padding = true});
  add({.name = "n100_d96_padding", .batch = 3, .q_len = 100, .k_len = 100, .head_dim = 96, .v_dim = 32,
       .causal = Causal::top_left, .key_padding = true}, false, false, 3);
  add({.name = "n128_d64_mqa_bhsd", .q_len = 128, .k_len = 128, .q_heads = 3, .kv_heads = 1, .head_dim = 64,
       .v_dim = 64, .causal = Causal::top_left}, true, false, 8);
  add({.name = "n70_everything", .batch = 2, .q_len = 70, .k_len = 90, .q_heads = 4, .kv_heads = 2,
       .head_dim = 33, .v_dim = 17, .causal = Causal::bottom_right, .keep_mask = true, .bias_mask = true,
       .key_padding = true, .scale = 0.2});
  // Enough heads for the backward's single-pass schedule on this machine.
  const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  add({.name = "single_pass_gqa_causal", .batch = 2 * cores, .q_len = 70, .k_len = 70, .q_heads = 4,
       .kv_heads = 2, .head_dim = 64, .v_dim = 64, .causal = Causal::top_left, .bias_mask = true});
  add({.name = "single_pass_odd_dims", .batch = 4 * cores, .q_len = 20, .k_len = 75, .head_dim = 33,
       .v_dim = 17, .causal = Causal::bottom_right, .keep_mask = true, .key_padding = true}, true);
#ifndef QKV_TEST_SMALL  // long sequences: too slow under the sanitizers
  add({.name = "n1000_d64_causal", .q_len = 1000, .k_len = 1000, .head_dim = 64, .v_dim = 64,
       .causal = Causal::top_left});
  add({.name = "n1000_d128_bhsd", .q_len = 1000, .k_len = 1000, .head_dim = 128, .v_dim = 128}, true);
  add({.name = "n200_d64_backward", .q_len = 200, .k_len = 200, .q_heads = 2, .kv_heads = 1, .head_dim = 64,
       .v_dim = 64, .keep_mask = true});
#endif
  return cases;
}

class CpuAgainstReference : public ::testing::TestWithParam<CpuCase> {};

TEST_P(CpuAgainstReference, WithinTwiceThePlainFp32Error) { check_case(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, CpuAgainstReference, ::testing::ValuesIn(cpu_cases()),
                         [](const auto& param_info) { return param_info.param.spec.name; });

TEST(CpuSchedules, BothBackwardSchedulesAreCovered) {
  bool single = false, two = false;
  for (const CpuCase& how : cpu_cases()) {
    const CaseSpec& s = how.spec;
    detail::Extents e{.batch = s.batch, .q_len = s.q_len, .k_len = s.k_len, .q_heads = s.q_heads,
                      .kv_heads = s.kv_heads, .head_dim = s.head_dim, .v_dim = s.v_dim};
    (cpu::backward_single_pass(e) ? single : two) = true;
  }
  EXPECT_TRUE(single);
  EXPECT_TRUE(two);
}

TEST(CpuSimdTargets, EveryCompiledTargetMatchesTheReference) {
  const std::vector<int64_t> targets = cpu::compiled_simd_targets();
  ASSERT_FALSE(targets.empty());
  const std::vector<CpuCase> cases{
      {{.name = "t_causal", .batch = 2, .q_len = 70, .k_len = 70, .q_heads = 2, .kv_heads = 1,
        .head_dim = 64, .v_dim = 64, .causal = Causal::top_left}},
      {{.name = "t_odd", .q_len = 33, .k_len = 47, .head_dim = 59, .v_dim = 13, .bias_mask = true,
        .key_padding = true}},
  };
  for (int64_t target : targets) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(hwy::TargetName(target));
    EXPECT_STREQ(cpu::simd_target_name(), hwy::TargetName(target));
    for (const CpuCase& how : cases) check_case(how);
  }
  hwy::SetSupportedTargetsForTest(0);  // back to the real CPU
}

// Outputs and gradients are bitwise identical for any thread count, run to run, with
// either backward schedule.
class CpuDeterminism : public ::testing::TestWithParam<int64_t> {};

TEST_P(CpuDeterminism, BitwiseIdenticalForAnyThreadCount) {
  const int64_t batch = GetParam();
  const CaseSpec spec{.name = "det", .batch = batch, .q_len = 150, .k_len = 170, .q_heads = 4,
                      .kv_heads = 2, .head_dim = 64, .v_dim = 48, .causal = Causal::bottom_right,
                      .bias_mask = true, .key_padding = true};
  const Case<float> c(spec, 5);
  const auto dout = test::random_tensor<float, 4>({batch, 150, 4, 48}, 6);
  const Results first = run_cpu(c, {spec, false, false, 1}, &dout);
  auto same = [](const auto& a, const auto& b) {
    return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  for (int threads : {1, 2, 3, 8}) {
    for (int repeat = 0; repeat < 2; ++repeat) {
      const Results again = run_cpu(c, {spec, false, false, threads}, &dout);
      EXPECT_TRUE(same(first.out, again.out)) << threads << " threads";
      EXPECT_TRUE(same(first.lse, again.lse)) << threads << " threads";
      EXPECT_TRUE(same(first.dq, again.dq)) << threads << " threads";
      EXPECT_TRUE(same(first.dk, again.dk)) << threads << " threads";
      EXPECT_TRUE(same(first.dv, again.dv)) << threads << " threads";
    }
  }
}

// Batch 1 (two-pass backward) and enough batches for the single pass on this machine.
INSTANTIATE_TEST_SUITE_P(Schedules, CpuDeterminism,
                         ::testing::Values(int64_t{1},
                                           int64_t{2} * std::max(1u, std::thread::hardware_concurrency())));

// A NaN/Inf behind a removed key (causal future, boolean mask) reaches no output, and
// the rows that do see it are NaN.
TEST(CpuNumerics, NonFiniteBehindMaskStaysThere) {
  const CaseSpec spec{.name = "nan", .q_len = 80, .k_len = 80, .head_dim = 16, .v_dim = 16,
                      .causal = Causal::top_left};
  Case<float> c(spec, 8);
  const int64_t poisoned = 70;
  c.v(0, poisoned, 0, 3) = INFINITY;
  c.k(0, poisoned, 0, 5) = std::nanf("");
  const auto dout = test::random_tensor<float, 4>({1, 80, 1, 16}, 9);
  const Results r = run_cpu(c, {spec}, &dout);
  for (int64_t i = 0; i < 80; ++i) {
    bool any_nan = false;
    for (int64_t x = 0; x < 16; ++x) any_nan = any_nan || std::isnan(r.out(0, i, 0, x));
    EXPECT_EQ(any_nan, i >= poisoned) << "query " << i;
    if (i < poisoned) {
      for (int64_t x = 0; x < 16; ++x) EXPECT_TRUE(std::isfinite(r.dq(0, i, 0, x))) << "dq " << i;
    }
  }
  // And the rows before the poison are what a clean run gives, up to rounding: the
  // block holding the poison takes the slow exact path, which sums in another order
  // (a few ulps of these O(1) outputs; a leak would be NaN or O(1) off).
  Case<float> clean(spec, 8);
  const Results ok = run_cpu(clean, {spec}, nullptr);
  for (int64_t i = 0; i < poisoned; ++i)
    for (int64_t x = 0; x < 16; ++x) EXPECT_NEAR(r.out(0, i, 0, x), ok.out(0, i, 0, x), 1e-6);
}

TEST(CpuNumerics, FullyMaskedRowsAndHugeLogits) {
  // Row 5 of the boolean mask removes every key; logits are ~1e6.
  const CaseSpec spec{.name = "masked", .q_len = 20, .k_len = 20, .head_dim = 512, .v_dim = 8,
                      .keep_mask = true, .scale = 1.0};
  Case<float> c(spec, 10);
  for (std::size_t i = 0; i < c.q.size(); ++i) c.q[i] *= 50.0f;
  for (std::size_t i = 0; i < c.k.size(); ++i) c.k[i] *= 50.0f;
  for (int64_t j = 0; j < 20; ++j) c.keep(0, 0, 5, j) = 0;
  const auto dout = test::random_tensor<float, 4>({1, 20, 1, 8}, 11);
  const Results r = run_cpu(c, {spec}, &dout);
  EXPECT_TRUE(test::all_finite(r.out) && test::all_finite(r.dq) && test::all_finite(r.dk) &&
              test::all_finite(r.dv));
  EXPECT_EQ(r.lse(0, 0, 5), -INFINITY);
  for (int64_t x = 0; x < 8; ++x) EXPECT_EQ(r.out(0, 5, 0, x), 0.0f);
  for (int64_t x = 0; x < 512; ++x) EXPECT_EQ(r.dq(0, 5, 0, x), 0.0f);
  const Reference ref = run_reference(c, &dout);
  // Saturated softmax: the output picks V rows exactly, as the reference does.
  EXPECT_LE(error(r.out, ref.out), 1e-5);
}

}  // namespace
}  // namespace qkv
