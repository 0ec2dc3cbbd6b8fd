// Attention health (qkv/attention_stats.hpp): the softmax statistics of the forward.
//
//  - the reference backend's statistics equal the definitions evaluated on its own
//    materialized P (the `weights` output), in double;
//  - the cpu backend's (from its online softmax) match the reference's, over every mask
//    kind, causal mode, key padding, GQA, decode and multi-block shapes, and varlen;
//  - saturated rows (logits of 100) give largest weight 1 and entropy 0, uniform rows
//    1/n and ln n; rows without keys are not counted;
//  - bitwise identical for any thread count; asking for statistics leaves out and lse
//    bitwise unchanged; every compiled SIMD target; every error path.
//
// Tolerance for the cpu backend (the project's rule, as in test_cpu_attention.cpp):
// max |cpu − ref64| ≤ 2·max |plain32 − ref64| + floor, where plain32 evaluates the
// definitions (max_j P_ij, −Σ_j P_ij ln P_ij) in float on a float P, and
// floor = 8·ε₃₂·max(1, max |ref64|). A mean over rows is off by at most its rows' worst
// error, so the per-head means get the rows' bound.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "cpu_check.hpp"
#include "simd_targets.hpp"

namespace qkv {
namespace {

using test::Case;
using test::CaseSpec;

constexpr double kThreshold = 0.3;  // random rows land on both sides of it

// Owning storage for every statistics output of a dense call.
template <class T>
struct StatsOut {
  Tensor<T, 2> max_weight_mean, max_weight_max, entropy_mean, saturated_share;
  Tensor<int64_t, 2> rows;
  Tensor<T, 3> row_max_weight, row_entropy;

  StatsOut(int64_t batch, int64_t heads, int64_t q_len)
      : max_weight_mean({batch, heads}), max_weight_max({batch, heads}),
        entropy_mean({batch, heads}), saturated_share({batch, heads}), rows({batch, heads}),
        row_max_weight({batch, heads, q_len}), row_entropy({batch, heads, q_len}) {}

  AttentionStats<T> views(double threshold = kThreshold) {
    return {.max_weight_mean = max_weight_mean.view(), .max_weight_max = max_weight_max.view(),
            .entropy_mean = entropy_mean.view(), .saturated_share = saturated_share.view(),
            .rows = rows.view(), .row_max_weight = row_max_weight.view(),
            .row_entropy = row_entropy.view(), .saturation_threshold = threshold};
  }
};

// The cpu backend's statistics (and out, lse) for a case.
struct CpuRun {
  StatsOut<float> stats;
  Tensor<float, 4> out;
  Tensor<float, 3> lse;
};

CpuRun run_cpu(const Case<float>& c, int threads, double threshold = kThreshold,
               bool with_stats = true) {
  const CaseSpec& s = c.spec;
  CpuRun r{StatsOut<float>(s.batch, s.q_heads, s.q_len),
           Tensor<float, 4>({s.batch, s.q_len, s.q_heads, s.v_dim}),
           Tensor<float, 3>({s.batch, s.q_heads, s.q_len})};
  AttentionOptions options = c.options;
  options.execution.backend = Backend::cpu;
  options.execution.threads = threads;
  const AttentionStats<float> views = r.stats.views(threshold);
  attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = r.out.view(),
                     .lse = r.lse.view(), .stats = with_stats ? &views : nullptr},
                    options);
  return r;
}

// The reference backend on the widened inputs: statistics and the materialized P.
struct ReferenceRun {
  StatsOut<double> stats;
  Tensor<double, 4> weights;
  Tensor<double, 3> lse;
};

ReferenceRun run_reference(const Case<float>& c, double threshold = kThreshold) {
  const CaseSpec& s = c.spec;
  const auto q = test::widen<double>(c.q), k = test::widen<double>(c.k), v = test::widen<double>(c.v);
  ReferenceRun r{StatsOut<double>(s.batch, s.q_heads, s.q_len),
                 Tensor<double, 4>({s.batch, s.q_heads, s.q_len, s.k_len}),
                 Tensor<double, 3>({s.batch, s.q_heads, s.q_len})};
  Tensor<double, 4> out({s.batch, s.q_len, s.q_heads, s.v_dim});
  const AttentionStats<double> views = r.stats.views(threshold);
  attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                     .lse = r.lse.view(), .weights = r.weights.view(), .stats = &views},
                    c.options);
  return r;
}

