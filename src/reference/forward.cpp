// Reference forward: S = scale·Q·Kᵀ (+ mask), P = softmax(S), O = P·V, all in double.
// Softmax statistics come straight from the definitions on the materialized P_i
// (max_j P_ij and −Σ_j P_ij ln P_ij): the oracle for the cpu backend's online version.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "core/head_stats.hpp"
#include "reference/key_values.hpp"
#include "reference/reference.hpp"
#include "reference/scores.hpp"

namespace qkv::reference {
namespace {

// Largest weight and entropy of one row of P; NaN when the row is poisoned (lse NaN).
struct RowHealth {
  double max_weight = 0.0, entropy = 0.0;
};

RowHealth row_health(const std::vector<double>& weights, double lse) {
  RowHealth health;
  if (std::isnan(lse)) return {lse, lse};
  for (double p : weights) {
    health.max_weight = std::max(health.max_weight, p);
    if (p > 0.0) health.entropy -= p * std::log(p);  // 0·ln 0 = 0
  }
  return health;
}

// K and V through `kv` (reference/key_values.hpp): the call's views, or a cache's source.
template <class T, class KeyValues>
void forward_rows(const detail::ForwardProblem<T>& problem, const KeyValues& kv) {
  const detail::Extents& e = problem.extents;
  const auto& args = problem.args;
  const auto& mods = problem.modifiers;
  const auto rows = problem.rows();
  RowScores row;
  std::vector<double> row_out(e.v_dim);
  for (int64_t b = 0; b < e.batch; ++b) {
    const int64_t k_len = problem.mask.sequences.k_len(b);
    for (int64_t h = 0; h < e.q_heads; ++h) {
      const int64_t kv_head = e.kv_head_of(h);
      detail::HeadStatsSum head_stats;
      const uint32_t head_key =
          detail::dropout_head_key(mods.dropout.seed, mods.dropout.offset, b, h);
      for (int64_t i = 0; i < problem.mask.q_len(b); ++i) {
        score_row(e, problem.mask, mods, problem.scale, rows, kv, b, h, i, row);
        const uint32_t row_key = detail::dropout_row_key(head_key, i);
        // O_i = Σ_j P_ij · Z_ij · V_j over the keys that take part (a removed key's V is
        // never read, so a NaN there cannot leak into rows that do not see it; Z is the
        // dropout factor — a dropped key still takes part, so its NaN still shows, as in
        // PyTorch; the sink has no value).
        std::fill(row_out.begin(), row_out.end(), 0.0);
        for (int64_t j = 0; j < k_len; ++j) {
          if (row.scores[j] == -INFINITY) continue;
          const double weight = row.weights[j] * dropout_factor(mods, row_key, j);
          for (int64_t c = 0; c < e.v_dim; ++c) row_out[c] += weight * kv.value(b, j, kv_head, c);
        }
        T* out = rows.out(b, i, h);
        for (int64_t c = 0; c < e.v_dim; ++c) out[c] = store_as<T>(row_out[c]);
        if (!args.lse.empty()) rows.lse(b, h, i) = static_cast<LseOf<T>>(row.lse);
        if (!args.weights.empty()) {  // dense calls only (varlen has no weights output)
          for (int64_t j = 0; j < k_len; ++j) {
            args.weights(b, h, i, j) = store_as<T>(row.weights[j]);
          }
        }
        if (problem.collect_stats) {
          // Of P before dropout, the sink included. A row without keys (lse = -inf) has
          // no distribution: 0s, and not counted.
          const RowHealth health = row_health(row.weights, row.lse);
          detail::write_row_stats(problem, b, h, i, health.max_weight, health.entropy);
          if (row.lse != -INFINITY) {
            head_stats.add_row(health.max_weight, health.entropy,
                               problem.stats.saturation_threshold);
          }
        }
      }
      if (problem.collect_stats) detail::write_head_stats(problem.stats, b, h, head_stats);
    }
  }
}

template <class T>
void forward_impl(const detail::ForwardProblem<T>& problem) {
  if constexpr (std::is_same_v<T, float>) {
    if (!problem.kv_in_args()) return forward_rows(problem, SourceKeyValues{problem.kv});
  }
  const auto rows = problem.rows();
  forward_rows(problem, ViewKeyValues<decltype(rows)>{rows});
}

}  // namespace

void forward(const detail::ForwardProblem<float>& problem) { forward_impl(problem); }
void forward(const detail::ForwardProblem<double>& problem) { forward_impl(problem); }
void forward(const detail::ForwardProblem<bfloat16>& problem) { forward_impl(problem); }
void forward(const detail::ForwardProblem<float16>& problem) { forward_impl(problem); }

}  // namespace qkv::reference
