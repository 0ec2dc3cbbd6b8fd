// Attention health (qkv/attention_stats.hpp): the softmax statistics of the forward.
//
//  - the reference backend's statistics equal the definitions evaluated on its own
//    materialized P (the `weights` output), in double;
//  - the cpu backend's (from its online softmax) match the reference's, over every mask
//    kind, causal mode, key padding, GQA, decode and multi-block shapes, and varlen;
//  - saturated rows (logits of 100) give largest weight 1 and entropy 0, uniform rows
//    1/n and ln n; rows without keys are not counted;
//  - bitwise identical for any thread count; asking for statistics leaves out and lse
//    bitwise unchanged; every compiled SIMD target.
//
// Variants, 16-bit storage and varlen: test_attention_stats_variants.cpp; errors:
// test_attention_stats_errors.cpp; the tolerance: stats_check.hpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "simd_targets.hpp"
#include "stats_check.hpp"

namespace qkv {
namespace {

using test::Case;
using test::CaseSpec;
using namespace test::stats;

std::vector<CaseSpec> stats_cases() {
  std::vector<CaseSpec> cases = test::small_cases();
  auto add = [&](CaseSpec spec) { cases.push_back(std::move(spec)); };
  add({.name = "n70_gqa_causal", .batch = 2, .q_len = 70, .k_len = 70, .q_heads = 4, .kv_heads = 2,
       .head_dim = 64, .v_dim = 64, .causal = Causal::top_left});
  add({.name = "n65_d111_keep", .q_len = 65, .k_len = 65, .head_dim = 111, .v_dim = 111,
       .keep_mask = true});
  add({.name = "n65x130_bottom_right", .q_len = 65, .k_len = 130, .head_dim = 32, .v_dim = 32,
       .causal = Causal::bottom_right});
  // Nq > Nk, bottom-right: the first 60 rows see no key at all.
  add({.name = "n100x40_bottom_right_empty_rows", .batch = 2, .q_len = 100, .k_len = 40,
       .q_heads = 2, .kv_heads = 1, .head_dim = 16, .v_dim = 8, .causal = Causal::bottom_right});
  add({.name = "n130x63_bias", .q_len = 130, .k_len = 63, .q_heads = 2, .kv_heads = 1,
       .head_dim = 48, .v_dim = 48, .bias_mask = true});
  // Key lengths 2, 1, 0: the last entry has no keys (rows 0, NaN means).
  add({.name = "padding_to_nothing", .batch = 3, .q_len = 5, .k_len = 2, .q_heads = 2,
       .kv_heads = 2, .key_padding = true});
  add({.name = "decode_n1x300_gqa", .batch = 3, .q_len = 1, .k_len = 300, .q_heads = 8,
       .kv_heads = 2, .head_dim = 64, .v_dim = 64, .causal = Causal::bottom_right,
       .key_padding = true});
  add({.name = "decode_n16x200_mqa", .batch = 2, .q_len = 16, .k_len = 200, .q_heads = 4,
       .kv_heads = 1, .head_dim = 32, .v_dim = 32, .causal = Causal::bottom_right});
  add({.name = "n150_everything", .batch = 2, .q_len = 150, .k_len = 170, .q_heads = 4,
       .kv_heads = 2, .head_dim = 33, .v_dim = 17, .causal = Causal::bottom_right,
       .keep_mask = true, .bias_mask = true, .key_padding = true, .scale = 0.4});
  add({.name = "n200_sharp", .q_len = 200, .k_len = 200, .q_heads = 2, .kv_heads = 2,
       .head_dim = 16, .v_dim = 16, .causal = Causal::top_left, .scale = 2.0});
  return cases;
}

class StatsCases : public ::testing::TestWithParam<CaseSpec> {};

// The reference's statistics are the definitions evaluated on its own P.
TEST_P(StatsCases, ReferenceEqualsTheDefinitionsOnItsWeights) {
  const Case<float> c(GetParam(), 21);
  const ReferenceRun ref = run_reference(c);
  const StatsOut<double> expected = stats_from_weights(ref.weights, ref.lse, kThreshold);
  EXPECT_LE(nan_aware_error(ref.stats.row_max_weight, expected.row_max_weight), 1e-15);
  EXPECT_LE(nan_aware_error(ref.stats.row_entropy, expected.row_entropy), 1e-13);
  EXPECT_LE(nan_aware_error(ref.stats.max_weight_mean, expected.max_weight_mean), 1e-15);
  EXPECT_LE(nan_aware_error(ref.stats.max_weight_max, expected.max_weight_max), 0.0);
  EXPECT_LE(nan_aware_error(ref.stats.entropy_mean, expected.entropy_mean), 1e-13);
  EXPECT_LE(nan_aware_error(ref.stats.saturated_share, expected.saturated_share), 0.0);
  EXPECT_LE(nan_aware_error(ref.stats.rows, expected.rows), 0.0);
}

TEST_P(StatsCases, CpuMatchesTheReference) {
  const Case<float> c(GetParam(), 22);
  expect_cpu_matches_reference(c, run_cpu(c, 2), run_reference(c), kThreshold);
}

INSTANTIATE_TEST_SUITE_P(Cases, StatsCases, ::testing::ValuesIn(stats_cases()),
                         [](const auto& param_info) { return param_info.param.name; });

// Rows without keys are not counted, get 0s, and a head without counted rows gets NaN.
template <class T>
void expect_bottom_right_padding_counts(const StatsOut<T>& stats) {
  // key_lengths 40, 39, 38; bottom-right: row i of entry b sees i + 1 + (L_b − 100) keys.
  for (int64_t b = 0; b < 3; ++b) {
    const int64_t length = 40 - b;
    for (int64_t h = 0; h < 2; ++h) {
      EXPECT_EQ(stats.rows(b, h), length);
      for (int64_t i = 0; i < 100 - length; ++i) {
        EXPECT_EQ(stats.row_max_weight(b, h, i), 0);
        EXPECT_EQ(stats.row_entropy(b, h, i), 0);
      }
      // The first counted row sees one key: weight 1, entropy 0.
      EXPECT_EQ(stats.row_max_weight(b, h, 100 - length), 1);
      EXPECT_EQ(stats.row_entropy(b, h, 100 - length), 0);
    }
  }
}

template <class T>
void expect_nothing_counted(const StatsOut<T>& stats) {
  for (std::size_t i = 0; i < stats.rows.size(); ++i) {
    EXPECT_EQ(stats.rows[i], 0);
    EXPECT_TRUE(std::isnan(stats.max_weight_mean[i]));
    EXPECT_TRUE(std::isnan(stats.max_weight_max[i]));
    EXPECT_TRUE(std::isnan(stats.entropy_mean[i]));
    EXPECT_TRUE(std::isnan(stats.saturated_share[i]));
  }
}

TEST(AttentionStats, RowsWithoutKeysAreNotCounted) {
  const Case<float> c({.name = "empty_rows", .batch = 3, .q_len = 100, .k_len = 40, .q_heads = 2,
                       .kv_heads = 1, .head_dim = 16, .v_dim = 8, .causal = Causal::bottom_right,
                       .key_padding = true},
                      23);
  expect_bottom_right_padding_counts(run_cpu(c, 2).stats);
  expect_bottom_right_padding_counts(run_reference(c).stats);

  // Every key padded away: nothing counted anywhere.
  Case<float> none({.name = "no_keys", .batch = 2, .q_len = 3, .k_len = 4, .q_heads = 2,
                    .kv_heads = 2},
                   24);
  const std::vector<int64_t> zero{0, 0};
  none.options.key_lengths = zero;
  expect_nothing_counted(run_cpu(none, 2).stats);
  expect_nothing_counted(run_reference(none).stats);
}

// Logits ×100 on one key per row: one-hot rows. Largest weight 1 and entropy 0, to the
// float rounding of exp(−100) ≈ 4e−44 (the other keys' weights): both exactly 1 and 0.
TEST(AttentionStats, SaturatedRowsAreOneHot) {
  const int64_t n = 80, d = 80;
  CaseSpec spec{.name = "saturated", .batch = 1, .q_len = n, .k_len = n, .q_heads = 2, .kv_heads = 1,
                .head_dim = d, .v_dim = 8, .scale = 1.0};
  Case<float> c(spec, 25);
  test::fill(c.q, 0.0f);
  test::fill(c.k, 0.0f);
  for (int64_t j = 0; j < n; ++j) c.k(0, j, 0, j) = 1.0f;  // keys e_j
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t i = 0; i < n; ++i) c.q(0, i, h, (i * 7 + h) % n) = 100.0f;  // logit 100 on one key
  for (const double threshold : {0.99, 0.999999}) {
    const CpuRun cpu = run_cpu(c, 2, threshold);
    const ReferenceRun ref = run_reference(c, threshold);
    for (int64_t h = 0; h < 2; ++h) {
      EXPECT_EQ(cpu.stats.max_weight_mean(0, h), 1.0f);
      EXPECT_EQ(cpu.stats.max_weight_max(0, h), 1.0f);
      EXPECT_LE(cpu.stats.entropy_mean(0, h), 1e-30f);
      EXPECT_GE(cpu.stats.entropy_mean(0, h), 0.0f);
      EXPECT_EQ(cpu.stats.saturated_share(0, h), 1.0f);
      EXPECT_EQ(cpu.stats.rows(0, h), n);
      EXPECT_NEAR(ref.stats.max_weight_mean(0, h), 1.0, 1e-15);
      EXPECT_LE(ref.stats.entropy_mean(0, h), 1e-38);
      EXPECT_EQ(ref.stats.saturated_share(0, h), 1.0);
    }
  }
  // At the default 1/√d scale the logits are 100/√80 ≈ 11: 99.9 % of each row on one
  // key, and the entropy sees the rest (79·e^−11·12 ≈ 0.01 nats).
  c.options.scale.reset();
  const CpuRun scaled = run_cpu(c, 2, 0.99);
  EXPECT_GT(scaled.stats.entropy_mean(0, 0), 1e-3f);
}

// Equal logits: weights 1/n and entropy ln n, n = the keys of the row (causal: i + 1).
TEST(AttentionStats, UniformRowsHaveEntropyLogN) {
  const int64_t n = 150;
  Case<float> c({.name = "uniform", .batch = 2, .q_len = n, .k_len = n, .q_heads = 3, .kv_heads = 3,
                 .head_dim = 8, .v_dim = 8, .causal = Causal::top_left},
                26);
  test::fill(c.q, 0.0f);
  const CpuRun cpu = run_cpu(c, 2, 0.99);
  const ReferenceRun ref = run_reference(c, 0.99);
  double mean_entropy = 0.0, mean_weight = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double keys = static_cast<double>(i + 1);
    mean_entropy += std::log(keys) / n;
    mean_weight += 1.0 / keys / n;
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t h = 0; h < 3; ++h) {
        // l = i + 1 exactly in float, u = 0: 1/l correctly rounded, ln l within Highway's
        // 4 ULP.
        EXPECT_EQ(cpu.stats.row_max_weight(b, h, i), static_cast<float>(1.0 / keys));
        const float log_keys = static_cast<float>(std::log(keys));
        EXPECT_NEAR(cpu.stats.row_entropy(b, h, i), log_keys,
                    4.0f * (std::nextafter(log_keys, INFINITY) - log_keys));
        EXPECT_NEAR(ref.stats.row_entropy(b, h, i), std::log(keys), 1e-13);
      }
  }
  for (int64_t i = 0; i < 6; ++i) {
    EXPECT_NEAR(cpu.stats.entropy_mean[i], mean_entropy, 1e-6);
    EXPECT_NEAR(cpu.stats.max_weight_mean[i], mean_weight, 1e-7);
    EXPECT_EQ(cpu.stats.max_weight_max[i], 1.0f);  // row 0 sees one key
    EXPECT_EQ(cpu.stats.saturated_share[i], 1.0f / n);
  }
}