// The definitions on a materialized P, in T: per row max_j P_ij and −Σ_j P_ij ln P_ij;
// per (b, h) the means over rows with keys (lse > −inf), the max, the share > threshold.
template <class T>
StatsOut<T> stats_from_weights(const Tensor<T, 4>& weights, const Tensor<T, 3>& has_keys,
                               double threshold) {
  const auto& sh = weights.shape();
  StatsOut<T> r(sh[0], sh[1], sh[2]);
  for (int64_t b = 0; b < sh[0]; ++b)
    for (int64_t h = 0; h < sh[1]; ++h) {
      double max_sum = 0.0, entropy_sum = 0.0, largest = 0.0;
      int64_t saturated = 0, rows = 0;
      for (int64_t i = 0; i < sh[2]; ++i) {
        T max_weight = 0, entropy = 0;
        for (int64_t j = 0; j < sh[3]; ++j) {
          const T p = weights(b, h, i, j);
          max_weight = std::max(max_weight, p);
          if (p > 0) entropy -= p * std::log(p);
        }
        r.row_max_weight(b, h, i) = max_weight;
        r.row_entropy(b, h, i) = entropy;
        if (has_keys(b, h, i) == -INFINITY) continue;
        max_sum += max_weight;
        entropy_sum += entropy;
        largest = std::max<double>(largest, max_weight);
        saturated += max_weight > threshold ? 1 : 0;
        ++rows;
      }
      const double nan = std::numeric_limits<double>::quiet_NaN(), n = static_cast<double>(rows);
      r.max_weight_mean(b, h) = static_cast<T>(rows ? max_sum / n : nan);
      r.max_weight_max(b, h) = static_cast<T>(rows ? largest : nan);
      r.entropy_mean(b, h) = static_cast<T>(rows ? entropy_sum / n : nan);
      r.saturated_share(b, h) = static_cast<T>(rows ? static_cast<double>(saturated) / n : nan);
      r.rows(b, h) = rows;
    }
  return r;
}

// plain32: P in float (test::plain_fp32's loop), then the definitions in float.
struct PlainRows {
  Tensor<float, 3> max_weight, entropy;
};

PlainRows plain_fp32_rows(const Case<float>& c) {
  const CaseSpec& s = c.spec;
  const float scale =
      static_cast<float>(s.scale ? *s.scale : 1.0 / std::sqrt(static_cast<double>(s.head_dim)));
  PlainRows r{Tensor<float, 3>({s.batch, s.q_heads, s.q_len}),
              Tensor<float, 3>({s.batch, s.q_heads, s.q_len})};
  detail::MaskRule rule;
  rule.causal = s.causal;
  rule.sequences = {.count = s.batch, .dense_q_len = s.q_len, .dense_k_len = s.k_len};
  rule.key_lengths = c.key_lengths;
  std::vector<float> p(static_cast<std::size_t>(s.k_len));
  std::vector<bool> seen(static_cast<std::size_t>(s.k_len));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.q_heads; ++h)
      for (int64_t i = 0; i < s.q_len; ++i) {
        const int64_t kh = h / (s.q_heads / s.kv_heads);
        float max = -INFINITY;
        std::fill(seen.begin(), seen.end(), false);
        for (int64_t j = 0; j < rule.key_end(b, i); ++j) {
          const auto& mask = c.options.mask;
          if (!mask.keep.empty() && test::broadcast_at(mask.keep, b, h, i, j) == 0) continue;
          const float bias = mask.bias.empty() ? 0.0f : test::broadcast_at(mask.bias, b, h, i, j);
          if (bias == -INFINITY) continue;
          float dot = 0.0f;
          for (int64_t x = 0; x < s.head_dim; ++x) dot += c.q(b, i, h, x) * c.k(b, j, kh, x);
          p[j] = dot * scale + bias;
          seen[j] = true;
          max = std::max(max, p[j]);
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < s.k_len; ++j) {
          p[j] = seen[j] ? std::exp(p[j] - max) : 0.0f;
          sum += p[j];
        }
        float largest = 0.0f, entropy = 0.0f;
        for (int64_t j = 0; j < s.k_len; ++j) {
          const float pj = sum > 0.0f ? p[j] / sum : 0.0f;
          largest = std::max(largest, pj);
          if (pj > 0.0f) entropy -= pj * std::log(pj);
        }
        r.max_weight(b, h, i) = largest;
        r.entropy(b, h, i) = entropy;
      }
  return r;
}

