// Reference backward, the textbook derivation literally. In the forward pass
//   S = scale·Q·Kᵀ,  P_i = softmax(S_i),  O = P·V
// so now, given dO = ∂L/∂O:
//   dV   = Pᵀ·dO                              (O = P·V, differentiated in V)
//   dP   = dO·Vᵀ                              (O = P·V, differentiated in P)
//   dS_i = J(P_i)ᵀ·dP_i,  J(s) = diag(s) − s·sᵀ  (the softmax, row by row; J is built)
//   dQ   = scale·dS·K,  dK = scale·dSᵀ·Q      (S = scale·Q·Kᵀ)
// Variants: the soft-cap multiplies dS by its slope 1 − tanh², and score_mod by the
// derivative the user gives (chain rule: both when both are set); ALiBi and mask biases
// are constants; mask_mod removes keys like a boolean mask; a sink is one more softmax entry with no value (dP = 0), whose dS is
// ∂L/∂sink; dropout multiplies the weights by Z (0 or 1/(1 − p)) in the forward, so dP
// by Z here. Removed keys have P_ij = 0, so their row and column of J vanish and dS_ij = 0; a
// fully masked row has P_i = 0 and contributes nothing. With GQA, dK and dV sum over
// the query heads that share a key/value head.
#include <vector>

#include "core/checked_size.hpp"
#include "qkv/softmax.hpp"
#include "reference/key_values.hpp"
#include "reference/reference.hpp"
#include "reference/scores.hpp"

