// The backward's per-thread scratch and its block operands (backward.cpp): the scratch
// laid out once per thread, what every block function of one call reads (Context), one
// key block's K and V rows as float operands, and a query block's rows and dropout keys.
#if defined(QKV_CPU_BACKWARD_SCRATCH_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_BACKWARD_SCRATCH_INL_H_
#undef QKV_CPU_BACKWARD_SCRATCH_INL_H_
#else
#define QKV_CPU_BACKWARD_SCRATCH_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "core/dropout.hpp"
#include "core/problem.hpp"
#include "core/tile_plan.hpp"
#include "cpu/backward_pack-inl.h"
#include "cpu/bf16_dot.hpp"
#include "cpu/block_mask.hpp"
#include "cpu/block_ops-inl.h"
#include "cpu/blocking.hpp"
#include "cpu/decode_tiles-inl.h"
#include "cpu/finite_scan.hpp"
#include "cpu/mask_tiles.hpp"
#include "cpu/storage-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {


// A B-operand: row-major rows `ld` floats apart, each padded to whole vectors.
struct Rows {
  const float* data;
  size_t ld;
};

// Per-thread scratch (floats): two score tiles and the block accumulators.
struct BackwardScratch {
  size_t width;
  hwy::AlignedFreeUniquePtr<float[]> pt;    // kBlockKeys × width: Pᵀ
  hwy::AlignedFreeUniquePtr<float[]> dst;   // kBlockKeys × width: dPᵀ, then dSᵀ
  hwy::AlignedFreeUniquePtr<float[]> add;   // kBlockKeys × width: a partial tile's mask
  hwy::AlignedFreeUniquePtr<float[]> cap;   // kBlockKeys × width: soft-cap slope 1 − tanh²
  hwy::AlignedFreeUniquePtr<float[]> mod_slope;  // kBlockKeys × width: d score_mod / d score
  hwy::AlignedFreeUniquePtr<float[]> acc;   // kBlockKeys × (d_ld + dv_ld): dK, dV
  hwy::AlignedFreeUniquePtr<float[]> k_pad; // kBlockKeys × d_ld: K padded (d % lanes ≠ 0) or widened
  hwy::AlignedFreeUniquePtr<float[]> v_wide;  // kBlockKeys × dv_ld: V widened, 16-bit storage only
  hwy::AlignedFreeUniquePtr<float[]> dq;    // dQ accumulator: dq_rows × d_ld
  std::vector<int32_t> key_begin, key_end;  // width (0 past the block's queries)
  std::vector<uint32_t> dropout_keys;       // width: dropout row keys of the block
  SplitKLogits split_k;                     // the split-K schedule's logits (Context::split_k_logits)
  // bfloat16 with dot products (Packed::dots): dSᵀ paired along queries (dK's left operand),
  // P's pairs (dV's; on vdpbf16ps dS's pairs along the keys for dQ too) and K's pairs (dQ's).
  std::vector<uint32_t> ds_pairs, p_pairs, k_pairs;

  // dq_rows: kBlockQueries (two-pass) or group × Nq (single-pass); split_k_head_dim: the
  // head dim when the logits are the split-K schedule's, else 0.
  BackwardScratch(const Packed& packed, bool elementwise, bool softcap, size_t lanes,
                  size_t dq_rows, bool widen, bool score_mod, size_t split_k_head_dim)
      : width(round_up(kBlockQueries, lanes)),
        pt(AllocateFloats(kBlockKeys * width)),
        dst(AllocateFloats(kBlockKeys * width)),
        add(AllocateFloats(elementwise ? kBlockKeys * width : 0)),
        cap(AllocateFloats(softcap ? kBlockKeys * width : 0)),
        mod_slope(AllocateFloats(score_mod ? kBlockKeys * width : 0)),
        acc(AllocateFloats(kBlockKeys * (packed.d_ld + packed.dv_ld))),
        k_pad(AllocateFloats(packed.pad_q_rows ? kBlockKeys * packed.d_ld : 0)),
        v_wide(AllocateFloats(widen ? kBlockKeys * packed.dv_ld : 0)),
        dq(AllocateFloats(dq_rows * packed.d_ld)),
        key_begin(width, 0),
        key_end(width, 0),
        dropout_keys(width, 0),
        split_k(split_k_head_dim, kBlockQueries, kBlockKeys, split_k_head_dim > 0),
        ds_pairs(packed.dots ? kBlockKeys * (kBlockQueries / 2) : 0),
        p_pairs(packed.dots ? kBlockKeys * (kBlockQueries / 2) : 0),
        k_pairs(packed.dots ? kBlockKeys / 2 * bf16dot::pair_ld(packed.d_ld) : 0) {
    // Padding columns never get a derivative; ChainScoreMod ignores them (dS = 0 there),
    // but they should not be read uninitialized.
    if (score_mod) std::fill(mod_slope.get(), mod_slope.get() + kBlockKeys * width, 1.0f);
  }
};

