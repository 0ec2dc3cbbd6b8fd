// Reference sparse attention: for each (batch, query head, query row) the attended set
// A = {j_0 < j_1 < …} (KeySelection::attended_keys) is gathered and attended densely:
//   s_t = pipeline(scale·q·k_(j_t)),   P = softmax(s ∪ {sink_h}),   O = Σ_t P_t·v_(j_t)
// and the backward is the dense reference's on the same entries (reference/backward.cpp):
//   dP_t = ⟨dO, v_(j_t)⟩ (dP_sink = 0),   dS = J(P)·dP with J = diag(P) − P·Pᵀ built,
//   dq += scale·dS_t·slope_t·k_(j_t),  dk_(j_t) += scale·dS_t·slope_t·q,  dv_(j_t) += P_t·dO,
//   dsink_h += dS_sink.
// Everything in double; nothing Nq × Nk (dk and dv accumulate in [Nk, dim] per kv head).
#include "reference/sparse.hpp"

#include <cmath>
#include <limits>
#include <vector>

#include "core/score_pipeline.hpp"
#include "qkv/softmax.hpp"
#include "reference/scores.hpp"
#include "reference/softmax_row.hpp"

namespace qkv::reference {
namespace {

// One row's gathered entries: the attended keys, their logits (+ the sink's), weights,
// and d logit / d(scale·q·k) of each key (the soft-cap's 1 − tanh²).
struct GatheredRow {
  std::vector<int32_t> keys;
  std::vector<uint64_t> marks;  // KeySelection::attended_keys's scratch
  std::vector<double> scores, weights, slope;
  int64_t count = 0;
  double lse = 0.0;
};

template <class Problem, class Rows>
void gather_row(const Problem& dense, const detail::KeySelection& selection, const Rows& rows, int64_t b,
                int64_t h, int64_t i, GatheredRow& row) {
  const detail::Extents& e = dense.extents;
  const auto& mods = dense.modifiers;
  const int64_t kv_head = e.kv_head_of(h);
  row.keys.resize(static_cast<std::size_t>(selection.topk));
  if (row.marks.empty()) row.marks = selection.marks_for(e.k_len);
  row.count = selection.attended_keys(dense.mask, b, selection.list_of(kv_head), i, row.keys.data(), row.marks);
  const int64_t entries = row.count + (mods.has_sinks() ? 1 : 0);
  row.scores.assign(entries, 0.0);
  row.weights.assign(entries, 0.0);
  row.slope.assign(row.count, 1.0);
  const auto* q = rows.q(b, i, h);
  for (int64_t t = 0; t < row.count; ++t) {
    const int64_t j = row.keys[t];
    const auto* k = rows.k(b, j, kv_head);
    double dot = 0.0;
    for (int64_t c = 0; c < e.head_dim; ++c) dot += static_cast<double>(q[c]) * static_cast<double>(k[c]);
    double logit = dense.scale * dot;
    detail::apply_score_pipeline(mods, detail::ElementStages{dense.mask, mods, b, h, i, j, logit, row.slope[t]});
    row.scores[t] = logit;
  }
  if (mods.has_sinks()) row.scores[row.count] = mods.sinks[h];
  row.lse = detail::softmax_row(row.scores.data(), row.weights.data(), entries);
}

}  // namespace

template <class T>
void sparse_forward(const detail::SparseForwardProblem<T>& problem) {
  const auto& dense = problem.dense;
  const detail::Extents& e = dense.extents;
  const auto rows = dense.rows();
  GatheredRow row;
  std::vector<double> out_row(e.v_dim);
  for (int64_t b = 0; b < e.batch; ++b)
    for (int64_t h = 0; h < e.q_heads; ++h)
      for (int64_t i = 0; i < e.q_len; ++i) {
        gather_row(dense, problem.keys, rows, b, h, i, row);
        std::fill(out_row.begin(), out_row.end(), 0.0);
        for (int64_t t = 0; t < row.count; ++t) {
          const auto* v = rows.v(b, row.keys[t], e.kv_head_of(h));
          for (int64_t c = 0; c < e.v_dim; ++c) out_row[c] += row.weights[t] * static_cast<double>(v[c]);
        }
        T* out = rows.out(b, i, h);
        for (int64_t c = 0; c < e.v_dim; ++c) out[c] = store_as<T>(out_row[c]);
        if (!dense.args.lse.empty()) rows.lse(b, h, i) = static_cast<LseOf<T>>(row.lse);
      }
}

template <class T>
void sparse_backward(const detail::SparseBackwardProblem<T>& problem) {
  const auto& dense = problem.dense;
  const detail::Extents& e = dense.extents;
  const auto rows = dense.rows();
  GatheredRow row;
  std::vector<double> d_weights, jacobian, d_scores, dq_row(e.head_dim);
  std::vector<double> dk_acc, dv_acc, dsinks(static_cast<std::size_t>(e.q_heads), 0.0);
  for (int64_t b = 0; b < e.batch; ++b)
    for (int64_t kv_head = 0; kv_head < e.kv_heads; ++kv_head) {
      dk_acc.assign(e.k_len * e.head_dim, 0.0);
      dv_acc.assign(e.k_len * e.v_dim, 0.0);
      for (int64_t h = kv_head * e.group(); h < (kv_head + 1) * e.group(); ++h)
        for (int64_t i = 0; i < e.q_len; ++i) {
          gather_row(dense, problem.keys, rows, b, h, i, row);
          const int64_t entries = static_cast<int64_t>(row.weights.size());
          const T* dout = rows.dout(b, i, h);
          const T* q = rows.q(b, i, h);
          // In the forward O = Σ_t P_t·v_t, so now dv_t += P_t·dO and dP_t = ⟨dO, v_t⟩.
          d_weights.assign(entries, 0.0);
          for (int64_t t = 0; t < row.count; ++t) {
            const int64_t j = row.keys[t];
            const T* v = rows.v(b, j, kv_head);
            double dot = 0.0;
            for (int64_t c = 0; c < e.v_dim; ++c) {
              dv_acc[j * e.v_dim + c] += row.weights[t] * static_cast<double>(dout[c]);
              dot += static_cast<double>(dout[c]) * static_cast<double>(v[c]);
            }
            d_weights[t] = dot;
          }
          // dS = J(P)ᵀ·dP with J built over the gathered keys and the sink.
          jacobian.assign(static_cast<std::size_t>(entries * entries), 0.0);
          softmax_jacobian(std::span<const double>(row.weights), std::span<double>(jacobian));
          d_scores.assign(entries, 0.0);
          for (int64_t t = 0; t < entries; ++t)
            for (int64_t m = 0; m < entries; ++m) d_scores[t] += jacobian[m * entries + t] * d_weights[m];
          if (dense.modifiers.has_sinks()) dsinks[static_cast<std::size_t>(h)] += d_scores[row.count];
          // Through the soft-cap (slope), then s = scale·q·k.
          std::fill(dq_row.begin(), dq_row.end(), 0.0);
          for (int64_t t = 0; t < row.count; ++t) {
            const int64_t j = row.keys[t];
            const double ds = dense.scale * d_scores[t] * row.slope[t];
            const T* k = rows.k(b, j, kv_head);
            for (int64_t c = 0; c < e.head_dim; ++c) {
              dq_row[c] += ds * static_cast<double>(k[c]);
              dk_acc[j * e.head_dim + c] += ds * static_cast<double>(q[c]);
            }
          }
          T* dq = rows.dq(b, i, h);
          for (int64_t c = 0; c < e.head_dim; ++c) dq[c] = store_as<T>(dq_row[c]);
        }
      for (int64_t j = 0; j < e.k_len; ++j) {
        T* dk = rows.dk(b, j, kv_head);
        T* dv = rows.dv(b, j, kv_head);
        for (int64_t c = 0; c < e.head_dim; ++c) dk[c] = store_as<T>(dk_acc[j * e.head_dim + c]);
        for (int64_t c = 0; c < e.v_dim; ++c) dv[c] = store_as<T>(dv_acc[j * e.v_dim + c]);
      }
    }
  if (!dense.args.dsinks.empty())
    for (std::size_t h = 0; h < dsinks.size(); ++h) dense.args.dsinks[h] = static_cast<float>(dsinks[h]);
}

#define QKV_INSTANTIATE_SPARSE_REFERENCE(T)                                     \
  template void sparse_forward(const detail::SparseForwardProblem<T>&); \
  template void sparse_backward(const detail::SparseBackwardProblem<T>&);
QKV_INSTANTIATE_SPARSE_REFERENCE(float)
QKV_INSTANTIATE_SPARSE_REFERENCE(double)
QKV_INSTANTIATE_SPARSE_REFERENCE(bfloat16)
QKV_INSTANTIATE_SPARSE_REFERENCE(float16)
#undef QKV_INSTANTIATE_SPARSE_REFERENCE

}  // namespace qkv::reference
