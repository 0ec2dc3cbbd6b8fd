// The backward's operands packed once per call, before any block task runs: per (entry,
// query head) the transposed panels scale·Qᵀ and dOᵀ, each row's LSE (−inf → +inf, a
// degenerate row's rebuilt), D_i = ⟨dO_i, O_i⟩ and the sink's term (backward.cpp).
#if defined(QKV_CPU_BACKWARD_PACK_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_BACKWARD_PACK_INL_H_
#undef QKV_CPU_BACKWARD_PACK_INL_H_
#else
#define QKV_CPU_BACKWARD_PACK_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "core/problem.hpp"
#include "core/tile_plan.hpp"
#include "cpu/block_mask.hpp"
#include "cpu/bf16_dot.hpp"
#include "cpu/scratch_cache.hpp"
#include "cpu/dot_products.hpp"
#include "cpu/block_ops-inl.h"
#include "cpu/blocking.hpp"
#include "cpu/storage-inl.h"
#include "cpu/work_order.hpp"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {

// Whole-problem packed operands: per (entry, head) a panel of nq_ld(b) query columns
// (the entry's queries rounded up to whole 64-query blocks). Extra memory ≈ Hq·Σ_b
// Nq_b·(d + dv + 3) floats (+ padded Q / dO rows for head dims that are not whole
// vectors): linear in N.
//
// Qᵀ and dOᵀ are stored block by block: the d × 64 panel of each query block is
// contiguous (rows 64 floats apart). As one d × Nq matrix, a block's rows would be Nq
// floats apart — 16 KiB at N = 4096, a multiple of 4 KiB — so all d of them would fall
// into the same few L1 sets.
struct Packed {
  size_t lanes = 0;
  size_t d_ld = 0, dv_ld = 0;
  bool pad_q_rows = false, pad_dout_rows = false;
  std::vector<size_t> column_offset;  // per entry: first column of its head 0 panel
  hwy::AlignedFreeUniquePtr<float[]> qt;      // per panel, per query block d × 64: scale·Qᵀ
  hwy::AlignedFreeUniquePtr<float[]> dot;     // per panel, per query block dv × 64: dOᵀ
  hwy::AlignedFreeUniquePtr<float[]> lse;     // nq_ld per panel: −inf and padding → +inf
  hwy::AlignedFreeUniquePtr<float[]> delta;   // nq_ld per panel: D_i
  hwy::AlignedFreeUniquePtr<float[]> sink_terms;  // nq_ld per panel: −exp(sink − lse_i)·D_i
  hwy::AlignedFreeUniquePtr<float[]> q_rows;  // nq_ld × d_ld per panel, if d % lanes ≠ 0
  hwy::AlignedFreeUniquePtr<float[]> dout_rows;  // nq_ld × dv_ld, if dv % lanes ≠ 0
  // bfloat16 with dot products (bf16_dot.hpp): per query block, Q and dO paired along
  // the head dim (the right operands of S and dP, columns = the block's queries) and Q
  // paired across queries (dK's, columns = the head dim). Unscaled Q: the products of
  // two bfloat16 values are exact in float32, scale·q would not be.
  bool dots = false;
  bool amx = false;  // the products on the AMX tiles (amx_dot.hpp), as the forward's
  size_t q_pair_words = 0, dout_pair_words = 0, q_row_pair_ld = 0;
  ScratchWords q_pairs, dout_pairs, q_row_pairs;
  // dV = Pᵀ·dO on the dot products too (P as one bf16 term): dO paired across the block's
  // queries, as Q is for dK.
  size_t dout_row_pair_ld = 0;
  ScratchWords dout_row_pairs;
  const detail::Extents* e = nullptr;
  const detail::Sequences* sequences = nullptr;

