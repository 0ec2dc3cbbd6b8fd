// Sparse attention's gathered blocks (sparse_forward.cpp, sparse_backward.cpp): the rows
// of one block of a row's attended keys, handed to the split-K schedule's register
// tiles (decode_tiles-inl.h) as row pointers — a gathered block is a block of the decode
// schedule whose rows are not consecutive.
#if defined(QKV_CPU_SPARSE_GATHER_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_SPARSE_GATHER_INL_H_
#undef QKV_CPU_SPARSE_GATHER_INL_H_
#else
#define QKV_CPU_SPARSE_GATHER_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "cpu/block_ops-inl.h"
#include "cpu/blocking.hpp"
#include "cpu/decode_tiles-inl.h"
#include "cpu/storage-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {

// Attended keys per online-softmax block: the score tile is (query heads of a group) ×
// 64 floats, and the block's K and V rows (64 × d) stay in L1/L2 between the two products.
inline constexpr size_t kGatherKeys = 64;

// dst row r = scale·q_r in float, zero-padded to d_pad (the split-K schedule's scaled
// queries: both passes of the backward must build them the same way, so the logits they
// recompute are the forward's bit for bit).
template <class T>
HWY_INLINE void ScaledRow(const T* q, size_t d, size_t d_pad, float scale, float* HWY_RESTRICT dst) {
  WidenRows(q, 0, 1, d, dst, d_pad);
  for (size_t c = 0; c < d; ++c) dst[c] *= scale;
}

// The K and V rows of keys[0, n), padded to `padded` (whole vectors of keys) with the
// block's last row again: its scores are overwritten with −inf (RowStages::mask) and its
// weights are never used. Read in place when d and dv are whole vectors (16-bit rows are
// widened inside the loads); otherwise widened into zero-padded float rows first, as the
// split-K schedule's packed path does. Visit(f) calls f(k_rows, v_rows, k_dim, v_dim,
// k_ahead, v_ahead): the Ahead (decode_tiles-inl.h) of the next block's rows, for the
// tiles to prefetch key by key while they compute this block. The rows of a gathered
// block are scattered over K and V, so no hardware prefetcher finds them: measured
// (32/8 heads, d = 128, 2048 keys, topk 2048) the block's arithmetic waits on them
// otherwise. (The packed path widens its rows itself and prefetches nothing.)
template <class T>
class GatheredBlock {
 public:
  GatheredBlock(size_t d, size_t dv)
      : d_(d),
        dv_(dv),
        d_pad_(round_up(d, VectorLanes())),
        dv_pad_(round_up(dv, VectorLanes())),
        in_place_(d_pad_ == d && dv_pad_ == dv),
        k_pack_(AllocateFloats(in_place_ ? 0 : kGatherKeys * d_pad_)),
        v_pack_(AllocateFloats(in_place_ ? 0 : kGatherKeys * dv_pad_)),
        k_in_(kGatherKeys),
        v_in_(kGatherKeys),
        k_packed_(kGatherKeys),
        v_packed_(kGatherKeys),
        k_next_(kGatherKeys),
        v_next_(kGatherKeys) {}

  size_t d_pad() const { return d_pad_; }
  size_t dv_pad() const { return dv_pad_; }

  // k_row(j) / v_row(j): the stored rows of keys[j], j < n.
  template <class KeyRow, class ValueRow>
  void Gather(size_t n, size_t padded, const KeyRow& k_row, const ValueRow& v_row) {
    for (size_t j = 0; j < padded; ++j) {
      const size_t from = std::min(j, n - 1);
      if (in_place_) {
        k_in_[j] = k_row(from);
        v_in_[j] = v_row(from);
        continue;
      }
      if (j < n) {
        WidenRows(k_row(j), 0, 1, d_, k_pack_.get() + j * d_pad_, d_pad_);
        WidenRows(v_row(j), 0, 1, dv_, v_pack_.get() + j * dv_pad_, dv_pad_);
      }
      k_packed_[j] = k_pack_.get() + from * d_pad_;
      v_packed_[j] = v_pack_.get() + from * dv_pad_;
    }
  }

  // The next block's rows, keys[0, n) (n = 0: there is none).
  template <class KeyRow, class ValueRow>
  void GatherNext(size_t n, const KeyRow& k_row, const ValueRow& v_row) {
    next_count_ = in_place_ ? n : 0;
    for (size_t j = 0; j < next_count_; ++j) {
      k_next_[j] = k_row(j);
      v_next_[j] = v_row(j);
    }
  }

  template <class F>
  void Visit(F&& f) const {
    if (in_place_) {
      f(k_in_.data(), v_in_.data(), d_, dv_, Ahead<T>{k_next_.data(), next_count_, d_ * sizeof(T)},
        Ahead<T>{v_next_.data(), next_count_, dv_ * sizeof(T)});
    } else {
      f(k_packed_.data(), v_packed_.data(), d_pad_, dv_pad_, Ahead<float>{}, Ahead<float>{});
    }
  }

 private:
  size_t d_, dv_, d_pad_, dv_pad_;
  bool in_place_;
  hwy::AlignedFreeUniquePtr<float[]> k_pack_, v_pack_;
  std::vector<const T*> k_in_, v_in_;
  std::vector<const float*> k_packed_, v_packed_;
  std::vector<const T*> k_next_, v_next_;
  size_t next_count_ = 0;
};

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
