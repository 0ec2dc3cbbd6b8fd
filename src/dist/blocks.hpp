// Views of the pieces ring attention moves around: row ranges of a caller's tensors, and
// the packed block that travels the ring — K [B, n, Hkv, d] followed by V [B, n, Hkv, dv]
// (or dK and dV, with the same layout), contiguous, n = the owner's shard length.
#pragma once

#include <cstdint>

#include "qkv/tensor.hpp"

namespace qkv::dist::detail {

// Batch entries [b0, b1) and sequence rows [n0, n1) of a [B, N, H, D] view.
template <class T>
View4<T> rows(const View4<T>& v, int64_t b0, int64_t b1, int64_t n0, int64_t n1) {
  return View4<T>(v.data + b0 * v.strides[0] + n0 * v.strides[1],
                  {b1 - b0, n1 - n0, v.shape[2], v.shape[3]}, v.strides);
}

// Batch entries [b0, b1) and rows [n0, n1) of a [B, H, N] LSE view.
template <class T>
View3<T> lse_rows(const View3<T>& v, int64_t b0, int64_t b1, int64_t n0, int64_t n1) {
  return View3<T>(v.data + b0 * v.strides[0] + n0 * v.strides[2], {b1 - b0, v.shape[1], n1 - n0},
                  v.strides);
}

struct PackedBlock {
  int64_t batch = 0, heads = 0, dim = 0, v_dim = 0;

  int64_t floats(int64_t n) const { return batch * n * heads * (dim + v_dim); }
  View4<float> keys(float* base, int64_t n) const {
    return View4<float>::contiguous(base, {batch, n, heads, dim});
  }
  View4<float> values(float* base, int64_t n) const {
    return View4<float>::contiguous(base + batch * n * heads * dim, {batch, n, heads, v_dim});
  }
};

// dst = src and dst += src, element by element (same shapes; any strides).
void copy_into(const View4<const float>& src, const View4<float>& dst);
void add_into(const View4<const float>& src, const View4<float>& dst);
void fill(const View4<float>& dst, float value);
void fill(const View3<float>& dst, float value);

}  // namespace qkv::dist::detail