  // widen: the storage type is not float, so Q and dO rows need float copies anyway.
  Packed(const detail::Extents& extents, const detail::Sequences& seqs, size_t vector_lanes,
         bool widen, Bf16Unit unit)
      : lanes(vector_lanes),
        d_ld(round_up(static_cast<size_t>(extents.head_dim), vector_lanes)),
        dv_ld(round_up(static_cast<size_t>(extents.v_dim), vector_lanes)),
        pad_q_rows(widen || static_cast<size_t>(extents.head_dim) % vector_lanes != 0),
        pad_dout_rows(widen || static_cast<size_t>(extents.v_dim) % vector_lanes != 0),
        e(&extents),
        sequences(&seqs) {
    size_t columns = 0;
    for (int64_t b = 0; b < seqs.count; ++b) {
      column_offset.push_back(columns);
      columns += static_cast<size_t>(extents.q_heads) * nq_ld(b);
    }
    dots = unit != Bf16Unit::fp32_fma;
    amx = unit == Bf16Unit::amx;
    // The float panels and rows feed the float products only (none with dots).
    const size_t float_columns = dots ? 0 : columns;
    qt = AllocateFloats(float_columns * static_cast<size_t>(extents.head_dim));
    dot = AllocateFloats(float_columns * static_cast<size_t>(extents.v_dim));
    lse = AllocateFloats(columns);
    delta = AllocateFloats(columns);
    sink_terms = AllocateFloats(columns);
    q_rows = AllocateFloats(pad_q_rows ? float_columns * d_ld : 0);
    dout_rows = AllocateFloats(pad_dout_rows ? float_columns * dv_ld : 0);
    if (dots) {  // per query block: ⌈d/2⌉ × 64 and 32 × pair_ld(d) words (⌈dv/2⌉ × 64 for dO)
      const size_t d = static_cast<size_t>(extents.head_dim), dv = static_cast<size_t>(extents.v_dim);
      q_pair_words = (d + 1) / 2 * kBlockQueries;
      dout_pair_words = (dv + 1) / 2 * kBlockQueries;
      q_row_pair_ld = bf16dot::pair_ld(d);
      const size_t blocks = columns / kBlockQueries;
      q_pairs.assign(blocks * q_pair_words, 0);
      dout_pairs.assign(blocks * dout_pair_words, 0);
      q_row_pairs.assign(blocks * kBlockQueries / 2 * q_row_pair_ld, 0);
      dout_row_pair_ld = bf16dot::pair_ld(dv);
      dout_row_pairs.assign(blocks * kBlockQueries / 2 * dout_row_pair_ld, 0);
    }
  }
  size_t block_index(int64_t b, int64_t h, int64_t first) const {
    return (panel(b, h) + static_cast<size_t>(first)) / kBlockQueries;
  }
  // The pair panels of the query block starting at `first` (see `dots` above).
  const uint32_t* q_pairs_block(int64_t b, int64_t h, int64_t first) const {
    return q_pairs.data() + block_index(b, h, first) * q_pair_words;
  }
  const uint32_t* dout_pairs_block(int64_t b, int64_t h, int64_t first) const {
    return dout_pairs.data() + block_index(b, h, first) * dout_pair_words;
  }
  const uint32_t* q_row_pairs_block(int64_t b, int64_t h, int64_t first) const {
    return q_row_pairs.data() + block_index(b, h, first) * (kBlockQueries / 2) * q_row_pair_ld;
  }
  const uint32_t* dout_row_pairs_block(int64_t b, int64_t h, int64_t first) const {
    return dout_row_pairs.data() + block_index(b, h, first) * (kBlockQueries / 2) * dout_row_pair_ld;
  }


  size_t nq_ld(int64_t b) const {
    return round_up(static_cast<size_t>(sequences->q_len(b)), kBlockQueries);
  }
  size_t panel(int64_t b, int64_t h) const {  // first column of the (b, h) panel
    return column_offset[static_cast<size_t>(b)] + static_cast<size_t>(h) * nq_ld(b);
  }
  // The d × kBlockQueries block of Qᵀ (dv × kBlockQueries of dOᵀ) whose first query is
  // `first` (a multiple of kBlockQueries); its rows are kBlockQueries floats apart.
  float* qt_block(int64_t b, int64_t h, int64_t first) const {
    return qt.get() + (panel(b, h) + static_cast<size_t>(first)) * static_cast<size_t>(e->head_dim);
  }
  float* dot_block(int64_t b, int64_t h, int64_t first) const {
    return dot.get() + (panel(b, h) + static_cast<size_t>(first)) * static_cast<size_t>(e->v_dim);
  }
  float* lse_of(int64_t b, int64_t h) const { return lse.get() + panel(b, h); }
  float* delta_of(int64_t b, int64_t h) const { return delta.get() + panel(b, h); }
  float* sink_terms_of(int64_t b, int64_t h) const { return sink_terms.get() + panel(b, h); }
  float* q_rows_of(int64_t b, int64_t h) const { return q_rows.get() + panel(b, h) * d_ld; }
  float* dout_rows_of(int64_t b, int64_t h) const {
    return dout_rows.get() + panel(b, h) * dv_ld;
  }
};

