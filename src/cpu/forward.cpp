// Fused forward, FlashAttention-2 style. For each (batch, head, block of 64 queries):
//
//   Qᵀ ← scale · Q_blockᵀ                                  packed once, d × 64
//   m = sink or −inf, l = 1 or 0                             (a sink: a key with no value)
//   for each key block whose tile the plan (core/tile_plan.hpp) does not skip (64 keys):
//     Sᵀ = K_blk · Qᵀ                                       micro-kernel, K read in place
//     variants: Sᵀ ← c·tanh(Sᵀ/c) (soft-cap), Sᵀ −= slope·|i + off − j| (ALiBi),
//       Sᵀ ← score_mod(Sᵀ) (the user's tile loop, modifier_tiles-inl.h)
//     partial tiles only: mask Sᵀ (window/causal/padding edges, elementwise masks; SIMD;
//       then mask_mod)
//     m' = max(m, max_j Sᵀ),  P = exp(Sᵀ − m'),  l = l·e^(m−m') + Σ_j P
//     dropout: P ← P ⊙ Z  (Z = 0 or 1/(1−p), a hash of the indices; l keeps Σ P)
//     acc = acc·e^(m−m') + P·V_blk      micro-kernel (V read in place), summed per block
//   out = acc / l,   lse = m + log l                        (l = 0: out 0, lse -inf)
//
// With statistics asked for (qkv/attention_stats.hpp), the online softmax also keeps
// u = Σ e^(S−m)(S−m) per query (a sink included, before dropout), and each row's largest
// weight 1/l and entropy ln l − u/l are summed per block (in double); the blocks' sums
// are added per (batch, head) in task order after the parallel loop, so they too are the
// same for any thread count.
//
// Extra memory: per thread, Qᵀ (d × 64), Sᵀ (64 × 64), acc (64 × dv) and a few vectors;
// nothing grows with N. One source for every storage type T (storage-inl.h): float K
// and V are read in place; bfloat16/float16 blocks are widened to float once per (task,
// key block) into per-thread scratch (64·(d + dv) conversions against 64·64·(d + dv)
// FMAs), Q is widened as it is packed, out is rounded to T once per element. Work is handed out heaviest first (causal: late query blocks),
// dynamically; each output block has one writer, so any thread count gives the same bits.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/forward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "cpu/block_ops-inl.h"
#include "cpu/gemm-inl.h"
#include "cpu/finite_scan-inl.h"
#include "cpu/modifier_tiles-inl.h"
#include "cpu/decode_tiles-inl.h"
#include "cpu/score_pipeline-inl.h"
#include "cpu/forward_rows-inl.h"

