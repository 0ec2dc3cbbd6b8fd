// The kernels' vector exp (ExpKeepNaN, block_ops-inl.h) over an array, dispatched like
// the kernels: lets the tests hold every compiled SIMD target to its error bound and to
// its NaN/−inf rules. Not used by the kernels themselves (they inline ExpKeepNaN).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/vector_exp.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/highway.h"
#include "cpu/block_ops-inl.h"

#ifndef QKV_CPU_VECTOR_EXP_ONCE_
#define QKV_CPU_VECTOR_EXP_ONCE_
#include <algorithm>

#include "cpu/cpu_backend.hpp"
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {

void SoftmaxExp(const float* x, float* out, size_t count) {
  const FloatTag d;
  const size_t lanes = hn::Lanes(d);
  HWY_ALIGN float chunk[hn::MaxLanes(d)];
  for (size_t i = 0; i < count; i += lanes) {
    const size_t n = std::min(lanes, count - i);
    std::fill(chunk, chunk + lanes, 0.0f);
    std::copy(x + i, x + i + n, chunk);
    hn::Store(ExpKeepNaN(d, hn::Load(d, chunk)), d, chunk);
    std::copy(chunk, chunk + n, out + i);
  }
}

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::cpu {
HWY_EXPORT(SoftmaxExp);

void softmax_exp(const float* x, float* out, size_t count) {
  HWY_DYNAMIC_DISPATCH(SoftmaxExp)(x, out, count);
}
}  // namespace qkv::cpu
#endif
