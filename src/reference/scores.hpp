// One row of scores and weights as the reference computes them, shared by its forward
// and backward so both see the very same P.
#pragma once

#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

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

// S_i = scale · q_i·K ᵀ + bias_i over the keys of q_i's sequence, with keys that do not
// take part (core/problem.hpp, MaskRule) at -inf and never read; then P_i = softmax(S_i).
// Returns lse_i. `scores` and `weights` are resized to the sequence's key count.
template <class Rows>
double score_row(const detail::Extents& e, const detail::MaskRule& mask, double scale,
                 const Rows& rows, int64_t b, int64_t h, int64_t i, std::vector<double>& scores,
                 std::vector<double>& weights) {
  const int64_t kv_head = e.kv_head_of(h);
  const int64_t k_len = mask.sequences.k_len(b);
  const int64_t key_end = mask.key_end(b, i);
  const bool degenerate = mask.degenerate_row(b, h, i);
  scores.assign(k_len, -std::numeric_limits<double>::infinity());
  weights.assign(k_len, 0.0);
  const auto* q = rows.q(b, i, h);
  for (int64_t j = 0; j < key_end; ++j) {
    if (!mask.takes_part(b, h, i, j, degenerate)) continue;
    const auto* k = rows.k(b, j, kv_head);
    double dot = 0.0;
    for (int64_t c = 0; c < e.head_dim; ++c) {
      dot += static_cast<double>(q[c]) * static_cast<double>(k[c]);
    }
    scores[j] = scale * dot + static_cast<double>(mask.bias_at(b, h, i, j));
  }
  return detail::softmax_row(scores.data(), weights.data(), k_len);
}

}  // namespace qkv::reference
