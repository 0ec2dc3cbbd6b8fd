// Reference backward, the textbook derivation literally. In the forward pass
//   S = scale·Q·Kᵀ,  P_i = softmax(S_i),  O = P·V
// so now, given dO = ∂L/∂O:
//   dV   = Pᵀ·dO                              (O = P·V, differentiated in V)
//   dP   = dO·Vᵀ                              (O = P·V, differentiated in P)
//   dS_i = J(P_i)ᵀ·dP_i,  J(s) = diag(s) − s·sᵀ  (the softmax, row by row; J is built)
//   dQ   = scale·dS·K,  dK = scale·dSᵀ·Q      (S = scale·Q·Kᵀ)
// Removed keys have P_ij = 0, so their row and column of J vanish and dS_ij = 0; a
// fully masked row has P_i = 0 and contributes nothing. With GQA, dK and dV sum over
// the query heads that share a key/value head.
#include <vector>

#include "qkv/softmax.hpp"
#include "reference/reference.hpp"
#include "reference/scores.hpp"

namespace qkv::reference {
namespace {

template <class T>
void backward_impl(const detail::BackwardProblem<T>& problem) {
  const detail::Extents& e = problem.extents;
  const auto rows = problem.rows();
  std::vector<double> scores, weights, d_weights, jacobian, d_scores;
  // dK, dV accumulate in double over query rows and grouped query heads: [Nk, dim].
  std::vector<double> dk_acc, dv_acc, dq_row(e.head_dim);

  for (int64_t b = 0; b < e.batch; ++b) {
    const int64_t nk = problem.mask.sequences.k_len(b);
    d_weights.assign(nk, 0.0);
    d_scores.assign(nk, 0.0);
    jacobian.assign(nk * nk, 0.0);
    for (int64_t kv_head = 0; kv_head < e.kv_heads; ++kv_head) {
      dk_acc.assign(nk * e.head_dim, 0.0);
      dv_acc.assign(nk * e.v_dim, 0.0);
      for (int64_t h = kv_head * e.group(); h < (kv_head + 1) * e.group(); ++h) {
        for (int64_t i = 0; i < problem.mask.q_len(b); ++i) {
          score_row(e, problem.mask, problem.scale, rows, b, h, i, scores, weights);
          const T* dout = rows.dout(b, i, h);
          const T* q = rows.q(b, i, h);
          // dV_j += P_ij · dO_i  and  dP_ij = ⟨dO_i, V_j⟩ (only for keys that take part:
          // a removed key's V is never read).
          for (int64_t j = 0; j < nk; ++j) {
            d_weights[j] = 0.0;
            if (scores[j] == -INFINITY) continue;
            const T* v = rows.v(b, j, kv_head);
            double dot = 0.0;
            for (int64_t c = 0; c < e.v_dim; ++c) {
              const double grad_out = dout[c];
              if (weights[j] != 0.0) dv_acc[j * e.v_dim + c] += weights[j] * grad_out;
              dot += grad_out * static_cast<double>(v[c]);
            }
            d_weights[j] = dot;
          }
          // dS_i = J(P_i)ᵀ · dP_i with J materialized.
          softmax_jacobian(std::span<const double>(weights), std::span<double>(jacobian));
          for (int64_t j = 0; j < nk; ++j) {
            double sum = 0.0;
            for (int64_t m = 0; m < nk; ++m) {
              if (jacobian[m * nk + j] != 0.0) sum += jacobian[m * nk + j] * d_weights[m];
            }
            d_scores[j] = sum;
          }
          // dQ_i = scale · Σ_j dS_ij K_j ;  dK_j += scale · dS_ij Q_i.
          std::fill(dq_row.begin(), dq_row.end(), 0.0);
          for (int64_t j = 0; j < nk; ++j) {
            if (d_scores[j] == 0.0) continue;
            const double ds = problem.scale * d_scores[j];
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
}

}  // namespace

void backward(const detail::BackwardProblem<float>& problem) { backward_impl(problem); }
void backward(const detail::BackwardProblem<double>& problem) { backward_impl(problem); }
void backward(const detail::BackwardProblem<bfloat16>& problem) { backward_impl(problem); }
void backward(const detail::BackwardProblem<float16>& problem) { backward_impl(problem); }

}  // namespace qkv::reference
