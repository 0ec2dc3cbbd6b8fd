// Softmax statistics (qkv/attention_stats.hpp) as every backend writes them: per-row
// values into the row views, and the per-(batch entry, head) reduction. Backends only
// supply each counted row's largest weight and entropy; the sums, the saturation count
// and the output format live here, once.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "core/problem.hpp"

namespace qkv::detail {

// Sums over counted rows (rows with at least one key) of one (batch entry, head), or of
// a part of them. Sums in double: the means stay exact to float rounding whatever the
// row count. Deterministic as long as rows and parts are added in a fixed order.
struct HeadStatsSum {
  double max_weight = 0.0;      // Σ largest weight
  double entropy = 0.0;         // Σ entropy
  double max_weight_max = 0.0;  // max largest weight
  int64_t saturated = 0;        // rows with largest weight > threshold
  int64_t rows = 0;

  void add_row(double row_max_weight, double row_entropy, double threshold) {
    max_weight += row_max_weight;
    entropy += row_entropy;
    // NaN (a poisoned row) must show in the maximum too: std::max would drop it.
    max_weight_max = (row_max_weight > max_weight_max || row_max_weight != row_max_weight)
                         ? row_max_weight
                         : max_weight_max;
    saturated += row_max_weight > threshold ? 1 : 0;
    rows += 1;
  }
  void add(const HeadStatsSum& other) {
    max_weight += other.max_weight;
    entropy += other.entropy;
    if (other.rows > 0 && (other.max_weight_max > max_weight_max ||
                           other.max_weight_max != other.max_weight_max))
      max_weight_max = other.max_weight_max;
    saturated += other.saturated;
    rows += other.rows;
  }
};

// Writes the per-(entry, head) outputs that are set; no counted rows: NaN and rows = 0.
template <class T, int R>
void write_head_stats(const BasicAttentionStats<T, R>& stats, int64_t b, int64_t h,
                      const HeadStatsSum& sum) {
  const double none = std::numeric_limits<double>::quiet_NaN();
  const double n = static_cast<double>(sum.rows);
  const bool counted = sum.rows > 0;
  if (!stats.max_weight_mean.empty())
    stats.max_weight_mean(b, h) = static_cast<T>(counted ? sum.max_weight / n : none);
  if (!stats.max_weight_max.empty())
    stats.max_weight_max(b, h) = static_cast<T>(counted ? sum.max_weight_max : none);
  if (!stats.entropy_mean.empty())
    stats.entropy_mean(b, h) = static_cast<T>(counted ? sum.entropy / n : none);
  if (!stats.saturated_share.empty())
    stats.saturated_share(b, h) = static_cast<T>(counted ? static_cast<double>(sum.saturated) / n : none);
  if (!stats.rows.empty()) stats.rows(b, h) = sum.rows;
}

// Per-row outputs of query row i of entry b (an index within its sequence).
template <class T>
void write_row_stats(const ForwardProblem<T>& p, int64_t b, int64_t h, int64_t i,
                     double max_weight, double entropy) {
  using Out = LseOf<T>;  // float for the 16-bit storage types
  const int64_t row = p.sequences().q_begin(b) + i;
  if (!p.stats.row_max_weight.empty()) p.stats.row_max_weight(b, h, row) = static_cast<Out>(max_weight);
  if (!p.stats.row_entropy.empty()) p.stats.row_entropy(b, h, row) = static_cast<Out>(entropy);
}

}  // namespace qkv::detail