// max |x − ref|, with NaN matching NaN (heads without rows) and nowhere else.
template <class A, class B, int R>
double nan_aware_error(const Tensor<A, R>& x, const Tensor<B, R>& ref) {
  double worst = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double a = static_cast<double>(x[i]), b = static_cast<double>(ref[i]);
    if (std::isnan(a) && std::isnan(b)) continue;
    const double e = std::abs(a - b);
    if (std::isnan(e)) return INFINITY;
    worst = std::max(worst, e);
  }
  return worst;
}

// The cpu statistics against the reference within the rule (see the file comment).
void expect_cpu_matches_reference(const Case<float>& c, const CpuRun& cpu, const ReferenceRun& ref,
                                  double threshold) {
  const PlainRows plain = plain_fp32_rows(c);
  const double eps = std::numeric_limits<float>::epsilon();
  const auto bound = [&](const Tensor<float, 3>& plain_rows, const Tensor<double, 3>& ref_rows) {
    return 2.0 * test::error(plain_rows, ref_rows) + 8.0 * eps * std::max(1.0, test::max_abs(ref_rows));
  };
  const double weight_bound = bound(plain.max_weight, ref.stats.row_max_weight);
  const double entropy_bound = bound(plain.entropy, ref.stats.row_entropy);
  EXPECT_LE(test::error(cpu.stats.row_max_weight, ref.stats.row_max_weight), weight_bound);
  EXPECT_LE(test::error(cpu.stats.row_entropy, ref.stats.row_entropy), entropy_bound);
  EXPECT_LE(nan_aware_error(cpu.stats.max_weight_mean, ref.stats.max_weight_mean), weight_bound);
  EXPECT_LE(nan_aware_error(cpu.stats.max_weight_max, ref.stats.max_weight_max), weight_bound);
  EXPECT_LE(nan_aware_error(cpu.stats.entropy_mean, ref.stats.entropy_mean), entropy_bound);
  for (std::size_t i = 0; i < cpu.stats.rows.size(); ++i)
    EXPECT_EQ(cpu.stats.rows[i], ref.stats.rows[i]) << "rows, head " << i;

  // Saturated rows: the same, except rows whose reference weight lies within the
  // tolerance of the threshold (either side is right for those).
  const CaseSpec& s = c.spec;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.q_heads; ++h) {
      int64_t cpu_saturated = 0, ref_saturated = 0, ambiguous = 0;
      for (int64_t i = 0; i < s.q_len; ++i) {
        if (ref.lse(b, h, i) == -INFINITY) continue;
        const double w = ref.stats.row_max_weight(b, h, i);
        ref_saturated += w > threshold;
        cpu_saturated += cpu.stats.row_max_weight(b, h, i) > threshold;
        ambiguous += std::abs(w - threshold) <= weight_bound;
      }
      const int64_t rows = cpu.stats.rows(b, h);
      if (rows == 0) {
        EXPECT_TRUE(std::isnan(cpu.stats.saturated_share(b, h)));
        continue;
      }
      // The share is the cpu's own per-row values counted (exactly, up to one rounding).
      EXPECT_EQ(cpu.stats.saturated_share(b, h),
                static_cast<float>(static_cast<double>(cpu_saturated) / static_cast<double>(rows)));
      EXPECT_LE(std::abs(cpu_saturated - ref_saturated), ambiguous) << "b " << b << " h " << h;
    }
}

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

// ---- variants ----------------------------------------------------------------------