namespace qkv::reference {
namespace {

template <class T>
void backward_impl(const detail::BackwardProblem<T>& problem) {
  const detail::Extents& e = problem.extents;
  const auto& mods = problem.modifiers;
  const auto rows = problem.rows();
  RowScores row;
  std::vector<double> d_weights, jacobian, d_scores, factors;
  // dK, dV accumulate in double over query rows and grouped query heads: [Nk, dim].
  std::vector<double> dk_acc, dv_acc, dq_row(e.head_dim);
  std::vector<double> dsinks(static_cast<std::size_t>(e.q_heads), 0.0);
  std::vector<double> dalibi(static_cast<std::size_t>(e.q_heads), 0.0);
  const bool want_dalibi = !problem.args.dalibi_slopes.empty();

  for (int64_t b = 0; b < e.batch; ++b) {
    const int64_t nk = problem.mask.sequences.k_len(b);
    const int64_t entries = nk + (mods.has_sinks() ? 1 : 0);  // + the sink, valueless
    d_weights.assign(entries, 0.0);
    d_scores.assign(entries, 0.0);
    factors.assign(nk, 1.0);
    // The row's Jacobian is entries² doubles: 2^62 of them for 2^31 keys. Checked, so such
    // a call is a qkv::Error rather than a std::length_error / bad_alloc from the vector.
    const std::size_t jacobian_bytes = detail::checked_bytes(
        "qkv (reference backward)", "the softmax Jacobian", {{"keys", entries}, {"keys", entries}}, sizeof(double));
    detail::allocate_or_throw("qkv (reference backward)", "the softmax Jacobian", jacobian_bytes,
                              [&] { jacobian.assign(jacobian_bytes / sizeof(double), 0.0); });
    for (int64_t kv_head = 0; kv_head < e.kv_heads; ++kv_head) {
      dk_acc.assign(nk * e.head_dim, 0.0);
      dv_acc.assign(nk * e.v_dim, 0.0);
      for (int64_t h = kv_head * e.group(); h < (kv_head + 1) * e.group(); ++h) {
        const uint32_t head_key =
            detail::dropout_head_key(mods.dropout.seed, mods.dropout.offset, b, h);
        for (int64_t i = 0; i < problem.mask.q_len(b); ++i) {
          score_row(e, problem.mask, mods, problem.scale, rows, ViewKeyValues<decltype(rows)>{rows}, b, h, i, row);
          const uint32_t row_key = detail::dropout_row_key(head_key, i);
          const T* dout = rows.dout(b, i, h);
          const T* q = rows.q(b, i, h);
          // In the forward pass O_i = Σ_j P_ij·Z_ij·V_j, so now (keys that take part only:
          // a removed key's V is never read):
          //   dV_j += P_ij·Z_ij·dO_i   and   dP_ij = Z_ij·⟨dO_i, V_j⟩   (dP_sink = 0).
          for (int64_t j = 0; j < entries; ++j) d_weights[j] = 0.0;
          for (int64_t j = 0; j < nk; ++j) {
            if (row.scores[j] == -INFINITY) continue;
            factors[j] = dropout_factor(mods, row_key, j);
            const T* v = rows.v(b, j, kv_head);
            double dot = 0.0;
            for (int64_t c = 0; c < e.v_dim; ++c) {
              const double grad_out = dout[c];
              const double weight = row.weights[j] * factors[j];
              if (weight != 0.0) dv_acc[j * e.v_dim + c] += weight * grad_out;
              dot += grad_out * static_cast<double>(v[c]);
            }
            d_weights[j] = factors[j] * dot;
          }
          // dS_i = J(P_i)ᵀ · dP_i with J materialized (over the keys and the sink).
          softmax_jacobian(std::span<const double>(row.weights), std::span<double>(jacobian));
          for (int64_t j = 0; j < entries; ++j) {
            double sum = 0.0;
            for (int64_t m = 0; m < entries; ++m) {
              if (jacobian[m * entries + j] != 0.0) sum += jacobian[m * entries + j] * d_weights[m];
            }
            d_scores[j] = sum;
          }
          if (mods.has_sinks()) dsinks[static_cast<std::size_t>(h)] += d_scores[nk];
          // ALiBi is added after the soft-cap (validation refuses a score_mod here), so
          // ∂S_ij/∂slope = −|i + Nk − Nq − j| multiplies dS_ij itself.
          if (want_dalibi) {
            const int64_t aligned = i + detail::ScoreModifiers::alibi_offset(problem.mask, b);
            for (int64_t j = 0; j < nk; ++j)
              dalibi[static_cast<std::size_t>(h)] -=
                  d_scores[j] * static_cast<double>(aligned > j ? aligned - j : j - aligned);
          }
          // Through score_mod and the soft-cap (row.slope), then S = scale·Q·Kᵀ:
          // dQ_i = scale · Σ_j dS_ij K_j ;  dK_j += scale · dS_ij Q_i.
          std::fill(dq_row.begin(), dq_row.end(), 0.0);
          for (int64_t j = 0; j < nk; ++j) {
            if (d_scores[j] == 0.0) continue;
            const double ds = problem.scale * d_scores[j] * row.slope[j];
            const T* k = rows.k(b, j, kv_head);
            for (int64_t c = 0; c < e.head_dim; ++c) {
              dq_row[c] += ds * static_cast<double>(k[c]);
              dk_acc[j * e.head_dim + c] += ds * static_cast<double>(q[c]);
            }
          }
          T* dq = rows.dq(b, i, h);
          for (int64_t c = 0; c < e.head_dim; ++c) dq[c] = store_as<T>(dq_row[c]);
        }
      }
      for (int64_t j = 0; j < nk; ++j) {
        T* dk = rows.dk(b, j, kv_head);
        T* dv = rows.dv(b, j, kv_head);
        for (int64_t c = 0; c < e.head_dim; ++c) dk[c] = store_as<T>(dk_acc[j * e.head_dim + c]);
        for (int64_t c = 0; c < e.v_dim; ++c) dv[c] = store_as<T>(dv_acc[j * e.v_dim + c]);
      }
    }
  }
  if (!problem.args.dsinks.empty()) {
    for (std::size_t h = 0; h < dsinks.size(); ++h) problem.args.dsinks[h] = static_cast<float>(dsinks[h]);
  }
  if (want_dalibi) {
    for (std::size_t h = 0; h < dalibi.size(); ++h)
      problem.args.dalibi_slopes[h] = static_cast<float>(dalibi[h]);
  }
}

}  // namespace

void backward(const detail::BackwardProblem<float>& problem) { backward_impl(problem); }
void backward(const detail::BackwardProblem<double>& problem) { backward_impl(problem); }
void backward(const detail::BackwardProblem<bfloat16>& problem) { backward_impl(problem); }
void backward(const detail::BackwardProblem<float16>& problem) { backward_impl(problem); }

}  // namespace qkv::reference
