// One softmax row in double: the single implementation behind qkv::softmax and the
// reference attention backend, so the oracle and the documented math cannot drift.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace qkv::detail {

// s = softmax(x) over n entries; returns lse = log Σ exp(x). Entries equal to -inf take
// no part (s = 0). If all are -inf: s = 0 and lse = -inf. A NaN or +inf entry makes the
// whole row NaN (non-finite input propagates to what it touches, and only there).
inline double softmax_row(const double* x, double* s, int64_t n) {
  constexpr double kMinusInf = -std::numeric_limits<double>::infinity();
  double max = kMinusInf;
  bool poisoned = false;
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(x[j]) || x[j] == std::numeric_limits<double>::infinity()) poisoned = true;
    if (x[j] > max) max = x[j];
  }
  if (poisoned) {
    for (int64_t j = 0; j < n; ++j) s[j] = std::numeric_limits<double>::quiet_NaN();
    return std::numeric_limits<double>::quiet_NaN();
  }
  if (max == kMinusInf) {  // empty or fully masked row
    for (int64_t j = 0; j < n; ++j) s[j] = 0.0;
    return kMinusInf;
  }
  // Every exponent is ≤ 0 after subtracting the max: no overflow for any finite input.
  double sum = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = x[j] == kMinusInf ? 0.0 : std::exp(x[j] - max);
    sum += s[j];
  }
  const double inverse = 1.0 / sum;  // sum ≥ 1: the max entry contributes exp(0)
  for (int64_t j = 0; j < n; ++j) s[j] *= inverse;
  return max + std::log(sum);
}

}  // namespace qkv::detail
