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

//   s_ij = scale·q_i·k_j;  s_ij ← c·tanh(s_ij/c) (soft-cap c);  s_ij += −slope_h·|i + off − j|
//   (ALiBi);  s_ij ← score_mod(s_ij, b, h, i, j);  s_ij += bias_ij (mask);
//   P_i = softmax(s_i ∪ {sink_h}). mask_mod removes keys through MaskRule::takes_part.
template <class Rows>
void score_row(const detail::Extents& e, const detail::MaskRule& mask,
               const detail::ScoreModifiers& mods, double scale, const Rows& rows, int64_t b,
               int64_t h, int64_t i, RowScores& row) {
  const int64_t kv_head = e.kv_head_of(h);
  const int64_t k_len = mask.sequences.k_len(b);
  const int64_t key_begin = mask.key_begin(b, i), key_end = mask.key_end(b, i);
  const bool degenerate = mask.degenerate_row(b, h, i);
  const int64_t entries = k_len + (mods.has_sinks() ? 1 : 0);
  row.scores.assign(entries, -std::numeric_limits<double>::infinity());
  row.weights.assign(entries, 0.0);
  row.slope.assign(k_len, 1.0);
  const auto* q = rows.q(b, i, h);
  const double cap = mods.softcap;
  const double slope = mods.has_alibi() ? mods.alibi_slopes[h] : 0.0;
  const int64_t offset = detail::ScoreModifiers::alibi_offset(mask, b);
  const ScoreModHook& score_mod = mods.score_mod;
  for (int64_t j = key_begin; j < key_end; ++j) {
    if (!mask.takes_part(b, h, i, j, degenerate)) continue;
    const auto* k = rows.k(b, j, kv_head);
    double dot = 0.0;
    for (int64_t c = 0; c < e.head_dim; ++c) {
      dot += static_cast<double>(q[c]) * static_cast<double>(k[c]);
    }
    double logit = scale * dot;
    if (cap > 0.0) {
      const double t = std::tanh(logit / cap);
      logit = cap * t;
      row.slope[j] = 1.0 - t * t;
    }
    logit -= slope * static_cast<double>(std::abs(i + offset - j));
    if (score_mod.active()) {  // in double when the user's callable allows it
      if (score_mod.derivative != nullptr)
        row.slope[j] *= score_mod.derivative(score_mod.context, logit, b, h, i, j);
      logit = score_mod.value(score_mod.context, logit, b, h, i, j);
    }
    row.scores[j] = logit + static_cast<double>(mask.bias_at(b, h, i, j));
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
