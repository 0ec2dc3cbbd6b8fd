// Softmax cross-entropy, averaged over the rows that have a target.
#include "qkv/nn/cross_entropy.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "check.hpp"
#include "parallel.hpp"

namespace qkv::nn {
namespace {

template <class T>
double cross_entropy_impl(Matrix<const T> logits, std::span<const int32_t> targets,
                          Matrix<T> dlogits) {
  const std::string fn = "softmax_cross_entropy";
  const int64_t rows = logits.shape[0], vocab = logits.shape[1];
  detail::check_matrix(fn, "logits", logits, -1, -1);
  detail::expect(static_cast<int64_t>(targets.size()) == rows, fn,
                 "targets.size(): expected " + std::to_string(rows) + " (logits rows), got " +
                     std::to_string(targets.size()));
  if (!dlogits.empty()) detail::check_matrix(fn, "dlogits", dlogits, rows, vocab);
  int64_t counted = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t t = targets[r];
    if (t == kIgnoreIndex) continue;
    if (t < 0 || t >= vocab) {
      detail::fail(fn, "targets[" + std::to_string(r) + "]: expected in [0, " +
                           std::to_string(vocab) + ") or kIgnoreIndex, got " + std::to_string(t));
    }
    ++counted;
  }
  const double inverse = counted > 0 ? 1.0 / static_cast<double>(counted) : 0.0;
  // Rows in blocks on the thread pool; the loss sums per block, then blocks in order.
  std::vector<double> partial(static_cast<std::size_t>(detail::block_count(rows, detail::kRowBlock)), 0.0);
  detail::parallel_blocks(rows, detail::kRowBlock, [&](int64_t begin, int64_t end) {
    double& total = partial[static_cast<std::size_t>(begin / detail::kRowBlock)];
    for (int64_t r = begin; r < end; ++r) {
      const int32_t t = targets[r];
      if (t == kIgnoreIndex) {
        if (!dlogits.empty()) {
          for (int64_t j = 0; j < vocab; ++j) dlogits(r, j) = T(0);
        }
        continue;
      }
      double max = -INFINITY;
      for (int64_t j = 0; j < vocab; ++j) max = std::max(max, static_cast<double>(logits(r, j)));
      double sum = 0.0;
      for (int64_t j = 0; j < vocab; ++j) sum += std::exp(static_cast<double>(logits(r, j)) - max);
      const double lse = max + std::log(sum);
      total += lse - static_cast<double>(logits(r, t));
      if (!dlogits.empty()) {
        // (softmax − onehot) / R; reads logits(r, j) before writing (dlogits may alias).
        for (int64_t j = 0; j < vocab; ++j) {
          const double p = std::exp(static_cast<double>(logits(r, j)) - lse);
          dlogits(r, j) = static_cast<T>((p - (j == t ? 1.0 : 0.0)) * inverse);
        }
      }
    }
  });
  double total = 0.0;
  for (double block : partial) total += block;
  return total * inverse;
}

}  // namespace

double softmax_cross_entropy(Matrix<const float> logits, std::span<const int32_t> targets,
                             Matrix<float> dlogits) {
  return cross_entropy_impl(logits, targets, dlogits);
}
double softmax_cross_entropy(Matrix<const double> logits, std::span<const int32_t> targets,
                             Matrix<double> dlogits) {
  return cross_entropy_impl(logits, targets, dlogits);
}

}  // namespace qkv::nn
