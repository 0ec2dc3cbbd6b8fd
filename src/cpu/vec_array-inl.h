// Fixed-size arrays of SIMD vectors, for the kernels' register tiles (gemm-inl.h,
// block_ops-inl.h, decode_tiles-inl.h).
//
// x86 and NEON vectors are ordinary types: VecArray<D, N> is hn::Vec<D>[N] and
// VecArray2<D, R, C> is hn::Vec<D>[R][C], exactly what the kernels declare elsewhere
// (the same code; the compiler keeps a tile in registers).
//
// SVE vectors are sizeless (their length is fixed by the CPU at run time): C++ compilers
// allow no array, struct member or sizeof of them, so the kernels' tiles do not compile
// for the SVE targets as plain arrays. There a VecArray is an aligned buffer with room
// for N vectors of the longest length the target allows, each element read with Load
// and written with Store through a reference proxy (VecRef), so that the kernels' code
// reads the same on every target and computes the same sums in the same order. The
// tiles then live in L1 rather than in registers (GCC 12 does not promote them): correct
// on every vector length, not tuned for speed (docs/platforms-and-performance.md).
//
// Per-target include guard (Highway's toggle idiom).
#if defined(QKV_CPU_VEC_ARRAY_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_VEC_ARRAY_INL_H_
#undef QKV_CPU_VEC_ARRAY_INL_H_
#else
#define QKV_CPU_VEC_ARRAY_INL_H_
#endif

#include <cstddef>

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_TARGET == HWY_SVE || HWY_TARGET == HWY_SVE2 || HWY_TARGET == HWY_SVE_256 || \
    HWY_TARGET == HWY_SVE2_128 || HWY_TARGET == HWY_RVV
inline constexpr bool kSizelessVectors = true;

// Distance between two elements, in lanes: the target's longest vector.
template <class D>
inline constexpr size_t kVecSlot = hn::MaxLanes(D());

// One element: converts to its vector (Load) and is assigned one (Store). Assigning an
// element to an element copies the vector, as with an array.
template <class D>
class VecRef {
 public:
  explicit VecRef(hn::TFromD<D>* slot) : slot_(slot) {}
  VecRef(const VecRef&) = default;
  HWY_INLINE operator hn::Vec<D>() const { return hn::Load(D(), slot_); }
  HWY_INLINE VecRef& operator=(hn::Vec<D> v) {
    hn::Store(v, D(), slot_);
    return *this;
  }
  HWY_INLINE VecRef& operator=(const VecRef& other) { return *this = hn::Vec<D>(other); }

 private:
  hn::TFromD<D>* slot_;
};

// Consecutive elements (what an array decays to): v[i], v + i.
template <class D>
class VecSpan {
 public:
  explicit VecSpan(hn::TFromD<D>* first) : first_(first) {}
  HWY_INLINE VecRef<D> operator[](size_t i) const { return VecRef<D>(first_ + i * kVecSlot<D>); }
  HWY_INLINE VecSpan operator+(size_t i) const { return VecSpan(first_ + i * kVecSlot<D>); }

 private:
  hn::TFromD<D>* first_;
};

template <class D, size_t N>
class VecArrayBuffer {
 public:
  HWY_INLINE VecRef<D> operator[](size_t i) { return VecRef<D>(lanes_ + i * kVecSlot<D>); }
  HWY_INLINE operator VecSpan<D>() { return VecSpan<D>(lanes_); }

 private:
  HWY_ALIGN hn::TFromD<D> lanes_[N * kVecSlot<D>];
};

// Rows of C elements: m[r] is a VecSpan, m[r][c] an element.
template <class D, size_t R, size_t C>
class VecArray2Buffer {
 public:
  HWY_INLINE VecSpan<D> operator[](size_t r) { return VecSpan<D>(lanes_ + r * C * kVecSlot<D>); }

 private:
  HWY_ALIGN hn::TFromD<D> lanes_[R * C * kVecSlot<D>];
};

template <class D, size_t N>
using VecArray = VecArrayBuffer<D, N>;
template <class D, size_t R, size_t C>
using VecArray2 = VecArray2Buffer<D, R, C>;

#else
inline constexpr bool kSizelessVectors = false;

template <class D, size_t N>
using VecArray = hn::Vec<D>[N];
template <class D, size_t R, size_t C>
using VecArray2 = hn::Vec<D>[R][C];
#endif

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // QKV_CPU_VEC_ARRAY_INL_H_
