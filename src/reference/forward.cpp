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
  const auto rows = problem.rows();
  std::vector<double> scores, weights, row_out(e.v_dim);
  for (int64_t b = 0; b < e.batch; ++b) {
    for (int64_t h = 0; h < e.q_heads; ++h) {
      const int64_t kv_head = e.kv_head_of(h);
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
        for (int64_t c = 0; c < e.v_dim; ++c) out[c] = store_as<T>(row_out[c]);
        if (!args.lse.empty()) rows.lse(b, h, i) = static_cast<LseOf<T>>(lse);
        if (!args.weights.empty()) {  // dense calls only (varlen has no weights output)
          for (std::size_t j = 0; j < weights.size(); ++j) {
            args.weights(b, h, i, static_cast<int64_t>(j)) = store_as<T>(weights[j]);
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
