// One row of scores and weights as the reference computes them, shared by its forward
// and backward so both see the very same P.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "core/problem.hpp"
#include "reference/softmax_row.hpp"

namespace qkv::reference {

// S_i = scale · q_i·K ᵀ + bias_i, with removed keys at -inf; then P_i = softmax(S_i).
// Returns lse_i. `scores` and `weights` are resized to Nk.
template <class T>
double score_row(const detail::Extents& e, const detail::MaskRule& mask, double scale,
                 const View4<const T>& q, const View4<const T>& k, int64_t b, int64_t h,
                 int64_t i, std::vector<double>& scores, std::vector<double>& weights) {
  const int64_t kv_head = e.kv_head_of(h);
  const int64_t key_end = mask.key_end(b, i);
  scores.assign(e.k_len, -std::numeric_limits<double>::infinity());
  weights.assign(e.k_len, 0.0);
  for (int64_t j = 0; j < key_end; ++j) {
    if (!mask.keeps(b, h, i, j)) continue;
    double dot = 0.0;
    for (int64_t c = 0; c < e.head_dim; ++c) {
      dot += static_cast<double>(q(b, i, h, c)) * static_cast<double>(k(b, j, kv_head, c));
    }
    scores[j] = scale * dot + static_cast<double>(mask.bias_at(b, h, i, j));
  }
  return detail::softmax_row(scores.data(), weights.data(), e.k_len);
}

}  // namespace qkv::reference
