#include "blocks.hpp"

namespace qkv::dist::detail {
namespace {

// Calls f(dst_row, src_row, length) for every innermost row (contiguous or not).
template <class Dst, class Src, class F>
void each_row(const Dst& dst, const Src& src, F&& f) {
  for (int64_t b = 0; b < dst.shape[0]; ++b)
    for (int64_t n = 0; n < dst.shape[1]; ++n)
      for (int64_t h = 0; h < dst.shape[2]; ++h) f(&dst(b, n, h, 0), &src(b, n, h, 0));
}

}  // namespace

void copy_into(const View4<const float>& src, const View4<float>& dst) {
  const int64_t dim = dst.shape[3], ds = dst.strides[3], ss = src.strides[3];
  if (dim == 0) return;
  each_row(dst, src, [&](float* d, const float* s) {
    for (int64_t x = 0; x < dim; ++x) d[x * ds] = s[x * ss];
  });
}

void add_into(const View4<const float>& src, const View4<float>& dst) {
  const int64_t dim = dst.shape[3], ds = dst.strides[3], ss = src.strides[3];
  if (dim == 0) return;
  each_row(dst, src, [&](float* d, const float* s) {
    for (int64_t x = 0; x < dim; ++x) d[x * ds] += s[x * ss];
  });
}

void fill(const View4<float>& dst, float value) {
  const int64_t dim = dst.shape[3], ds = dst.strides[3];
  if (dim == 0) return;
  each_row(dst, dst, [&](float* d, const float*) {
    for (int64_t x = 0; x < dim; ++x) d[x * ds] = value;
  });
}

void fill(const View3<float>& dst, float value) {
  for (int64_t b = 0; b < dst.shape[0]; ++b)
    for (int64_t h = 0; h < dst.shape[1]; ++h)
      for (int64_t n = 0; n < dst.shape[2]; ++n) dst(b, h, n) = value;
}

}  // namespace qkv::dist::detail