// Statistics are the same bits for any thread count, run to run; asking for them changes
// no bit of out or lse.
TEST(AttentionStats, BitwiseIdenticalForAnyThreadCountAndOutputsUnchanged) {
  const CaseSpec spec{.name = "det", .batch = 2, .q_len = 300, .k_len = 280, .q_heads = 4,
                      .kv_heads = 2, .head_dim = 64, .v_dim = 48, .causal = Causal::bottom_right,
                      .bias_mask = true, .key_padding = true};
  const Case<float> c(spec, 27);
  const CpuRun first = run_cpu(c, 1);
  const auto same = [](const auto& a, const auto& b) {
    return std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
  };
  for (int threads : {1, 2, 3, 8}) {
    for (int repeat = 0; repeat < 2; ++repeat) {
      const CpuRun again = run_cpu(c, threads);
      EXPECT_TRUE(same(first.stats.max_weight_mean, again.stats.max_weight_mean)) << threads;
      EXPECT_TRUE(same(first.stats.max_weight_max, again.stats.max_weight_max)) << threads;
      EXPECT_TRUE(same(first.stats.entropy_mean, again.stats.entropy_mean)) << threads;
      EXPECT_TRUE(same(first.stats.saturated_share, again.stats.saturated_share)) << threads;
      EXPECT_TRUE(same(first.stats.rows, again.stats.rows)) << threads;
      EXPECT_TRUE(same(first.stats.row_max_weight, again.stats.row_max_weight)) << threads;
      EXPECT_TRUE(same(first.stats.row_entropy, again.stats.row_entropy)) << threads;
    }
  }
  const CpuRun plain = run_cpu(c, 2, kThreshold, /*with_stats=*/false);
  EXPECT_TRUE(same(first.out, plain.out));
  EXPECT_TRUE(same(first.lse, plain.lse));
}