// What every block function of one call reads.
template <class T>
struct Context {
  const detail::BackwardProblem<T>& p;
  const detail::TilePlan& plan;
  const KeyValueFinite& finite;
  const SharedMaskTiles& shared;
  const Packed& packed;
  // ALiBi slope gradient (BackwardArgs::dalibi_slopes), or null: one sum per (entry, head)
  // in the single-pass schedule (each written by one task), per pass-2 task otherwise.
  double* alibi_sums = nullptr;
  // Sequences of ≤ kDecodeQueries queries take the split-K schedule's logits, as in the
  // forward (cpu::split_k_logits_for).
  bool split_k_logits = false;
};

// One key block's K and V rows as float operands: in place for float storage, else
// widened into scratch (rows d_ld / dv_ld apart, zero-padded to whole vectors).
struct KeyValueRows {
  const float* k;
  size_t k_ld;
  const float* v;
  size_t v_ld;
  bool k_padded;  // k's rows are whole vectors (d_ld apart, zero-padded)
};

template <class T>
KeyValueRows LoadKeyValues(const Context<T>& c, int64_t b, int64_t kv_head, int64_t first_key,
                           int64_t keys, BackwardScratch& s) {
  const auto access = c.p.rows();
  const auto* k = access.k(b, first_key, kv_head);
  const auto* v = access.v(b, first_key, kv_head);
  const int64_t k_row = c.p.args.k.strides[1], v_row = c.p.args.v.strides[1];
  if constexpr (kIsHalf<T>) {
    // The dot products read K and V in place: nothing to widen (WidenKeys below, for
    // the rare dQ product that skips a removed key's terms).
    if (c.packed.dots) return {nullptr, 0, nullptr, 0, false};
    const size_t kn = static_cast<size_t>(keys);
    WidenRows(k, k_row, kn, static_cast<size_t>(c.p.extents.head_dim), s.k_pad.get(),
              c.packed.d_ld);
    WidenRows(v, v_row, kn, static_cast<size_t>(c.p.extents.v_dim), s.v_wide.get(),
              c.packed.dv_ld);
    return {s.k_pad.get(), c.packed.d_ld, s.v_wide.get(), c.packed.dv_ld, true};
  } else {
    return {k, static_cast<size_t>(k_row), v, static_cast<size_t>(v_row), false};
  }
}

// K's rows of one key block as floats: LoadKeyValues's, or widened now into s.k_pad
// where it left them to the dot products.
template <class T>
const float* WidenKeys(const Context<T>& c, const KeyValueRows& kv, int64_t b, int64_t kv_head,
                       int64_t first_key, size_t kn, BackwardScratch& s, size_t* k_ld) {
  *k_ld = kv.k_ld;
  if (kv.k != nullptr) return kv.k;
  WidenRows(c.p.rows().k(b, first_key, kv_head), c.p.args.k.strides[1], kn,
            static_cast<size_t>(c.p.extents.head_dim), s.k_pad.get(), c.packed.d_ld);
  *k_ld = c.packed.d_ld;
  return s.k_pad.get();
}

// The query rows of block (b, h, first) with their key_end and degenerate flags.
template <class T>
QueryRows DescribeQueryBlock(const Context<T>& c, int64_t b, int64_t h, int64_t first,
                             BackwardScratch& s) {
  QueryRows rows{.batch = b, .head = h, .first = first,
                 .count = std::min(kBlockQueries, c.p.mask.q_len(b) - first),
                 .degenerate = c.plan.degenerate_rows(b, h, first)};
  describe_rows(c.p.mask, rows, s.key_begin.data(), s.key_end.data(), s.width);
  const Dropout& dropout = c.p.modifiers.dropout;
  if (dropout.p > 0.0f) {
    const uint32_t head_key = detail::dropout_head_key(dropout.seed, dropout.offset, b, h);
    for (size_t i = 0; i < s.width; ++i)
      s.dropout_keys[i] = detail::dropout_row_key(head_key, first + static_cast<int64_t>(i));
  }
  return rows;
}

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // QKV_CPU_BACKWARD_SCRATCH_INL_H_
