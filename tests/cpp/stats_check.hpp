// The softmax statistics of the forward (qkv/attention_stats.hpp) for the stats tests:
// runs on the cpu and reference backends with every statistics view, the definitions
// evaluated on a materialized P, and the cpu-against-reference check.
//
// Tolerance for the cpu backend (the project's rule, as in test_cpu_attention.cpp):
// max |cpu − ref64| ≤ 2·max |plain32 − ref64| + floor, where plain32 evaluates the
// definitions (max_j P_ij, −Σ_j P_ij ln P_ij) in float on a float P, and
// floor = 8·ε₃₂·max(1, max |ref64|). A mean over rows is off by at most its rows' worst
// error, so the per-head means get the rows' bound.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_check.hpp"

namespace qkv::test::stats {

inline constexpr double kThreshold = 0.3;  // random rows land on both sides of it

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

inline CpuRun run_cpu(const Case<float>& c, int threads, double threshold = kThreshold,
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

inline ReferenceRun run_reference(const Case<float>& c, double threshold = kThreshold) {
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

inline PlainRows plain_fp32_rows(const Case<float>& c) {
  const CaseSpec& s = c.spec;
  const float scale = test::plain_scale(s);
  PlainRows r{Tensor<float, 3>({s.batch, s.q_heads, s.q_len}),
              Tensor<float, 3>({s.batch, s.q_heads, s.q_len})};
  const detail::MaskRule rule = test::plain_rule(c);
  std::vector<float> p(static_cast<std::size_t>(s.k_len));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.q_heads; ++h)
      for (int64_t i = 0; i < s.q_len; ++i) {
        test::plain_fp32_row(c, rule, scale, b, h, i, p);
        float largest = 0.0f, entropy = 0.0f;
        for (int64_t j = 0; j < s.k_len; ++j) {
          const float pj = p[j];
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
inline void expect_cpu_matches_reference(const Case<float>& c, const CpuRun& cpu,
                                         const ReferenceRun& ref, double threshold) {
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

}  // namespace qkv::test::stats