// Every variant changes P, and the statistics are those of the P the call computes.
// Tolerance: the plain-float yardstick above does not model the variants, so a fixed one:
// on these shapes (O(1) logits, ≤ 200 keys) the cpu rows are within 2e-6 of the
// reference without variants (measured); 2e-5 leaves 10× room and still fails any wrong
// term, which moves a row's values by far more.
TEST(AttentionStats, VariantsMatchTheReference) {
  const CaseSpec spec{.name = "variants", .batch = 2, .q_len = 150, .k_len = 170, .q_heads = 4,
                      .kv_heads = 2, .head_dim = 32, .v_dim = 16, .causal = Causal::bottom_right,
                      .key_padding = true};
  const std::vector<float> slopes{0.5f, 0.25f, 0.125f, 0.0625f}, sinks{0.5f, -1.0f, 2.0f, 0.0f};
  for (int variant = 0; variant < 5; ++variant) {
    Case<float> c(spec, 50 + variant);
    const char* names[] = {"window", "alibi", "softcap", "sinks", "all"};
    SCOPED_TRACE(names[variant]);
    if (variant == 0 || variant == 4) c.options.window = {.left = 40, .right = 0};
    if (variant == 1 || variant == 4) c.options.alibi_slopes = slopes;
    if (variant == 2 || variant == 4) c.options.softcap = 2.0f;
    if (variant == 3 || variant == 4) c.options.sinks = sinks;
    const CpuRun cpu = run_cpu(c, 2);
    const ReferenceRun ref = run_reference(c);
    EXPECT_LE(test::error(cpu.stats.row_max_weight, ref.stats.row_max_weight), 2e-5);
    EXPECT_LE(test::error(cpu.stats.row_entropy, ref.stats.row_entropy), 2e-5);
    EXPECT_LE(nan_aware_error(cpu.stats.max_weight_mean, ref.stats.max_weight_mean), 2e-5);
    EXPECT_LE(nan_aware_error(cpu.stats.entropy_mean, ref.stats.entropy_mean), 2e-5);
    EXPECT_LE(nan_aware_error(cpu.stats.rows, ref.stats.rows), 0.0);
  }
}

// A sink is an entry of the softmax without a value: it is part of the distribution the
// statistics describe (weight 1 − Σ_j P_ij), and a row whose keys are all masked but
// that has a sink is counted (all its weight on the sink: 1 and 0).
TEST(AttentionStats, SinksJoinTheDistribution) {
  Case<float> c({.name = "sinks", .batch = 2, .q_len = 20, .k_len = 30, .q_heads = 2,
                 .kv_heads = 1, .head_dim = 8, .v_dim = 8, .key_padding = true},
                60);
  const std::vector<float> sinks{1.5f, -0.5f};
  const std::vector<int64_t> lengths{30, 0};
  c.options.sinks = sinks;
  c.options.key_lengths = lengths;
  const ReferenceRun ref = run_reference(c);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 2; ++h) {
      EXPECT_EQ(ref.stats.rows(b, h), 20);
      for (int64_t i = 0; i < 20; ++i) {
        double keys = 0.0, largest = 0.0, entropy = 0.0;
        for (int64_t j = 0; j < 30; ++j) {
          const double p = ref.weights(b, h, i, j);
          keys += p;
          largest = std::max(largest, p);
          if (p > 0) entropy -= p * std::log(p);
        }
        const double sink = 1.0 - keys;
        largest = std::max(largest, sink);
        if (sink > 0) entropy -= sink * std::log(sink);
        EXPECT_NEAR(ref.stats.row_max_weight(b, h, i), largest, 1e-12);
        EXPECT_NEAR(ref.stats.row_entropy(b, h, i), entropy, 1e-12);
      }
    }
  const CpuRun cpu = run_cpu(c, 2);
  EXPECT_LE(test::error(cpu.stats.row_entropy, ref.stats.row_entropy), 2e-5);
  EXPECT_EQ(cpu.stats.rows(1, 0), 20);
  EXPECT_EQ(cpu.stats.max_weight_mean(1, 0), 1.0f);
  EXPECT_EQ(cpu.stats.entropy_mean(1, 0), 0.0f);
}

// Dropout acts after the softmax: the statistics are those of P itself, the same bits as
// without dropout.
TEST(AttentionStats, DropoutLeavesTheStatisticsOfP) {
  Case<float> c({.name = "dropout", .batch = 2, .q_len = 100, .k_len = 100, .q_heads = 2,
                 .kv_heads = 2, .head_dim = 16, .v_dim = 16, .causal = Causal::top_left},
                61);
  const CpuRun plain = run_cpu(c, 2);
  c.options.dropout = {.p = 0.3f, .seed = 7};
  const CpuRun dropped = run_cpu(c, 2);
  const auto same = [](const auto& a, const auto& b) {
    return std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
  };
  EXPECT_FALSE(same(plain.out, dropped.out));
  EXPECT_TRUE(same(plain.stats.row_entropy, dropped.stats.row_entropy));
  EXPECT_TRUE(same(plain.stats.entropy_mean, dropped.stats.entropy_mean));
  EXPECT_TRUE(same(plain.stats.max_weight_max, dropped.stats.max_weight_max));
}

