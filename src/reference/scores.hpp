// One row of scores and weights as the reference computes them, shared by its forward
// and backward so both see the very same P.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/dropout.hpp"
#include "core/problem.hpp"
#include "core/score_pipeline.hpp"
#include "reference/softmax_row.hpp"

namespace qkv::reference {

// An exact (double) result stored in T. The 16-bit types round through float.
template <class T>
T store_as(double value) {
  if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>) {
    return T(static_cast<float>(value));
  } else {
    return static_cast<T>(value);
  }
}

// One query row as the reference sees it: the logits of the keys of q_i's sequence (keys
// that do not take part at −inf, never read), then the sink logit when the call has sinks
// (index k_len: a key without a value), the softmax of all of them, and for the backward
// d logit / d (scale·q·k): the soft-cap's 1 − tanh² times score_mod's derivative (1
// without them).
struct RowScores {
  std::vector<double> scores, weights, slope;
  double lse = 0.0;
};

//   s_ij = scale·q_i·k_j through the score pipeline;  P_i = softmax(s_i ∪ {sink_h}).
// `rows` gives the queries, `kv` the keys (reference/key_values.hpp).
template <class Rows, class KeyValues>
void score_row(const detail::Extents& e, const detail::MaskRule& mask,
               const detail::ScoreModifiers& mods, double scale, const Rows& rows,
               const KeyValues& kv, int64_t b, int64_t h, int64_t i, RowScores& row) {
  const int64_t kv_head = e.kv_head_of(h);
  const int64_t k_len = mask.sequences.k_len(b);
  const int64_t key_begin = mask.key_begin(b, i), key_end = mask.key_end(b, i);
  const bool degenerate = mask.degenerate_row(b, h, i);
  const int64_t entries = k_len + (mods.has_sinks() ? 1 : 0);
  row.scores.assign(entries, -std::numeric_limits<double>::infinity());
  row.weights.assign(entries, 0.0);
  row.slope.assign(k_len, 1.0);
  const auto* q = rows.q(b, i, h);
  for (int64_t j = key_begin; j < key_end; ++j) {
    if (!mask.takes_part(b, h, i, j, degenerate)) continue;
    double dot = 0.0;
    for (int64_t c = 0; c < e.head_dim; ++c) dot += static_cast<double>(q[c]) * kv.key(b, j, kv_head, c);
    double logit = scale * dot;
    detail::apply_score_pipeline(mods, detail::ElementStages{mask, mods, b, h, i, j, logit, row.slope[j]});
    row.scores[j] = logit;
  }
  if (mods.has_sinks()) row.scores[k_len] = mods.sinks[h];
  row.lse = detail::softmax_row(row.scores.data(), row.weights.data(), entries);
}

// Dropout's factor for weight (i, j): 0 if dropped, 1/(1 − p) if kept (1 without dropout).
inline double dropout_factor(const detail::ScoreModifiers& mods, uint32_t row_key, int64_t j) {
  if (!mods.has_dropout()) return 1.0;
  const bool kept = detail::dropout_bits(row_key, j) >= detail::dropout_threshold(mods.dropout.p);
  return kept ? 1.0 / (1.0 - static_cast<double>(mods.dropout.p)) : 0.0;
}

}  // namespace qkv::reference
