// Tests: rotary tables built as transformers builds them, and the textbook rotation of a
// row written out independently of the library (test_rotary_append.cpp,
// test_latent_append.cpp compare qkv's rotation with it bit for bit).
#pragma once

#include <qkv/tensor.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

namespace qkv::test {

// Tables as transformers builds them: θ_i = p · base^(−2i/r); NeoX repeats the r/2
// angles as cat(θ, θ), interleaved as repeat_interleave(θ, 2).
struct Tables {
  Tensor<float, 2> cos, sin;
};
inline Tables tables(int64_t rows, int64_t dim, bool interleaved, int64_t first_position = 0) {
  Tables t{Tensor<float, 2>({rows, dim}), Tensor<float, 2>({rows, dim})};
  for (int64_t p = 0; p < rows; ++p)
    for (int64_t c = 0; c < dim; ++c) {
      const int64_t i = interleaved ? c / 2 : c % (dim / 2);
      const double angle = double(p + first_position) * std::pow(10000.0, -2.0 * double(i) / double(dim));
      t.cos(p, c) = static_cast<float>(std::cos(angle));
      t.sin(p, c) = static_cast<float>(std::sin(angle));
    }
  return t;
}

// The textbook rotation of one row, rotate_half built as its own vector, each product
// and sum stored through a volatile so that no fused multiply-add can form.
inline void rotate_by_hand(const float* x, const float* cos, const float* sin, int64_t dim, int64_t head_dim, bool interleaved,
                           float* out) {
  std::vector<float> half(static_cast<std::size_t>(dim));
  for (int64_t c = 0; c < dim; ++c) {
    if (interleaved) half[c] = c % 2 == 0 ? -x[c + 1] : x[c - 1];
    else half[c] = c < dim / 2 ? -x[c + dim / 2] : x[c - dim / 2];
  }
  for (int64_t c = 0; c < dim; ++c) {
    volatile float a = x[c] * cos[c];
    volatile float b = half[c] * sin[c];
    out[c] = a + b;
  }
  for (int64_t c = dim; c < head_dim; ++c) out[c] = x[c];
}

}  // namespace qkv::test