// Decode shapes (≤ 16 queries) with statistics run the tiled forward: same statistics as
// the reference, and out as the decode kernel would give it within the usual rounding.
TEST(AttentionStats, DecodeShapesGetStatistics) {
  const Case<float> c({.name = "decode", .batch = 3, .q_len = 4, .k_len = 500, .q_heads = 8,
                       .kv_heads = 2, .head_dim = 64, .v_dim = 64, .causal = Causal::bottom_right,
                       .key_padding = true},
                      62);
  const CpuRun with = run_cpu(c, 2);
  const CpuRun without = run_cpu(c, 2, kThreshold, /*with_stats=*/false);
  expect_cpu_matches_reference(c, with, run_reference(c), kThreshold);
  EXPECT_LE(test::max_abs_diff(with.out, without.out), 1e-5);
}

// 16-bit storage: the kernel widens q, k, v exactly to float, so the statistics (float,
// like lse) are the bits of a float call on the widened values.
TEST(AttentionStats, HalfStorageGivesTheFloatStatisticsOfTheWidenedInputs) {
  const CaseSpec spec{.name = "half", .batch = 2, .q_len = 70, .k_len = 90, .q_heads = 4,
                      .kv_heads = 2, .head_dim = 32, .v_dim = 16, .causal = Causal::bottom_right,
                      .key_padding = true};
  Case<float> c(spec, 63);
  Tensor<bfloat16, 4> q(c.q.shape()), k(c.k.shape()), v(c.v.shape());
  for (auto [half, full] : {std::pair{&q, &c.q}, std::pair{&k, &c.k}, std::pair{&v, &c.v}})
    for (std::size_t i = 0; i < half->size(); ++i) {
      (*half)[i] = bfloat16((*full)[i]);
      (*full)[i] = static_cast<float>((*half)[i]);  // the float call sees the same values
    }
  const CpuRun widened = run_cpu(c, 2);
  StatsOut<float> stats(spec.batch, spec.q_heads, spec.q_len);
  const AttentionStats<float> views = stats.views();
  Tensor<bfloat16, 4> out({spec.batch, spec.q_len, spec.q_heads, spec.v_dim});
  AttentionOptions options = c.options;
  options.execution.backend = Backend::cpu;
  options.execution.threads = 2;
  attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                     .stats = &views},
                    options);
  const auto same = [](const auto& a, const auto& b) {
    return std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
  };
  EXPECT_TRUE(same(stats.row_entropy, widened.stats.row_entropy));
  EXPECT_TRUE(same(stats.row_max_weight, widened.stats.row_max_weight));
  EXPECT_TRUE(same(stats.entropy_mean, widened.stats.entropy_mean));
  EXPECT_TRUE(same(stats.rows, widened.stats.rows));
}

// ---- varlen ------------------------------------------------------------------------

