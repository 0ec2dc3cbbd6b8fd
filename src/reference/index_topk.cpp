// The indexer's oracle: each allowed score in double, exactly as the formula reads,
//
//   score(b, i, j) = Σ_h w[b,i,h] · max(scale · Σ_c q[b,i,h,c]·k[b,j,c], 0),
//
// then the row's allowed keys sorted by (score descending, index ascending; NaN first) and
// the first topk kept (keys from a cache: its stored rows). One row of scores at a time (O(Nk) memory), one thread: slow is fine.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "core/index_topk_problem.hpp"

namespace qkv::reference {

// Storage widened exactly: the 16-bit types through float, float and double as they are.
template <class T>
double widen(T x) {
  return static_cast<double>(static_cast<IndexWeightOf<T>>(x));
}

template <class T>
void index_topk(const detail::IndexTopkProblem<T>& p) {
  const auto& a = p.args;
  std::vector<double> scores;
  std::vector<int64_t> order;
  std::vector<double> key(static_cast<std::size_t>(p.head_dim));
  std::vector<float> cache_row(p.cache != nullptr ? static_cast<std::size_t>(p.head_dim) : 0);
  // Descending score, NaN above every number, −0 equal to +0 (== says so), then the lower
  // index: the same total order as detail::candidate_key, in double.
  auto before = [&](int64_t x, int64_t y) {
    const double sx = scores[x], sy = scores[y];
    const bool nx = std::isnan(sx), ny = std::isnan(sy);
    if (nx != ny) return nx;
    if (!nx && sx != sy) return sx > sy;
    return x < y;
  };
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t i = 0; i < p.q_len; ++i) {
      const int64_t allowed = p.mask.key_end(b, i);
      scores.assign(static_cast<std::size_t>(allowed), 0.0);
      for (int64_t j = 0; j < allowed; ++j) {
        // Key j widened: from the call's k, or the cache's stored row (as float, exactly).
        if (p.cache != nullptr) {
          detail::cache_key_row(*p.cache, b, j, cache_row.data());
          for (int64_t c = 0; c < p.head_dim; ++c) key[static_cast<std::size_t>(c)] = cache_row[static_cast<std::size_t>(c)];
        } else {
          for (int64_t c = 0; c < p.head_dim; ++c) key[static_cast<std::size_t>(c)] = widen(a.k(b, j, c));
        }
        double score = 0.0;
        for (int64_t h = 0; h < p.heads; ++h) {
          double dot = 0.0;
          for (int64_t c = 0; c < p.head_dim; ++c) dot += widen(a.q(b, i, h, c)) * key[static_cast<std::size_t>(c)];
          // std::max(x, 0) returns x when x is NaN (NaN < 0 is false): NaN propagates.
          score += static_cast<double>(a.weights(b, i, h)) * std::max(p.scale * dot, 0.0);
        }
        scores[static_cast<std::size_t>(j)] = score;
      }
      order.resize(static_cast<std::size_t>(allowed));
      std::iota(order.begin(), order.end(), int64_t{0});
      const int64_t kept = std::min(allowed, p.topk);
      std::partial_sort(order.begin(), order.begin() + kept, order.end(), before);
      for (int64_t t = 0; t < p.topk; ++t)
        a.indices(b, i, t) = t < kept ? static_cast<int32_t>(order[static_cast<std::size_t>(t)]) : -1;
    }
  }
}

template void index_topk(const detail::IndexTopkProblem<float>&);
template void index_topk(const detail::IndexTopkProblem<double>&);
template void index_topk(const detail::IndexTopkProblem<bfloat16>&);
template void index_topk(const detail::IndexTopkProblem<float16>&);

}  // namespace qkv::reference