// A NaN/Inf behind a removed key (causal future) reaches no other row's statistics; the
// rows that see it get NaN.
TEST(AttentionStats, NonFiniteBehindMaskStaysThere) {
  const CaseSpec spec{.name = "nan", .q_len = 130, .k_len = 130, .head_dim = 16, .v_dim = 16,
                      .causal = Causal::top_left};
  Case<float> c(spec, 40);
  const CpuRun clean = run_cpu(c, 2);
  const int64_t poisoned = 70;
  c.k(0, poisoned, 0, 5) = std::nanf("");
  c.k(0, poisoned + 1, 0, 2) = INFINITY;
  const CpuRun dirty = run_cpu(c, 2);
  for (int64_t i = 0; i < 130; ++i) {
    if (i < poisoned) {
      EXPECT_EQ(dirty.stats.row_max_weight(0, 0, i), clean.stats.row_max_weight(0, 0, i)) << i;
      EXPECT_EQ(dirty.stats.row_entropy(0, 0, i), clean.stats.row_entropy(0, 0, i)) << i;
    } else {
      EXPECT_TRUE(std::isnan(dirty.stats.row_entropy(0, 0, i))) << i;
    }
  }
  EXPECT_EQ(dirty.stats.rows(0, 0), 130);
  EXPECT_TRUE(std::isnan(dirty.stats.entropy_mean(0, 0)));
  EXPECT_TRUE(std::isnan(dirty.stats.max_weight_max(0, 0)));
}

