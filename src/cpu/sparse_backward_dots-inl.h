// The sparse backward's pieces on a bf16 unit (vdpbf16ps or the AMX tiles; sparse_backward.cpp,
// for bfloat16 groups of 16+ query heads): a thread's buffers, and the weights and
// gradients of a gathered block in its transposed layout.
//
// Per-target include guard (Highway's toggle idiom).
#if defined(QKV_CPU_SPARSE_BACKWARD_DOTS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_SPARSE_BACKWARD_DOTS_INL_H_
#undef QKV_CPU_SPARSE_BACKWARD_DOTS_INL_H_
#else
#define QKV_CPU_SPARSE_BACKWARD_DOTS_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "cpu/bf16_dot.hpp"
#include "cpu/block_ops-inl.h"
#include "cpu/sparse_gather-inl.h"
#include "qkv/half.hpp"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {

// One thread's buffers: a block's K and V rows gathered as bf16 rows; its Sᵀ and dPᵀ
// (keys × group: then Pᵀ and dSᵀ in place, ld = pair_ld(group) = the group itself, whole
// vectors of heads: the layout pass D's float products read); the pairs of dQ's product
// (P's and K's: RescaleAddWeighted's scratch); the group's lse and D.
struct SparseDotScratch {
  SparseDotScratch() : st(AllocateFloats(0)), dpt(AllocateFloats(0)) {}
  SparseDotScratch(size_t group, size_t d, size_t dv)
      : ld(bf16dot::pair_ld(group)),
        keys(kGatherKeys * d),
        values(kGatherKeys * dv),
        st(AllocateFloats(kGatherKeys * ld)),
        dpt(AllocateFloats(kGatherKeys * ld)),
        p_pairs(kGatherKeys / 2 * ld),
        k_pairs(kGatherKeys / 2 * bf16dot::pair_ld(d)),
        lse(group),
        delta(group) {}

  size_t ld = 0;
  std::vector<bfloat16> keys, values;
  hwy::AlignedFreeUniquePtr<float[]> st, dpt;
  std::vector<std::uint32_t> p_pairs, k_pairs;
  std::vector<float> lse, delta;
};

// Over keys × rows of Sᵀ (st) and dPᵀ (dpt), ld apart, rows whole vectors of heads:
//   P = e^(S − lse_r) into st, dS = P·(dP − D_r) into dpt.
HWY_INLINE void WeightsAndGradientsTransposed(size_t keys, size_t rows, size_t ld, const float* HWY_RESTRICT lse,
                                              const float* HWY_RESTRICT delta, float* HWY_RESTRICT st,
                                              float* HWY_RESTRICT dpt) {
  const FloatTag df;
  const size_t lanes = hn::Lanes(df);
  for (size_t r = 0; r < rows; r += lanes) {
    const FloatVec row_lse = hn::LoadU(df, lse + r), row_delta = hn::LoadU(df, delta + r);
    for (size_t j = 0; j < keys; ++j) {
      const FloatVec p = ExpKeepNaN(df, hn::Sub(hn::LoadU(df, st + j * ld + r), row_lse));
      hn::StoreU(p, df, st + j * ld + r);
      hn::StoreU(hn::Mul(p, hn::Sub(hn::LoadU(df, dpt + j * ld + r), row_delta)), df, dpt + j * ld + r);
    }
  }
}

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
