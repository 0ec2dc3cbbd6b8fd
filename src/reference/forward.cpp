// Reference forward: S = scale·Q·Kᵀ (+ mask), P = softmax(S), O = P·V, all in double.
// Softmax statistics come straight from the definitions on the materialized P_i
// (max_j P_ij and −Σ_j P_ij ln P_ij): the oracle for the cpu backend's online version.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/head_stats.hpp"
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

template <class T>
void forward_impl(const detail::ForwardProblem<T>& problem) {
  const detail::Extents& e = problem.extents;
  const auto& args = problem.args;
  const auto rows = problem.rows();
  std::vector<double> scores, weights, row_out(e.v_dim);
  for (int64_t b = 0; b < e.batch; ++b) {
    for (int64_t h = 0; h < e.q_heads; ++h) {
      const int64_t kv_head = e.kv_head_of(h);
      detail::HeadStatsSum head_stats;
      for (int64_t i = 0; i < problem.mask.q_len(b); ++i) {
        const double lse =
            score_row(e, problem.mask, problem.scale, rows, b, h, i, scores, weights);
        // O_i = Σ_j P_ij · V_j over the keys that take part (a removed key's V is never
        // read, so a NaN there cannot leak into rows that do not see it).
        std::fill(row_out.begin(), row_out.end(), 0.0);
        for (std::size_t j = 0; j < scores.size(); ++j) {
          if (scores[j] == -INFINITY) continue;
          const T* v = rows.v(b, static_cast<int64_t>(j), kv_head);
          for (int64_t c = 0; c < e.v_dim; ++c) row_out[c] += weights[j] * static_cast<double>(v[c]);
        }
        T* out = rows.out(b, i, h);
        for (int64_t c = 0; c < e.v_dim; ++c) out[c] = static_cast<T>(row_out[c]);
        if (!args.lse.empty()) rows.lse(b, h, i) = static_cast<T>(lse);
        if (!args.weights.empty()) {  // dense calls only (varlen has no weights output)
          for (std::size_t j = 0; j < weights.size(); ++j) {
            args.weights(b, h, i, static_cast<int64_t>(j)) = static_cast<T>(weights[j]);
          }
        }
        if (problem.collect_stats) {
          // A row without keys (lse = -inf) has no distribution: 0s, and not counted.
          const RowHealth health = row_health(weights, lse);
          detail::write_row_stats(problem, b, h, i, health.max_weight, health.entropy);
          if (lse != -INFINITY) {
            head_stats.add_row(health.max_weight, health.entropy,
                               problem.stats.saturation_threshold);
          }
        }
      }
      if (problem.collect_stats) detail::write_head_stats(problem.stats, b, h, head_stats);
    }
  }
}

}  // namespace

void forward(const detail::ForwardProblem<float>& problem) { forward_impl(problem); }
void forward(const detail::ForwardProblem<double>& problem) { forward_impl(problem); }

}  // namespace qkv::reference