TEST(AttentionStats, EveryCompiledSimdTarget) {
  const std::vector<CaseSpec> specs{
      {.name = "t_causal", .batch = 2, .q_len = 70, .k_len = 70, .q_heads = 2, .kv_heads = 1,
       .head_dim = 64, .v_dim = 64, .causal = Causal::top_left},
      {.name = "t_odd", .q_len = 33, .k_len = 47, .head_dim = 59, .v_dim = 13, .bias_mask = true,
       .key_padding = true},
  };
  test::for_each_simd_target([&](int64_t) {
    for (const CaseSpec& spec : specs) {
      const Case<float> c(spec, 28);
      expect_cpu_matches_reference(c, run_cpu(c, 2), run_reference(c), kThreshold);
    }
  });
}

// Only the views given are written; the others may be absent.
TEST(AttentionStats, AnySubsetOfViews) {
  const Case<float> c({.name = "subset", .batch = 2, .q_len = 9, .k_len = 11, .q_heads = 2,
                       .kv_heads = 1, .head_dim = 8, .v_dim = 8},
                      29);
  const CpuRun all = run_cpu(c, 2);
  Tensor<float, 2> entropy({2, 2});
  Tensor<float, 3> row_weight({2, 2, 9});
  Tensor<float, 4> out({2, 9, 2, 8});
  for (const Backend backend : {Backend::cpu, Backend::reference}) {
    AttentionStats<float> views{.entropy_mean = entropy.view()};
    AttentionOptions options = c.options;
    options.execution.backend = backend;
    attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.view(),
                       .stats = &views},
                      options);
    EXPECT_LE(test::max_abs_diff(entropy, all.stats.entropy_mean), 1e-5);
    views = {.row_max_weight = row_weight.view()};
    attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.view(),
                       .stats = &views},
                      options);
    EXPECT_LE(test::max_abs_diff(row_weight, all.stats.row_max_weight), 1e-5);
  }
}

// Batch 0 and sequences of length 0: nothing to count, nothing fails.
TEST(AttentionStats, EmptyProblems) {
  for (const Backend backend : {Backend::cpu, Backend::reference}) {
    Case<float> c({.name = "no_queries", .batch = 2, .q_len = 0, .k_len = 5, .q_heads = 3}, 30);
    StatsOut<float> stats(2, 3, 0);
    Tensor<float, 4> out({2, 0, 3, 4});
    AttentionOptions options = c.options;
    options.execution.backend = backend;
    const AttentionStats<float> views = stats.views();
    attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.view(),
                       .stats = &views},
                      options);
    for (std::size_t i = 0; i < 6; ++i) {
      EXPECT_EQ(stats.rows[i], 0);
      EXPECT_TRUE(std::isnan(stats.entropy_mean[i]));
    }
  }
}

}  // namespace
}  // namespace qkv
