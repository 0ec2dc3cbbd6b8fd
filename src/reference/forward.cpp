// Reference forward: S = scale·Q·Kᵀ (+ mask), P = softmax(S), O = P·V, all in double.
#include <cmath>
#include <vector>

#include "reference/reference.hpp"
#include "reference/scores.hpp"

namespace qkv::reference {
namespace {

template <class T>
void forward_impl(const detail::ForwardProblem<T>& problem) {
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
      const uint32_t head_key =
          detail::dropout_head_key(mods.dropout.seed, mods.dropout.offset, b, h);
      for (int64_t i = 0; i < problem.mask.q_len(b); ++i) {
        score_row(e, problem.mask, mods, problem.scale, rows, b, h, i, row);
        const uint32_t row_key = detail::dropout_row_key(head_key, i);
        // O_i = Σ_j P_ij · Z_ij · V_j over the keys that take part (a removed key's V is
        // never read, so a NaN there cannot leak into rows that do not see it; Z is the
        // dropout factor — a dropped key still takes part, so its NaN still shows, as in
        // PyTorch; the sink has no value).
        std::fill(row_out.begin(), row_out.end(), 0.0);
        for (int64_t j = 0; j < k_len; ++j) {
          if (row.scores[j] == -INFINITY) continue;
          const double weight = row.weights[j] * dropout_factor(mods, row_key, j);
          const T* v = rows.v(b, j, kv_head);
          for (int64_t c = 0; c < e.v_dim; ++c) row_out[c] += weight * static_cast<double>(v[c]);
        }
        T* out = rows.out(b, i, h);
        for (int64_t c = 0; c < e.v_dim; ++c) out[c] = store_as<T>(row_out[c]);
        if (!args.lse.empty()) rows.lse(b, h, i) = static_cast<LseOf<T>>(row.lse);
        if (!args.weights.empty()) {  // dense calls only (varlen has no weights output)
          for (int64_t j = 0; j < k_len; ++j) {
            args.weights(b, h, i, j) = store_as<T>(row.weights[j]);
          }
        }
      }
    }
  }
}

}  // namespace

void forward(const detail::ForwardProblem<float>& problem) { forward_impl(problem); }
void forward(const detail::ForwardProblem<double>& problem) { forward_impl(problem); }
void forward(const detail::ForwardProblem<bfloat16>& problem) { forward_impl(problem); }
void forward(const detail::ForwardProblem<float16>& problem) { forward_impl(problem); }

}  // namespace qkv::reference
