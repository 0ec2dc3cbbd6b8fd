// Tests: the oracle of the bf16 P·V kernels (bf16_dot.hpp, amx_dot.hpp) — one output value's
// Σ_j bf16(P_ij)·v_j[x] in float64, with P given transposed (pt[j·pt_ld + i]) and rounded to
// bfloat16 once, as the Precision::fast contract has it (products of two bf16 values are
// exact in double), and Σ|terms| for the float32 summation bound.
#pragma once

#include <cmath>
#include <cstddef>

#include "qkv/half.hpp"

namespace qkv::test {

struct WeightedSum {
  double sum = 0.0, magnitude = 0.0;
};

inline WeightedSum exact_weighted_sum(const float* pt, std::size_t pt_ld, const bfloat16* v, std::size_t v_row,
                                      std::size_t keys, std::size_t i, std::size_t x) {
  WeightedSum s;
  for (std::size_t j = 0; j < keys; ++j) {
    const double p = static_cast<float>(bfloat16(pt[j * pt_ld + i]));
    const double term = p * static_cast<float>(v[j * v_row + x]);
    s.sum += term;
    s.magnitude += std::abs(term);
  }
  return s;
}

}  // namespace qkv::test
