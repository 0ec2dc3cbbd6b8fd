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

#include "cpu/work_order.hpp"
#include "hwy/targets.h"
#include "cpu_check.hpp"
#include "simd_targets.hpp"

namespace qkv {
namespace {

using test::Case;
using test::CaseSpec;
using test::CpuCase;
using test::Reference;
using test::Results;
using test::check_case;
using test::error;
using test::run_cpu;
using test::run_reference;

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
  const std::vector<CpuCase> cases{
      {{.name = "t_causal", .batch = 2, .q_len = 70, .k_len = 70, .q_heads = 2, .kv_heads = 1,
        .head_dim = 64, .v_dim = 64, .causal = Causal::top_left}},
      {{.name = "t_odd", .q_len = 33, .k_len = 47, .head_dim = 59, .v_dim = 13, .bias_mask = true,
        .key_padding = true}},
  };
  test::for_each_simd_target([&](int64_t target) {
    EXPECT_STREQ(cpu::simd_target_name(), hwy::TargetName(target));
    for (const CpuCase& how : cases) check_case(how);
  });
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