#ifndef QKV_CPU_FORWARD_ONCE_
#define QKV_CPU_FORWARD_ONCE_
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "core/head_stats.hpp"
#include "core/tile_plan.hpp"
#include "cpu/block_mask.hpp"
#include "cpu/finite_scan.hpp"
#include "cpu/mask_tiles.hpp"
#include "cpu/amx_dot.hpp"
#include "cpu/bf16_dot.hpp"
#include "cpu/blocking.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/dot_products.hpp"
#include "cpu/prefetch_policy.hpp"
#include "cpu/decode.hpp"
#include "cpu/work_order.hpp"
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {

namespace {

// Per-thread scratch, laid out once per call (sizes in floats).
struct ForwardScratch {
  size_t width;  // query columns of a tile: kBlockQueries rounded up to whole vectors
  size_t dv_ld;  // row length of acc and of a padded V block
  hwy::AlignedFreeUniquePtr<float[]> qt;     // d × width: scale·Qᵀ of the block
  hwy::AlignedFreeUniquePtr<float[]> st;     // kBlockKeys × width: Sᵀ, then Pᵀ
  hwy::AlignedFreeUniquePtr<float[]> add;    // kBlockKeys × width: a partial tile's mask
  hwy::AlignedFreeUniquePtr<float[]> acc;    // width × dv_ld: unnormalized output rows
  hwy::AlignedFreeUniquePtr<float[]> v_pad;  // kBlockKeys × dv_ld: V padded (dv % lanes ≠ 0) or widened
  hwy::AlignedFreeUniquePtr<float[]> k_wide; // kBlockKeys × d: K widened, 16-bit storage only
  hwy::AlignedFreeUniquePtr<float[]> stats;  // m, l, alpha, u: 4 × width
  std::vector<int32_t> key_begin, key_end;   // width (0 past the block's queries)
  std::vector<uint32_t> dropout_keys;        // width: dropout row keys of the block
  // A float problem whose short sequences take the split-K schedule's logits (cpu::
  // split_k_logits_for; decode_tiles-inl.h), so that its backward sees the same logits.
  bool split_k_logits;
  SplitKLogits split_k;
  // bfloat16 with dot products (dot_products.hpp, bf16_dot.hpp): Q, P and V as pairs;
  // `amx`: the products on the AMX tiles (amx_dot.hpp), else on vdpbf16ps.
  bool dots, amx;
  std::vector<uint32_t> q_pairs, p_pairs, v_pairs;
  bool prefetch;  // the next K/V block requested ahead (cpu::prefetch_next_key_block)

  template <class T>
  // `unit`: bf16_unit, and `prefetch`, decided once before the parallel region (they may
  // throw, and an exception must not leave an OpenMP region).
  ForwardScratch(const detail::ForwardProblem<T>& p, size_t lanes, Bf16Unit unit, bool prefetch_next)
      : width(round_up(kBlockQueries, lanes)),
        dv_ld(round_up(static_cast<size_t>(p.extents.v_dim), lanes)),
        qt(AllocateFloats(static_cast<size_t>(p.extents.head_dim) * width)),
        st(AllocateFloats(kBlockKeys * width)),
        add(AllocateFloats(p.mask.has_elementwise() ? kBlockKeys * width : 0)),
        acc(AllocateFloats(width * dv_ld)),
        v_pad(AllocateFloats(kIsHalf<T> || p.extents.v_dim % static_cast<int64_t>(lanes)
                                 ? kBlockKeys * dv_ld
                                 : 0)),
        k_wide(AllocateFloats(kIsHalf<T> ? kBlockKeys * static_cast<size_t>(p.extents.head_dim)
                                         : 0)),
        stats(AllocateFloats(4 * width)),
        key_begin(width, 0),
        key_end(width, 0),
        dropout_keys(width, 0),
        split_k_logits(std::is_same_v<T, float> && split_k_eligible(p.mask, p.modifiers)),
        split_k(static_cast<size_t>(p.extents.head_dim), kBlockQueries, kBlockKeys, split_k_logits),
        dots(unit != Bf16Unit::fp32_fma),
        amx(unit == Bf16Unit::amx),
        q_pairs(dots ? (static_cast<size_t>(p.extents.head_dim) + 1) / 2 * bf16dot::pair_ld(kBlockQueries) : 0),
        p_pairs(dots ? kBlockKeys / 2 * bf16dot::pair_ld(kBlockQueries) : 0),
        v_pairs(dots ? kBlockKeys / 2 * bf16dot::pair_ld(static_cast<size_t>(p.extents.v_dim)) : 0),
        prefetch(prefetch_next) {}
};

// Attention health of a block's rows from the online softmax's own sums (see
// OnlineSoftmaxStep): largest weight 1/l and entropy ln l − u/l, with SIMD (Highway's
// Log: 4 ULP), into `weight` and in place of u; rows without keys (l = 0) get 0s. Then
// the block's sums in row order; rows without keys add nothing but their 0 row values.
template <class T>
void RowStatistics(const detail::ForwardProblem<T>& p, const QueryRows& rows,
                   const float* HWY_RESTRICT l, float* HWY_RESTRICT u,
                   float* HWY_RESTRICT weight, size_t width, detail::HeadStatsSum& sum) {
  const FloatTag d;
  const size_t lanes = hn::Lanes(d);
  const auto zero = hn::Zero(d), one = hn::Set(d, 1.0f);
  for (size_t i = 0; i < width; i += lanes) {
    const auto total = hn::LoadU(d, l + i);
    const auto empty = hn::Eq(total, zero);
    const auto inverse = hn::Div(one, total);
    const auto entropy = hn::NegMulAdd(hn::LoadU(d, u + i), inverse, hn::Log(d, total));
    hn::StoreU(hn::IfThenZeroElse(empty, inverse), d, weight + i);
    hn::StoreU(hn::IfThenZeroElse(empty, entropy), d, u + i);
  }
  detail::HeadStatsSum block;  // summed here, stored once: no false sharing between tasks
  const double threshold = p.stats.saturation_threshold;
  const bool row_views = p.stats.any_row_view();
  for (int64_t i = 0; i < rows.count; ++i) {
    if (row_views) detail::write_row_stats(p, rows.batch, rows.head, rows.first + i, weight[i], u[i]);
    if (l[i] != 0.0f) block.add_row(weight[i], u[i], threshold);
  }
  sum = block;
}

// block_stats: where the block's statistics go, or null when none are asked for.
template <class T>
void ForwardBlock(const detail::ForwardProblem<T>& p, const detail::TilePlan& plan,
                  const KeyValueFinite& finite, const SharedMaskTiles& shared, const PackedBlocks<T>& packed_values,
                  const ForwardTask& task, ForwardScratch& s, detail::HeadStatsSum* block_stats) {
  const detail::Extents& e = p.extents;
  const auto rows_of = p.rows();
  const size_t lanes = VectorLanes();
  const size_t d = static_cast<size_t>(e.head_dim), dv = static_cast<size_t>(e.v_dim);
  const int64_t b = task.batch, h = task.head, kv_head = e.kv_head_of(h);
  const int64_t q_block = task.first_query / kBlockQueries;
  const int64_t k_len = p.mask.sequences.k_len(b);

  QueryRows rows{.batch = b, .head = h, .first = task.first_query,
                 .count = std::min(kBlockQueries, p.mask.q_len(b) - task.first_query),
                 .degenerate = plan.degenerate_rows(b, h, task.first_query)};
  const size_t count = static_cast<size_t>(rows.count);
  const size_t width = round_up(count, lanes);  // query columns computed this block
  describe_rows(p.mask, rows, s.key_begin.data(), s.key_end.data(), width);
  const detail::ScoreModifiers& mods = p.modifiers;
  const uint32_t dropout_threshold = detail::dropout_threshold(mods.dropout.p);
  const float dropout_scale = 1.0f / (1.0f - mods.dropout.p);
  if (mods.has_dropout()) {
    const uint32_t head_key = detail::dropout_head_key(mods.dropout.seed, mods.dropout.offset, b, h);
    for (size_t i = 0; i < width; ++i)
      s.dropout_keys[i] = detail::dropout_row_key(head_key, rows.first + static_cast<int64_t>(i));
  }

  if constexpr (std::is_same_v<T, bfloat16>) {
    if (s.dots)  // Q unscaled: the scale multiplies the float32 sums
      bf16dot::PackQueryPairs(rows_of.q(b, rows.first, h), p.args.q.strides[1], count, d, s.q_pairs.data(),
                              bf16dot::pair_ld(kBlockQueries));
  }
  if (!s.dots)
    PackTransposed(rows_of.q(b, rows.first, h), p.args.q.strides[1], count, d,
                   static_cast<float>(p.scale), s.qt.get(), width, width);

  float* m = s.stats.get();
  float* l = m + s.width;
  float* alpha = l + s.width;
  float* u = alpha + s.width;
  // A sink is a key with logit sinks[h] and no value: it starts every row's max and sum
  // (and adds e^0·0 = 0 to u).
  std::fill(m, m + width, mods.has_sinks() ? mods.sinks[h] : kMinusInf);
  std::fill(l, l + width, mods.has_sinks() ? 1.0f : 0.0f);
  if (block_stats != nullptr) std::fill(u, u + width, 0.0f);
  std::fill(s.acc.get(), s.acc.get() + count * s.dv_ld, 0.0f);

  const int64_t k_row = p.args.k.strides[1], v_row = p.args.v.strides[1];
  const int64_t last_block = plan.last_key_block(b, h, q_block);
  // One tile configuration for the block's products, unless a user's hook runs between
  // them (amx_dot.hpp).
  const amx::TileScope tile_scope(s.amx && !mods.has_score_mod() && !p.mask.mask_mod.active());
  for (int64_t k_block = plan.first_key_block(b, h, q_block); k_block <= last_block; ++k_block) {
    const detail::Tile tile = plan.at(b, h, q_block, k_block);
    if (tile == detail::Tile::empty) continue;
    const int64_t first_key = k_block * kBlockKeys;
    const int64_t keys = std::min(kBlockKeys, k_len - first_key);
    // K and V as float rows: in place, or widened into scratch (V then padded to dv_ld).
    const float* k = nullptr;
    const float* v = nullptr;
    size_t k_ld = 0, v_ld = 0;
    if constexpr (kIsHalf<T>) {
      if (!s.dots) {
      WidenRows(rows_of.k(b, first_key, kv_head), k_row, static_cast<size_t>(keys), d,
                s.k_wide.get(), d);
      WidenRows(rows_of.v(b, first_key, kv_head), v_row, static_cast<size_t>(keys), dv,
                s.v_pad.get(), s.dv_ld);
      k = s.k_wide.get(), k_ld = d, v = s.v_pad.get(), v_ld = s.dv_ld;
      }
    } else {
      k = rows_of.k(b, first_key, kv_head), k_ld = static_cast<size_t>(k_row);
      v = rows_of.v(b, first_key, kv_head), v_ld = static_cast<size_t>(v_row);
    }

    // The next block's K and V, every line, requested ahead where measurement showed the
    // hardware prefetcher falling behind (Zen 4, thread CPU time, N = 4096, 8 heads; on
    // Intel it does not, and s.prefetch is off: cpu/prefetch_policy.cpp): rows that
    // are not adjacent ([B, N, H, d]: a row every H·d floats; d = 64: 70% → 73% of the
    // FMA peak), and long rows (d = 128, [B, H, N, d]: 77% → 84%). Adjacent rows of 64
    // floats gained nothing (83% either way), so they are left to the hardware.
    // V's rows are not read where its pairs were packed once per call (bfloat16 on the
    // dot products): requesting them anyway stalled on the miss buffers, ~15% of the
    // block's own time outside the tiles (Zen 4, bf16, d 128, N 4096).
    const bool adjacent = k_row == static_cast<int64_t>(d) && v_row == static_cast<int64_t>(dv);
    if (s.prefetch && k_block < last_block && (!adjacent || d + dv >= 256)) {
      const size_t next = static_cast<size_t>(std::min(kBlockKeys, k_len - first_key - kBlockKeys));
      PrefetchRows(rows_of.k(b, first_key + kBlockKeys, kv_head), k_row, next, d);
      if (!(s.dots && packed_values.active()))
        PrefetchRows(rows_of.v(b, first_key + kBlockKeys, kv_head), v_row, next, dv);
    }
    // Sᵀ = K_blk · (scale·Qᵀ)
    const bool split_k_logits = s.split_k_logits && split_k_logits_for(p.mask, b);
    if constexpr (std::is_same_v<T, float>) {
      if (split_k_logits)
        s.split_k.Tile(rows_of.q(b, rows.first, h), p.args.q.strides[1], count, static_cast<float>(p.scale), k,
                       static_cast<int64_t>(k_ld), static_cast<size_t>(keys), s.st.get(), width);
    }
    if constexpr (std::is_same_v<T, bfloat16>) {
      if (s.dots)
        (s.amx ? amx::ScoresTransposed : bf16dot::ScoresTransposed)(
            rows_of.k(b, first_key, kv_head), k_row, static_cast<size_t>(keys), d, s.q_pairs.data(),
            bf16dot::pair_ld(kBlockQueries), width, static_cast<float>(p.scale), s.st.get(), width);
    }
    if (!split_k_logits && !s.dots)
      Gemm(static_cast<size_t>(keys), width, d, StridedA{k, k_ld, 1},
           s.qt.get(), width, s.st.get(), width, /*accumulate=*/false);
    // Soft-cap, ALiBi, score_mod, then the mask on partial tiles (core/score_pipeline.hpp).
    const bool partial = tile == detail::Tile::partial;
    detail::apply_score_pipeline(mods, TileStages{.rule = p.mask, .mods = mods, .rows = rows,
                                                  .first_key = first_key, .keys = keys,
                                                  .st = s.st.get(), .width = width,
                                                  .partial = partial, .shared = &shared,
                                                  .add = s.add.get()});

    if (block_stats == nullptr) {
      OnlineSoftmaxStep(s.st.get(), static_cast<size_t>(keys), width, m, l, alpha);
    } else if (partial) {
      OnlineSoftmaxStep<SoftmaxStats::masked>(s.st.get(), static_cast<size_t>(keys), width, m,
                                              l, alpha, u);
    } else {
      OnlineSoftmaxStep<SoftmaxStats::unmasked>(s.st.get(), static_cast<size_t>(keys), width, m,
                                                l, alpha, u);
    }
    // Dropout acts on the weights that reach V; l keeps the undropped sum (and u is of
    // the softmax before dropout: the statistics describe P itself).
    if (mods.has_dropout())
      DropoutTile(s.st.get(), static_cast<size_t>(keys), width, first_key, s.dropout_keys.data(),
                  dropout_threshold, dropout_scale);

    // acc = acc·alpha + P·V_blk, with P read in place from Pᵀ. A removed key's V may hold
    // NaN/Inf (scanned once per call): then only the terms with P ≠ 0 are summed.
    if (partial && !finite.values(b, kv_head, k_block)) {
      if (s.dots) {  // this rare block takes the float32 path, which skips the zeros
        WidenRows(rows_of.v(b, first_key, kv_head), v_row, static_cast<size_t>(keys), dv, s.v_pad.get(), s.dv_ld);
        v = s.v_pad.get(), v_ld = s.dv_ld;
      }
      ScaleRows(s.acc.get(), count, s.dv_ld, s.dv_ld, alpha);
      AccumulateSkippingZeros(s.st.get(), width, count, static_cast<size_t>(keys), v,
                              static_cast<int64_t>(v_ld), dv, s.acc.get(), s.dv_ld);
      continue;
    }
    if constexpr (std::is_same_v<T, bfloat16>) {
      if (s.dots && packed_values.active()) {  // V's pairs packed once per call
        const uint32_t* v_pairs = packed_values.block(p, b, kv_head, k_block);
        if (s.amx)
          amx::AddWeightedPairs(s.st.get(), width, count, static_cast<size_t>(keys), v_pairs, packed_values.ld(), dv,
                                s.acc.get(), s.dv_ld, alpha);
        else
          bf16dot::AddWeightedPairs(s.st.get(), width, count, static_cast<size_t>(keys), v_pairs, packed_values.ld(),
                                    dv, s.p_pairs.data(), s.acc.get(), s.dv_ld, alpha);
        continue;
      }
      if (s.dots) {  // P as one bfloat16 term (bf16_dot.hpp); the sums stay float32
        (s.amx ? amx::RescaleAddWeighted : bf16dot::RescaleAddWeighted)(
            s.st.get(), width, count, static_cast<size_t>(keys), rows_of.v(b, first_key, kv_head), v_row, dv,
            {s.p_pairs.data(), s.v_pairs.data()}, s.acc.get(), s.dv_ld, alpha);
        continue;
      }
    }
    const float* v_operand = v;
    if (!kIsHalf<T> && dv % lanes != 0) {  // odd value dims: pad rows to whole vectors
      PackRowsPadded(v, v_row, static_cast<size_t>(keys), dv, s.v_pad.get(), s.dv_ld);
      v_operand = s.v_pad.get();
      v_ld = s.dv_ld;
    }
    // The block's product is summed from zero and then added: summing it onto the
    // running total would make the rounding error grow with N, not with the block.
    GemmRescaleAdd(count, s.dv_ld, static_cast<size_t>(keys), StridedA{s.st.get(), 1, width},
                   v_operand, v_ld, s.acc.get(), s.dv_ld, alpha);
  }

  WriteOutputRows(p, rows, s.acc.get(), s.dv_ld, m, l);
  // alpha is free now: it takes the rows' largest weights.
  if (block_stats != nullptr) RowStatistics(p, rows, l, u, alpha, width, *block_stats);
}

// The per-(batch, head) statistics: the blocks' sums added in task order (fixed by the
// problem, not by the threads).
template <class T>
void WriteHeadStatistics(const detail::ForwardProblem<T>& p,
                         const std::vector<ForwardTask>& tasks,
                         const std::vector<detail::HeadStatsSum>& block_stats) {
  const detail::Extents& e = p.extents;
  std::vector<detail::HeadStatsSum> heads(static_cast<size_t>(e.batch * e.q_heads));
  for (size_t t = 0; t < tasks.size(); ++t)
    heads[static_cast<size_t>(tasks[t].batch * e.q_heads + tasks[t].head)].add(block_stats[t]);
  for (int64_t b = 0; b < e.batch; ++b)
    for (int64_t h = 0; h < e.q_heads; ++h)
      detail::write_head_stats(p.stats, b, h, heads[static_cast<size_t>(b * e.q_heads + h)]);
}

}  // namespace

template <class T>
void ForwardImpl(const detail::ForwardProblem<T>& p) {
  const detail::TilePlan plan(p.mask, p.extents, kBlockQueries, kBlockKeys, p.threads);
  const std::vector<ForwardTask> tasks = forward_tasks(p.extents, p.mask, plan);
  std::vector<detail::HeadStatsSum> block_stats(p.collect_stats ? tasks.size() : 0);
  if (tasks.empty()) {
    if (p.collect_stats) WriteHeadStatistics(p, tasks, block_stats);  // no rows: NaN, 0
    return;
  }
  KeyValueFinite finite(p.extents);
  const std::vector<KeyBlock> scans = finite.blocks_to_scan(plan, p.mask.sequences);
  const SharedMaskTiles shared(p.mask, p.extents, plan);
  const int threads = threads_for(p.threads, tasks.size(), forward_flops(tasks, p.extents));
  const Bf16Unit unit = std::is_same_v<T, bfloat16> ? bf16_unit(p.precision) : Bf16Unit::fp32_fma;  // may throw: here
  const bool prefetch = prefetch_next_key_block();  // may throw too
  const bool rows_fit = RowKernelFits(p, unit);
  const PackedBlocks<T> packed_values(p, PackedKind::values, unit != Bf16Unit::fp32_fma);
  const PackedBlocks<T> packed_keys(p, PackedKind::keys, rows_fit);
  const bool row_kernel = rows_fit && packed_keys.active() && packed_values.active();
#pragma omp parallel num_threads(threads) if (threads > 1)  // one thread: no region at all
  {
    // Non-finite K/V scan of the key blocks that partial tiles read, once per call.
#pragma omp for schedule(dynamic, 16) nowait
    for (size_t t = 0; t < scans.size(); ++t) ScanKeyValueBlock(p, scans[t], finite);
    // The tiles' V (and the row kernel's K) pairs, once per call (done before the tasks:
    // the barrier below).
#pragma omp for schedule(dynamic, 16) nowait
    for (size_t t = 0; t < packed_values.size(); ++t) packed_values.pack(p, t);
#pragma omp for schedule(dynamic, 16) nowait
    for (size_t t = 0; t < packed_keys.size(); ++t) packed_keys.pack(p, t);
    // The mask tiles shared by every head, once per call.
#pragma omp for schedule(dynamic, 4)
    for (size_t t = 0; t < shared.size(); ++t) shared.build(p.mask, plan, t);
    ForwardScratch scratch(p, VectorLanes(), unit, prefetch);
    std::unique_ptr<RowScratch> rows_scratch(row_kernel ? new RowScratch(p.extents) : nullptr);
#pragma omp for schedule(dynamic, 1)
    for (size_t t = 0; t < tasks.size(); ++t) {
      if (row_kernel && RowsForwardBlock(p, plan, finite, packed_keys, packed_values, tasks[t], *rows_scratch))
        continue;
      ForwardBlock(p, plan, finite, shared, packed_values, tasks[t], scratch,
                   p.collect_stats ? &block_stats[t] : nullptr);
    }
  }
  if (p.collect_stats) WriteHeadStatistics(p, tasks, block_stats);
}

// One entry per storage type (HWY_EXPORT takes plain functions, not templates).
void ForwardFloat32(const detail::ForwardProblem<float>& p) { ForwardImpl(p); }
void ForwardBfloat16(const detail::ForwardProblem<bfloat16>& p) { ForwardImpl(p); }
void ForwardFloat16(const detail::ForwardProblem<float16>& p) { ForwardImpl(p); }

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::cpu {
HWY_EXPORT(ForwardFloat32);
HWY_EXPORT(ForwardBfloat16);
HWY_EXPORT(ForwardFloat16);

void forward(const detail::ForwardProblem<float>& problem) {
  if (runs_split_k(problem)) return decode(problem);  // the schedule, chosen in forward_schedule.cpp
  tiled_forward(problem);
}
void tiled_forward(const detail::ForwardProblem<float>& problem) {
  apply_simd_target_override();
  HWY_DYNAMIC_DISPATCH(ForwardFloat32)(problem);
}
void forward(const detail::ForwardProblem<bfloat16>& problem) {
  if (runs_split_k(problem)) return split_k_half(problem);  // forward_schedule.cpp
  apply_simd_target_override();
  HWY_DYNAMIC_DISPATCH(ForwardBfloat16)(problem);
}
void forward(const detail::ForwardProblem<float16>& problem) {
  if (runs_split_k(problem)) return split_k_half(problem);
  apply_simd_target_override();
  HWY_DYNAMIC_DISPATCH(ForwardFloat16)(problem);
}
}  // namespace qkv::cpu
#endif