// Each sequence of a packed call gets the statistics of a dense call on it alone.
TEST(AttentionStats, VarlenEqualsDenseCallsPerSequence) {
  const std::vector<int64_t> q_lens{5, 0, 70, 3, 2}, k_lens{7, 3, 90, 0, 2};
  const int64_t q_heads = 4, kv_heads = 2, d = 24, dv = 16;
  std::vector<int64_t> cu_q{0}, cu_k{0};
  for (std::size_t s = 0; s < q_lens.size(); ++s) {
    cu_q.push_back(cu_q.back() + q_lens[s]);
    cu_k.push_back(cu_k.back() + k_lens[s]);
  }
  const int64_t seqs = static_cast<int64_t>(q_lens.size()), total_q = cu_q.back();
  const auto q = test::random_tensor<float, 3>({total_q, q_heads, d}, 31);
  const auto k = test::random_tensor<float, 3>({cu_k.back(), kv_heads, d}, 32);
  const auto v = test::random_tensor<float, 3>({cu_k.back(), kv_heads, dv}, 33);
  for (const Causal causal : {Causal::none, Causal::bottom_right}) {
    for (const Backend backend : {Backend::cpu, Backend::reference}) {
      SCOPED_TRACE(backend == Backend::cpu ? "cpu" : "reference");
      AttentionOptions options;
      options.causal = causal;
      options.execution.backend = backend;
      Tensor<float, 3> out({total_q, q_heads, dv});
      Tensor<float, 2> mean_weight({seqs, q_heads}), max_weight({seqs, q_heads}),
          mean_entropy({seqs, q_heads}), share({seqs, q_heads});
      Tensor<int64_t, 2> rows({seqs, q_heads});
      Tensor<float, 2> row_weight({q_heads, total_q}), row_entropy({q_heads, total_q});
      const VarlenAttentionStats<float> views{
          .max_weight_mean = mean_weight.view(), .max_weight_max = max_weight.view(),
          .entropy_mean = mean_entropy.view(), .saturated_share = share.view(),
          .rows = rows.view(), .row_max_weight = row_weight.view(),
          .row_entropy = row_entropy.view(), .saturation_threshold = kThreshold};
      varlen_attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                                .cu_seqlens_q = std::span<const int64_t>(cu_q),
                                .cu_seqlens_k = std::span<const int64_t>(cu_k), .stats = &views},
                               options);
      for (int64_t s = 0; s < seqs; ++s) {
        // The sequence alone, as a dense [1, n, h, d] call (views into the packed arrays).
        const int64_t nq = q_lens[s], nk = k_lens[s];
        const View4<const float> sq(q.data() + cu_q[s] * q_heads * d, {1, nq, q_heads, d},
                                    {0, q_heads * d, d, 1});
        const View4<const float> sk(k.data() + cu_k[s] * kv_heads * d, {1, nk, kv_heads, d},
                                    {0, kv_heads * d, d, 1});
        const View4<const float> sv(v.data() + cu_k[s] * kv_heads * dv, {1, nk, kv_heads, dv},
                                    {0, kv_heads * dv, dv, 1});
        Tensor<float, 4> dense_out({1, nq, q_heads, dv});
        StatsOut<float> dense(1, q_heads, nq);
        const AttentionStats<float> dense_views = dense.views();
        attention_forward({.q = sq, .k = sk, .v = sv, .out = dense_out.view(), .stats = &dense_views},
                          options);
        for (int64_t h = 0; h < q_heads; ++h) {
          EXPECT_EQ(rows(s, h), dense.rows(0, h)) << "sequence " << s;
          const auto same = [](float a, float b) { return (std::isnan(a) && std::isnan(b)) || a == b; };
          EXPECT_TRUE(same(mean_weight(s, h), dense.max_weight_mean(0, h))) << "sequence " << s;
          EXPECT_TRUE(same(max_weight(s, h), dense.max_weight_max(0, h))) << "sequence " << s;
          EXPECT_TRUE(same(mean_entropy(s, h), dense.entropy_mean(0, h))) << "sequence " << s;
          EXPECT_TRUE(same(share(s, h), dense.saturated_share(0, h))) << "sequence " << s;
          for (int64_t i = 0; i < nq; ++i) {
            EXPECT_EQ(row_weight(h, cu_q[s] + i), dense.row_max_weight(0, h, i));
            EXPECT_EQ(row_entropy(h, cu_q[s] + i), dense.row_entropy(0, h, i));
          }
        }
      }
    }
  }
}

// ---- errors ------------------------------------------------------------------------

constexpr float kSentinel = 12345.0f;

struct StatsCall {
  Tensor<float, 4> q = test::random_tensor<float, 4>({2, 3, 4, 5}, 1);
  Tensor<float, 4> k = test::random_tensor<float, 4>({2, 4, 2, 5}, 2);
  Tensor<float, 4> v = test::random_tensor<float, 4>({2, 4, 2, 6}, 3);
  Tensor<float, 4> out{{2, 3, 4, 6}};
  StatsOut<float> stats{2, 4, 3};
  AttentionStats<float> views = stats.views();

  void run() {
    attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                       .stats = &views});
  }
  bool untouched() const {
    for (std::size_t i = 0; i < out.size(); ++i)
      if (out[i] != kSentinel) return false;
    for (const auto* t : {&stats.row_max_weight, &stats.row_entropy})
      for (std::size_t i = 0; i < t->size(); ++i)
        if ((*t)[i] != kSentinel) return false;
    for (const auto* t : {&stats.max_weight_mean, &stats.entropy_mean})
      for (std::size_t i = 0; i < t->size(); ++i)
        if ((*t)[i] != kSentinel) return false;
    return true;
  }
};