template <class T>
void PackQueryBlock(const detail::BackwardProblem<T>& p, const detail::TilePlan& plan,
                    const ForwardTask& task, Packed& packed) {
  const auto rows = p.rows();
  const detail::Extents& e = p.extents;
  const int64_t b = task.batch, h = task.head, first = task.first_query;
  const size_t count = static_cast<size_t>(std::min(kBlockQueries, p.mask.q_len(b) - first));
  // The block's columns, up to whole vectors (the last block also zeroes the padding).
  const size_t cols = std::min(round_up(count, packed.lanes),
                               packed.nq_ld(b) - static_cast<size_t>(first));
  const size_t d = static_cast<size_t>(e.head_dim), dv = static_cast<size_t>(e.v_dim);

  // The block's transposed panels (rows kBlockQueries floats apart), for the float
  // products only: the dot products take the pair panels below instead.
  if (!packed.dots) {
    PackTransposed(rows.q(b, first, h), p.args.q.strides[1], count, d, static_cast<float>(p.scale),
                   packed.qt_block(b, h, first), kBlockQueries, cols);
    PackTransposed(rows.dout(b, first, h), p.args.dout.strides[1], count, dv, 1.0f,
                   packed.dot_block(b, h, first), kBlockQueries, cols);
  }
  // D_i = ⟨dO_i, O_i⟩ in double: it is subtracted from every dP_ij of the row.
  double dots[kBlockQueries];
  DotsWidened(rows.dout(b, first, h), p.args.dout.strides[1], rows.out(b, first, h),
              p.args.out.strides[1], count, dv, dots);

  float* lse = packed.lse_of(b, h) + first;
  float* delta = packed.delta_of(b, h) + first;
  float* sink_terms = packed.sink_terms_of(b, h) + first;
  const detail::ScoreModifiers& mods = p.modifiers;
  for (size_t i = 0; i < cols; ++i) {
    sink_terms[i] = 0.0f;
    if (i >= count) {
      lse[i] = kPlusInf;
      delta[i] = 0.0f;
      continue;
    }
    const int64_t query = first + static_cast<int64_t>(i);
    const float value = rows.lse(b, h, query);
    lse[i] = value == kMinusInf ? kPlusInf : value;
    const float* shifts = plan.degenerate_rows(b, h, first);
    if (shifts != nullptr && shifts[i] != 0.0f && value != kMinusInf)  // see block_mask.hpp
      lse[i] = degenerate_row_lse(p.mask, b, h, query, shifts[i]);
    const double dot_product = dots[i];
    delta[i] = static_cast<float>(dot_product);
    // The sink is a softmax entry without a value: dP_sink = 0, so
    // dS_sink = P_sink·(0 − D_i) with P_sink = exp(sink − lse_i).
    if (mods.has_sinks() && value != kMinusInf)
      sink_terms[i] = static_cast<float>(-std::exp(static_cast<double>(mods.sinks[h]) - value) *
                                         dot_product);
  }
  if constexpr (std::is_same_v<T, bfloat16>) {
    if (packed.dots) {
      auto* block = const_cast<uint32_t*>(packed.q_pairs_block(b, h, first));
      bf16dot::PackQueryPairs(rows.q(b, first, h), p.args.q.strides[1], count, d, block, kBlockQueries);
      block = const_cast<uint32_t*>(packed.dout_pairs_block(b, h, first));
      bf16dot::PackQueryPairs(rows.dout(b, first, h), p.args.dout.strides[1], count, dv, block, kBlockQueries);
      block = const_cast<uint32_t*>(packed.q_row_pairs_block(b, h, first));
      bf16dot::PackRowPairs(rows.q(b, first, h), p.args.q.strides[1], count, d, block, packed.q_row_pair_ld);
      block = const_cast<uint32_t*>(packed.dout_row_pairs_block(b, h, first));
      bf16dot::PackRowPairs(rows.dout(b, first, h), p.args.dout.strides[1], count, dv, block, packed.dout_row_pair_ld);
    }
  }
  if (packed.dots) return;  // the float rows below serve the float products only
  if (packed.pad_q_rows)
    WidenRows(rows.q(b, first, h), p.args.q.strides[1], count, d,
              packed.q_rows_of(b, h) + static_cast<size_t>(first) * packed.d_ld, packed.d_ld);
  if (packed.pad_dout_rows)
    WidenRows(rows.dout(b, first, h), p.args.dout.strides[1], count, dv,
              packed.dout_rows_of(b, h) + static_cast<size_t>(first) * packed.dv_ld,
              packed.dv_ld);
}

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
