// Attention health: how saturated each head's softmax is, measured by the forward itself.
//
// A head whose logits grow too large puts (almost) all its weight on one key: its softmax
// Jacobian diag(P_i) − P_i·P_iᵀ goes to zero and no gradient passes back through it
// (`qkv explain` shows why). Two numbers per query row i tell:
//
//   largest weight  max_j P_ij = exp(m_i − lse_i)       1/n (uniform) … 1 (one-hot)
//   entropy         H_i = −Σ_j P_ij ln P_ij              ln n (uniform) … 0 (one-hot), nats
//                       = lse_i − Σ_j P_ij S_ij
//
// over the n keys that take part in row i. The cpu backend keeps them from its online
// softmax (one more running sum, Σ_j e^(S_ij − m_i)(S_ij − m_i)); the reference backend
// reads them off its materialized P. Either way nothing of size N² is stored.
//
// Pass an AttentionStats in ForwardArgs::stats (VarlenAttentionStats in
// VarlenForwardArgs::stats); every view in it is optional and written when given:
//
//   per (batch entry, query head), [B, Hq] (varlen: [sequences, Hq]):
//     max_weight_mean   mean over the counted rows of the largest weight
//     max_weight_max    the largest weight of any counted row
//     entropy_mean      mean entropy of the counted rows, in nats
//     saturated_share   share of counted rows whose largest weight > saturation_threshold
//     rows              counted rows: query rows with at least one key (int64)
//   per query row, laid out like lse: [B, Hq, Nq] (varlen: [Hq, total_q]):
//     row_max_weight, row_entropy
//
// A query row whose keys are all removed has no distribution: it is not counted, and its
// per-row values are 0 (its P row is all zero). A (batch entry, head) without counted
// rows gets NaN for the four means, shares and maxima, and rows = 0.
//
// Reductions run in a fixed order, so every value is bitwise the same for any thread
// count. Calls with statistics always run the regular (prefill) forward kernel, also for
// decode shapes (a few queries against many keys), so the values do not depend on which
// kernel a shape would otherwise pick. Cost: a few percent of the forward when asked (bench/bench_attention.py
// --stats), nothing when not. Statistics are a forward-only output: they take no part in
// the backward.
#pragma once

#include <cstdint>

#include "qkv/tensor.hpp"

namespace qkv {

template <class T, int RowRank>
struct BasicAttentionStats {
  TensorView<T, 2> max_weight_mean;
  TensorView<T, 2> max_weight_max;
  TensorView<T, 2> entropy_mean;
  TensorView<T, 2> saturated_share;
  TensorView<int64_t, 2> rows;
  TensorView<T, RowRank> row_max_weight;
  TensorView<T, RowRank> row_entropy;
  // A row is saturated when its largest weight exceeds this; in [0, 1].
  double saturation_threshold = 0.99;

  bool any_head_view() const {
    return !max_weight_mean.empty() || !max_weight_max.empty() || !entropy_mean.empty() ||
           !saturated_share.empty() || !rows.empty();
  }
  bool any_row_view() const { return !row_max_weight.empty() || !row_entropy.empty(); }
};

// Dense calls: per-row views [B, Hq, Nq].
template <class T>
using AttentionStats = BasicAttentionStats<T, 3>;
// Varlen calls: per-row views [Hq, total_q], like the varlen lse.
template <class T>
using VarlenAttentionStats = BasicAttentionStats<T, 2>;

}  // namespace qkv