void expect_stats_error(const std::function<void(StatsCall&)>& breaking,
                        std::initializer_list<std::string> fragments) {
  StatsCall call;
  test::fill(call.out, kSentinel);
  for (auto* t : {&call.stats.row_max_weight, &call.stats.row_entropy}) test::fill(*t, kSentinel);
  for (auto* t : {&call.stats.max_weight_mean, &call.stats.entropy_mean}) test::fill(*t, kSentinel);
  breaking(call);
  try {
    call.run();
    ADD_FAILURE() << "expected qkv::Error";
  } catch (const Error& e) {
    const std::string message = e.what();
    for (const std::string& fragment : fragments)
      EXPECT_NE(message.find(fragment), std::string::npos) << "message: " << message;
  }
  EXPECT_TRUE(call.untouched()) << "an output was written before the error";
}

TEST(AttentionStatsErrors, WrongShapesThresholdAliasing) {
  expect_stats_error([](StatsCall& c) { c.views.max_weight_mean.shape = {2, 3}; },
                     {"qkv::attention_forward", "stats.max_weight_mean.shape[1] (heads)",
                      "expected 4", "got 3"});
  expect_stats_error([](StatsCall& c) { c.views.rows.shape = {1, 4}; },
                     {"stats.rows.shape[0] (batch)", "expected 2", "got 1"});
  expect_stats_error([](StatsCall& c) { c.views.saturated_share.shape = {2, 5}; },
                     {"stats.saturated_share.shape[1]"});
  expect_stats_error([](StatsCall& c) { c.views.entropy_mean.strides = {1, 2}; },
                     {"stats.entropy_mean.strides[1]", "contiguous"});
  expect_stats_error([](StatsCall& c) { c.views.row_entropy.shape = {2, 4, 4}; },
                     {"stats.row_entropy.shape[2] (seq)", "expected 3", "got 4"});
  expect_stats_error([](StatsCall& c) { c.views.row_max_weight.shape = {2, 2, 3}; },
                     {"stats.row_max_weight.shape[1] (heads)"});
  expect_stats_error([](StatsCall& c) { c.views.saturation_threshold = 1.5; },
                     {"stats.saturation_threshold", "[0, 1]", "1.5"});
  expect_stats_error([](StatsCall& c) { c.views.saturation_threshold = std::nan(""); },
                     {"stats.saturation_threshold"});
  expect_stats_error([](StatsCall& c) { c.views = AttentionStats<float>{}; },
                     {"stats: expected at least one output view"});
  expect_stats_error(
      [](StatsCall& c) {
        c.views.row_entropy = View3<float>(c.out.data(), {2, 4, 3}, {12, 3, 1});
      },
      {"stats.row_entropy", "must not share memory", "out"});
  expect_stats_error(
      [](StatsCall& c) { c.views.entropy_mean = c.stats.max_weight_mean.view(); },
      {"must not share memory", "stats.max_weight_mean"});
  expect_stats_error(
      [](StatsCall& c) {
        c.views.max_weight_mean = TensorView<float, 2>(c.q.data(), {2, 4}, {4, 1});
      },
      {"stats.max_weight_mean", "must not share memory with q"});
}

TEST(AttentionStatsErrors, VarlenShapes) {
  const std::vector<int64_t> cu{0, 2, 5};
  const auto q = test::random_tensor<float, 3>({5, 2, 4}, 1);
  const auto k = test::random_tensor<float, 3>({5, 1, 4}, 2);
  Tensor<float, 3> out({5, 2, 4});
  Tensor<float, 2> per_sequence({3, 2}), per_row({2, 6});
  const auto expect = [&](const VarlenAttentionStats<float>& views, const std::string& fragment) {
    try {
      varlen_attention_forward({.q = q.cview(), .k = k.cview(), .v = k.cview(), .out = out.view(),
                                .cu_seqlens_q = std::span<const int64_t>(cu),
                                .cu_seqlens_k = std::span<const int64_t>(cu), .stats = &views});
      ADD_FAILURE() << "expected qkv::Error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  expect({.max_weight_mean = per_sequence.view()},
         "stats.max_weight_mean.shape[0] (sequences): expected 2");
  expect({.row_entropy = per_row.view()}, "stats.row_entropy.shape[1] (total_q): expected 5");
}

}  // namespace
}  // namespace qkv
