// The per-call non-finite scan of K/V key blocks (finite_scan.hpp), compiled per SIMD
// target. Per-target include guard (Highway's toggle idiom).
#if defined(QKV_CPU_FINITE_SCAN_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_FINITE_SCAN_INL_H_
#undef QKV_CPU_FINITE_SCAN_INL_H_
#else
#define QKV_CPU_FINITE_SCAN_INL_H_
#endif

#include <algorithm>

#include "cpu/block_ops-inl.h"
#include "cpu/finite_scan.hpp"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {

// Scans one key block's K and V rows and records whether each is all finite.
template <class Problem>
void ScanKeyValueBlock(const Problem& p, const KeyBlock& block, KeyValueFinite& finite) {
  const auto rows = p.rows();
  const int64_t first = block.block * kBlockKeys;
  const size_t keys =
      static_cast<size_t>(std::min(kBlockKeys, p.mask.sequences.k_len(block.batch) - first));
  const bool keys_finite =
      AllFinite(rows.k(block.batch, first, block.kv_head), p.args.k.strides[1], keys,
                static_cast<size_t>(p.extents.head_dim));
  const bool values_finite =
      AllFinite(rows.v(block.batch, first, block.kv_head), p.args.v.strides[1], keys,
                static_cast<size_t>(p.extents.v_dim));
  finite.record(block, keys_finite, values_finite);
}

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
