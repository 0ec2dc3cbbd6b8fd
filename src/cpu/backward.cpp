// Fused backward, FlashAttention-2 style, without atomics and without a
// thread-count-dependent reduction (bitwise identical results for any number of
// threads). Two schedules (work_order.hpp, backward_single_pass): with many heads, one
// task per (batch, kv head) does passes 1 and 2 together (dQ accumulated in key-block
// order); with few heads, the two passes below run as separate parallel loops.
//
// In the forward pass  Sᵀ = K·(scale·Q)ᵀ,  P = exp(S − lse),  O = P·V;  so now:
//   prepack (per query block): scale·Qᵀ, dOᵀ, lse (−inf → +inf so masked rows give
//     P = 0), D = rowsum(dO ⊙ O)                       (FlashAttention's D_i = ⟨P_i, dP_i⟩)
//   pass 1, one task per (batch, kv head, 64 keys), over every query tile the plan keeps:
//     Pᵀ = exp(K_blk·Qᵀ − lse),  dV += Pᵀ·dO,  dPᵀ = V_blk·dOᵀ,  dSᵀ = Pᵀ⊙(dPᵀ − D),
//     dK += dSᵀ·Q                                         (scaled once at the end)
//   pass 2, one task per (batch, head, 64 queries), over every key it sees:
//     the same Pᵀ and dSᵀ, then dQ += dS·K_blk              (scaled once at the end)
// Run separately, pass 2 recomputes S and dP (7 block products instead of 5): the price
// of using every core on one head without per-thread copies of dQ.
// Variants mirror the forward: S is soft-capped (its slope 1 − tanh² kept to multiply
// dS), ALiBi added, score_mod applied (its derivative kept to multiply dS) and masked as
// there (mask_mod on partial tiles); with dropout dP ← Z ⊙ dP and dV takes P ⊙ Z;
// the sinks' gradient is −Σ_i exp(sink − lse_i)·D_i, summed in a fixed order.
//
// One source for every storage type T (storage-inl.h). The packed panels are float
// already; with bfloat16/float16 storage the Q and dO row operands are packed as float
// copies too, and each K/V block is widened once per task and key block into per-thread
// scratch (float K and V are read in place). dQ, dK, dV are rounded to T once.
// bfloat16 in Precision::fast where the CPU's dot products pay (dot_products.hpp): all
// five block products on AVX512-BF16 (bf16_dot.hpp) or the AMX tiles (amx_dot.hpp), from
// pair panels of Q and dO packed once per query block (Packed), P and dS rounded to
// bfloat16 once (kWeightTerms says why).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/backward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "cpu/block_ops-inl.h"
#include "cpu/gemm-inl.h"
#include "cpu/finite_scan-inl.h"
#include "cpu/modifier_tiles-inl.h"
#include "cpu/backward_pack-inl.h"
#include "cpu/backward_scratch-inl.h"
#include "cpu/decode_tiles-inl.h"
#include "cpu/score_pipeline-inl.h"

#ifndef QKV_CPU_BACKWARD_ONCE_
#define QKV_CPU_BACKWARD_ONCE_
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "core/tile_plan.hpp"
#include "cpu/block_mask.hpp"
#include "cpu/finite_scan.hpp"
#include "cpu/mask_tiles.hpp"
#include "cpu/amx_dot.hpp"
#include "cpu/bf16_dot.hpp"
#include "cpu/blocking.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/decode.hpp"
#include "cpu/dot_products.hpp"
#include "cpu/work_order.hpp"
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {

namespace {

// The backward's block products on the dot products (bfloat16 storage, Packed::dots):
//   Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ: products of bfloat16 values, exact in float32 either way;
//   dV += Pᵀ·dO, dK += dSᵀ·Q and dQ += dS·K with P and dS as one bfloat16 term each, as
//     PyTorch's bf16 backward (and FlashAttention's) rounds them: the Precision::fast
//     contract, every gradient within 2× PyTorch's bf16 error (docs/numerics.md). Measured
//     (bench/RESULTS.md §10c, Zen 5): dq 9.6e-3 against PyTorch's 8.2e-3, dv 2.0e-3
//     against 1.9e-3 at worst, dk 1.4–4.3× below PyTorch's. Precision::exact keeps the
//     float32 FMAs for all five.
constexpr bf16dot::Terms kWeightTerms = bf16dot::Terms::one;

// Rows of one head in the single-pass schedule's dQ accumulator: the queries rounded up
// to whole tiles, because the AMX tiles add dS·K onto those rows in place, a whole tile
// of 16 rows at a time, and the padding rows (0 · K, NaN after an Inf in K) must be the
// head's own, never the next head's first queries.
inline size_t DqRowsPerHead(const detail::Extents& e) {
  return round_up(static_cast<size_t>(e.q_len), amx::kTileRows);
}

// Pᵀ (with dropout: P·Z, as the forward multiplied V by) and dSᵀ of one (key block,
// query block) tile into scratch.pt and scratch.dst, scored and masked exactly as the
// forward did. Returns the columns (queries, padded to whole vectors) computed.
template <class T>
size_t ScoreBlock(const Context<T>& c, const QueryRows& rows, detail::Tile tile,
                  const KeyValueRows& kv, int64_t first_key, int64_t keys, BackwardScratch& s,
                  double* alibi_sum = nullptr) {
  const auto& p = c.p;
  const detail::Extents& e = p.extents;
  const size_t width = round_up(static_cast<size_t>(rows.count), VectorLanes());
  const size_t kn = static_cast<size_t>(keys);
  const size_t offset = static_cast<size_t>(rows.first);
  const bool split_k_logits = c.split_k_logits && split_k_logits_for(p.mask, rows.batch);
  if constexpr (std::is_same_v<T, float>) {
    if (split_k_logits) {
      s.split_k.Tile(p.rows().q(rows.batch, rows.first, rows.head), p.args.q.strides[1],
                     static_cast<size_t>(rows.count), static_cast<float>(p.scale), kv.k,
                     static_cast<int64_t>(kv.k_ld), kn, s.pt.get(), width);
    }
  }
  const auto access = p.rows();
  if constexpr (std::is_same_v<T, bfloat16>) {
    if (c.packed.dots)  // the forward's scores bit for bit (the same unit), K read in place
      (c.packed.amx ? amx::ScoresTransposed : bf16dot::ScoresTransposed)(access.k(rows.batch, first_key, e.kv_head_of(rows.head)), p.args.k.strides[1], kn,
                                static_cast<size_t>(e.head_dim),
                                c.packed.q_pairs_block(rows.batch, rows.head, rows.first), kBlockQueries, width,
                                static_cast<float>(p.scale), s.pt.get(), width);
  }
  if (!split_k_logits && !c.packed.dots)
    Gemm(kn, width, static_cast<size_t>(e.head_dim), StridedA{kv.k, kv.k_ld, 1},
         c.packed.qt_block(rows.batch, rows.head, rows.first), kBlockQueries, s.pt.get(), width,
         false);
  // The forward's score pipeline (core/score_pipeline.hpp), keeping the soft-cap's and
  // score_mod's derivatives for the chain rule below.
  const detail::ScoreModifiers& mods = p.modifiers;
  detail::apply_score_pipeline(mods, TileStages{.rule = p.mask, .mods = mods, .rows = rows,
                                                .first_key = first_key, .keys = keys,
                                                .st = s.pt.get(), .width = width,
                                                .partial = tile == detail::Tile::partial,
                                                .shared = &c.shared, .add = s.add.get(),
                                                .cap_slope = s.cap.get(),
                                                .mod_slope = s.mod_slope.get()});
  ProbabilitiesFromLse(s.pt.get(), kn, width, c.packed.lse_of(rows.batch, rows.head) + offset);

  if constexpr (std::is_same_v<T, bfloat16>) {
    if (c.packed.dots)  // dPᵀ = V·dOᵀ: products of bfloat16 values, exact in float32
      (c.packed.amx ? amx::ScoresTransposed : bf16dot::ScoresTransposed)(access.v(rows.batch, first_key, e.kv_head_of(rows.head)), p.args.v.strides[1], kn,
                                static_cast<size_t>(e.v_dim),
                                c.packed.dout_pairs_block(rows.batch, rows.head, rows.first), kBlockQueries, width,
                                1.0f, s.dst.get(), width);
  }
  if (!c.packed.dots)
    Gemm(kn, width, static_cast<size_t>(e.v_dim), StridedA{kv.v, kv.v_ld, 1},
         c.packed.dot_block(rows.batch, rows.head, rows.first), kBlockQueries, s.dst.get(), width,
         false);
  // Dropout: the forward summed P·Z·V, so dP = Z ⊙ (dO·Vᵀ), and dV takes P·Z (below).
  const bool dropout = mods.has_dropout();
  const uint32_t threshold = detail::dropout_threshold(mods.dropout.p);
  const float dropout_scale = 1.0f / (1.0f - mods.dropout.p);
  if (dropout)
    DropoutTile(s.dst.get(), kn, width, first_key, s.dropout_keys.data(), threshold, dropout_scale);
  ScoreGradient(s.pt.get(), s.dst.get(), kn, width,
                c.packed.delta_of(rows.batch, rows.head) + offset);
  // Back through the pipeline: ALiBi's slope gradient is collected from dS (validation
  // refuses a score_mod together with it), then score_mod's and the cap's derivatives.
  detail::chain_score_pipeline(mods, ChainStages{.rows = rows, .alibi_offset = detail::ScoreModifiers::alibi_offset(p.mask, rows.batch),
                                                 .first_key = first_key, .keys = kn, .width = width,
                                                 .dst = s.dst.get(), .cap_slope = s.cap.get(),
                                                 .mod_slope = s.mod_slope.get(), .alibi_sum = alibi_sum,
                                                 .mods = &mods});
  if (dropout)
    DropoutTile(s.pt.get(), kn, width, first_key, s.dropout_keys.data(), threshold, dropout_scale);
  return width;
}

// dK_blk += dSᵀ·Q_blk with dot products: dSᵀ (kn rows of `width` floats, columns <
// count) as bfloat16 pairs along the queries, Q's rows paired across them (Packed).
inline void AddKeyGradient(bool on_tiles, const float* dst, size_t width, size_t kn, size_t count, const uint32_t* q_pairs,
                           size_t q_ld, size_t d, float* dk, size_t dk_ld, BackwardScratch& s) {
  constexpr size_t a_ld = kBlockQueries / 2;
  bf16dot::PairsAlongRows(dst, width, kn, count, kWeightTerms, s.ds_pairs.data(), a_ld);
  const bf16dot::LeftPairs a{s.ds_pairs.data(), a_ld, 1, kWeightTerms, kn * a_ld};
  (on_tiles ? amx::AddProduct : bf16dot::AddProduct)(a, kn, (count + 1) / 2, q_pairs, q_ld, d, dk, dk_ld);
}

// dV_blk += Pᵀ·dO_blk with dot products: Pᵀ (kn rows of `width` floats, columns < count)
// as bfloat16 pairs along the queries (one term, as the forward's P·V), dO's rows paired
// across them (Packed).
inline void AddValueGradient(bool on_tiles, const float* pt, size_t width, size_t kn, size_t count,
                             const uint32_t* dout_pairs, size_t dout_ld, size_t dv, float* dv_acc, size_t dv_ld,
                             BackwardScratch& s) {
  constexpr size_t a_ld = kBlockQueries / 2;
  bf16dot::PairsAlongRows(pt, width, kn, count, kWeightTerms, s.p_pairs.data(), a_ld);
  const bf16dot::LeftPairs a{s.p_pairs.data(), a_ld, 1, kWeightTerms, kn * a_ld};
  (on_tiles ? amx::AddProduct : bf16dot::AddProduct)(a, kn, (count + 1) / 2, dout_pairs, dout_ld, dv, dv_acc, dv_ld);
}

// K's rows of one key block paired across the keys (bf16dot::PackRowPairs) into
// s.k_pairs: the right operand of dQ += dS·K on the dot products, packed once per key
// block. The tiles read whole tiles of 16 pair rows: the rows past the block's (a
// partial last block) are zero.
template <class T>
const uint32_t* PackKeyPairs(const Context<T>& c, int64_t b, int64_t kv_head, int64_t first_key, size_t kn,
                             BackwardScratch& s) {
  if constexpr (std::is_same_v<T, bfloat16>) {
    if (c.packed.dots) {
      const size_t d = static_cast<size_t>(c.p.extents.head_dim), ld = bf16dot::pair_ld(d);
      bf16dot::PackRowPairs(c.p.rows().k(b, first_key, kv_head), c.p.args.k.strides[1], kn, d, s.k_pairs.data(), ld);
      const size_t pairs = (kn + 1) / 2;
      std::fill(s.k_pairs.begin() + static_cast<std::ptrdiff_t>(pairs * ld),
                s.k_pairs.begin() + static_cast<std::ptrdiff_t>(round_up(pairs, amx::kTileRows) * ld), 0u);
      return s.k_pairs.data();
    }
  }
  (void)c, (void)b, (void)kv_head, (void)first_key, (void)kn, (void)s;
  return nullptr;
}

// dQ_rows += dS·K_blk for the tile just scored (dS read in place from dSᵀ in s.dst).
// k_pairs: PackKeyPairs's for this key block (vdpbf16ps), else null.
template <class T>
void AccumulateQueryGradient(const Context<T>& c, const QueryRows& rows, detail::Tile tile,
                             size_t width, int64_t kv_head, const KeyValueRows& kv,
                             int64_t first_key, int64_t keys, float* dq_rows,
                             BackwardScratch& s, const uint32_t* k_pairs) {
  const Packed& packed = c.packed;
  const size_t d = static_cast<size_t>(c.p.extents.head_dim);
  const size_t kn = static_cast<size_t>(keys), count = static_cast<size_t>(rows.count);
  // A removed key's K row may hold NaN/Inf (scanned once per call): skip its dS = 0 terms.
  if (tile == detail::Tile::partial &&
      !c.finite.keys(rows.batch, kv_head, first_key / kBlockKeys)) {
    size_t k_ld = 0;
    const float* k = WidenKeys(c, kv, rows.batch, kv_head, first_key, kn, s, &k_ld);
    AccumulateSkippingZeros(s.dst.get(), width, count, kn, k, static_cast<int64_t>(k_ld), d, dq_rows,
                            packed.d_ld);
    return;
  }
  const float* k = kv.k;
  if constexpr (std::is_same_v<T, bfloat16>) {
    if (packed.dots) {  // dS as one bfloat16 term (kWeightTerms), K's pairs packed per key block
      if (packed.amx)  // onto dq_rows in the tiles: whole tiles of rows (DqRowsPerHead)
        return amx::AddWeightedPairs(s.dst.get(), width, count, kn, k_pairs, bf16dot::pair_ld(d), d, dq_rows,
                                     packed.d_ld, nullptr);
      bf16dot::AddWeightedPairs(s.dst.get(), width, count, kn, k_pairs, bf16dot::pair_ld(d), d,
                                s.p_pairs.data(), dq_rows, packed.d_ld, nullptr);
      return;
    }
  }
  const float* k_operand = k;
  size_t k_ld = kv.k_ld;
  if (packed.pad_q_rows && !kv.k_padded) {  // d is not whole vectors: pad K's rows like Q's
    PackRowsPadded(k, static_cast<int64_t>(kv.k_ld), kn, d, s.k_pad.get(), packed.d_ld);
    k_operand = s.k_pad.get();
    k_ld = packed.d_ld;
  }
  GemmAddBlock(count, packed.d_ld, kn, StridedA{s.dst.get(), 1, width}, k_operand, k_ld, dq_rows,
               packed.d_ld);
}

// Requests the operands of the query block starting at `first` (see KeyValueBlock).
template <class T>
void PrefetchQueryBlock(const Context<T>& c, int64_t b, int64_t h, int64_t first, const Rows& q_rows,
                        const Rows& dout_rows, const float* dq_group, int64_t kv_head) {
  const Packed& packed = c.packed;
  const detail::Extents& e = c.p.extents;
  const size_t count = static_cast<size_t>(std::min(kBlockQueries, c.p.mask.q_len(b) - first));
  const size_t d = static_cast<size_t>(e.head_dim), dv = static_cast<size_t>(e.v_dim);
  const size_t offset = static_cast<size_t>(first);
  if (packed.dots) {  // the pair panels (the float ones are not packed then)
    PrefetchRows(packed.q_pairs_block(b, h, first), 0, 1, packed.q_pair_words);
    PrefetchRows(packed.dout_pairs_block(b, h, first), 0, 1, packed.dout_pair_words);
    PrefetchRows(packed.q_row_pairs_block(b, h, first), 0, 1, kBlockQueries / 2 * packed.q_row_pair_ld);
    PrefetchRows(packed.dout_row_pairs_block(b, h, first), 0, 1, kBlockQueries / 2 * packed.dout_row_pair_ld);
  } else {
    PrefetchRows(packed.qt_block(b, h, first), 0, 1, d * kBlockQueries);
    PrefetchRows(packed.dot_block(b, h, first), 0, 1, dv * kBlockQueries);
    PrefetchRows(q_rows.data + offset * q_rows.ld, static_cast<int64_t>(q_rows.ld), count, d);
    PrefetchRows(dout_rows.data + offset * dout_rows.ld, static_cast<int64_t>(dout_rows.ld), count, dv);
  }
  if (dq_group != nullptr) {
    const size_t head_in_group = static_cast<size_t>(h - kv_head * e.group());
    PrefetchRows(dq_group + (head_in_group * DqRowsPerHead(e) + offset) * packed.d_ld,
                 static_cast<int64_t>(packed.d_ld), count, d);
  }
}

// dK, dV of one key block over every query tile the plan does not skip. With dq_group
// (the single-pass schedule), also adds dS·K_blk to the group's dQ rows
// [head][query][d_ld].
template <class T>
void KeyValueBlock(const Context<T>& c, const KeyTask& task, BackwardScratch& s,
                   float* dq_group = nullptr) {
  const auto& p = c.p;
  const Packed& packed = c.packed;
  const auto access = p.rows();
  const detail::Extents& e = p.extents;
  const int64_t b = task.batch, first_key = task.first_key, k_block = first_key / kBlockKeys;
  const int64_t keys = std::min(kBlockKeys, p.mask.sequences.k_len(b) - first_key);
  const size_t kn = static_cast<size_t>(keys);
  const size_t d = static_cast<size_t>(e.head_dim), dv = static_cast<size_t>(e.v_dim);
  const size_t group_rows = DqRowsPerHead(e);  // dq_group rows per head
  // One tile configuration for the block's products, unless a user's hook runs between
  // them (amx_dot.hpp).
  const amx::TileScope tile_scope(packed.amx && !p.modifiers.has_score_mod() && !p.mask.mask_mod.active());
  float* dk_acc = s.acc.get();                     // kn × d_ld
  float* dv_acc = dk_acc + kBlockKeys * packed.d_ld;  // kn × dv_ld
  std::fill(dk_acc, dk_acc + kn * packed.d_ld, 0.0f);
  std::fill(dv_acc, dv_acc + kn * packed.dv_ld, 0.0f);
  const KeyValueRows kv = LoadKeyValues(c, b, task.kv_head, first_key, keys, s);
  const uint32_t* k_pairs = dq_group != nullptr ? PackKeyPairs(c, b, task.kv_head, first_key, kn, s) : nullptr;

  for (int64_t h = task.kv_head * e.group(); h < (task.kv_head + 1) * e.group(); ++h) {
    Rows q_rows{packed.q_rows_of(b, h), packed.d_ld};
    Rows dout_rows{packed.dout_rows_of(b, h), packed.dv_ld};
    if constexpr (!kIsHalf<T>) {  // float rows of whole vectors are read in place
      if (!packed.pad_q_rows) q_rows = Rows{access.q(b, 0, h), static_cast<size_t>(p.args.q.strides[1])};
      if (!packed.pad_dout_rows)
        dout_rows = Rows{access.dout(b, 0, h), static_cast<size_t>(p.args.dout.strides[1])};
    }
    const int64_t q_blocks = c.plan.query_blocks(b);
    for (int64_t q_block = 0; q_block < q_blocks; ++q_block) {
      const detail::Tile tile = c.plan.at(b, h, q_block, k_block);
      if (tile == detail::Tile::empty) continue;  // nobody in this block sees these keys
      const int64_t first = q_block * kBlockQueries;
      // Each query block brings five new operands (Qᵀ, dOᵀ, Q and dO rows, dQ rows):
      // ~5·64·d floats that no longer fit L2 at N ≥ 2048, d = 128, and that the hardware
      // prefetcher does not follow from block to block. Requested one block ahead, with
      // Qᵀ/dOᵀ stored block by block (Packed): by thread CPU time, 8 heads, d = 128, the
      // backward went from 73% to 89% of the FMA peak at N = 2048 and 72% to 82% at 4096.
      if (q_block + 1 < q_blocks) PrefetchQueryBlock(c, b, h, first + kBlockQueries, q_rows,
                                                     dout_rows, dq_group, task.kv_head);
      const QueryRows rows = DescribeQueryBlock(c, b, h, first, s);
      // The ALiBi gradient is taken where dQ is (each tile once): here in the single pass.
      double* alibi_sum = dq_group != nullptr && c.alibi_sums != nullptr
                              ? c.alibi_sums + b * e.q_heads + h
                              : nullptr;
      const size_t width = ScoreBlock(c, rows, tile, kv, first_key, keys, s, alibi_sum);
      const size_t count = static_cast<size_t>(rows.count);
      // dV += Pᵀ·dO_blk and dK += dSᵀ·Q_blk (the sum runs over this block's queries).
      if (packed.dots)
        AddValueGradient(packed.amx, s.pt.get(), width, kn, count, packed.dout_row_pairs_block(b, h, first),
                         packed.dout_row_pair_ld, dv, dv_acc, packed.dv_ld, s);
      else
        GemmAddBlock(kn, packed.dv_ld, count, StridedA{s.pt.get(), width, 1},
                     dout_rows.data + static_cast<size_t>(first) * dout_rows.ld, dout_rows.ld,
                     dv_acc, packed.dv_ld);
      if (packed.dots)
        AddKeyGradient(packed.amx, s.dst.get(), width, kn, count, packed.q_row_pairs_block(b, h, first), packed.q_row_pair_ld,
                       d, dk_acc, packed.d_ld, s);
      else
        GemmAddBlock(kn, packed.d_ld, count, StridedA{s.dst.get(), width, 1},
                     q_rows.data + static_cast<size_t>(first) * q_rows.ld, q_rows.ld, dk_acc,
                     packed.d_ld);
      if (dq_group != nullptr) {
        const size_t head_in_group = static_cast<size_t>(h - task.kv_head * e.group());
        float* dq_rows =
            dq_group + (head_in_group * group_rows + static_cast<size_t>(first)) * packed.d_ld;
        AccumulateQueryGradient(c, rows, tile, width, task.kv_head, kv, first_key, keys, dq_rows,
                                s, k_pairs);
      }
    }
  }
  const float scale = static_cast<float>(p.scale);
  for (size_t j = 0; j < kn; ++j) {
    const int64_t key = first_key + static_cast<int64_t>(j);
    T* dk = access.dk(b, key, task.kv_head);
    T* dvv = access.dv(b, key, task.kv_head);
    for (size_t x = 0; x < d; ++x) dk[x] = StoreAs<T>(scale * dk_acc[j * packed.d_ld + x]);
    for (size_t x = 0; x < dv; ++x) dvv[x] = StoreAs<T>(dv_acc[j * packed.dv_ld + x]);
  }
}

// dq = scale·dq_acc for `count` rows starting at query `first` of head h.
template <class T>
void WriteQueryGradient(const detail::BackwardProblem<T>& p, const Packed& packed,
                        int64_t b, int64_t h, int64_t first, int64_t count,
                        const float* dq_acc) {
  const size_t d = static_cast<size_t>(p.extents.head_dim);
  const float scale = static_cast<float>(p.scale);
  const auto access = p.rows();
  for (int64_t i = 0; i < count; ++i) {
    T* dq = access.dq(b, first + i, h);
    const float* acc = dq_acc + static_cast<size_t>(i) * packed.d_ld;
    for (size_t c = 0; c < d; ++c) dq[c] = StoreAs<T>(scale * acc[c]);
  }
}

// Pass 2 of the two-pass schedule: one query block's dQ over every tile it does not skip.
template <class T>
void QueryBlockGradient(const Context<T>& c, const ForwardTask& task, BackwardScratch& s,
                        double* alibi_sum) {
  const detail::Extents& e = c.p.extents;
  const int64_t b = task.batch, h = task.head, kv_head = e.kv_head_of(h);
  const int64_t q_block = task.first_query / kBlockQueries;
  const QueryRows rows = DescribeQueryBlock(c, b, h, task.first_query, s);
  const amx::TileScope tile_scope(c.packed.amx && !c.p.modifiers.has_score_mod() && !c.p.mask.mask_mod.active());
  float* dq_acc = s.dq.get();  // count × d_ld
  std::fill(dq_acc, dq_acc + static_cast<size_t>(rows.count) * c.packed.d_ld, 0.0f);
  const int64_t k_len = c.p.mask.sequences.k_len(b);
  const int64_t last_block = c.plan.last_key_block(b, h, q_block);
  for (int64_t k_block = c.plan.first_key_block(b, h, q_block); k_block <= last_block; ++k_block) {
    const detail::Tile tile = c.plan.at(b, h, q_block, k_block);
    if (tile == detail::Tile::empty) continue;
    const int64_t first_key = k_block * kBlockKeys;
    const int64_t keys = std::min(kBlockKeys, k_len - first_key);
    const KeyValueRows kv = LoadKeyValues(c, b, kv_head, first_key, keys, s);
    const size_t width = ScoreBlock(c, rows, tile, kv, first_key, keys, s, alibi_sum);
    const uint32_t* k_pairs = PackKeyPairs(c, b, kv_head, first_key, static_cast<size_t>(keys), s);
    AccumulateQueryGradient(c, rows, tile, width, kv_head, kv, first_key, keys, dq_acc, s, k_pairs);
  }
  WriteQueryGradient(c.p, c.packed, b, h, rows.first, rows.count, dq_acc);
}

// The single-pass schedule: one (entry, kv head) does every key block in order, and
// adds each block's dS·K to the group's dQ as it goes (fixed order: deterministic).
template <class T>
void HeadGroupGradient(const Context<T>& c, int64_t b, int64_t kv_head, BackwardScratch& s) {
  const detail::Extents& e = c.p.extents;
  const size_t rows_per_head = DqRowsPerHead(e) * c.packed.d_ld;
  float* dq_group = s.dq.get();  // group × Nq × d_ld
  std::fill(dq_group, dq_group + static_cast<size_t>(e.group()) * rows_per_head, 0.0f);
  for (int64_t first_key = 0; first_key < c.p.mask.sequences.k_len(b); first_key += kBlockKeys)
    KeyValueBlock(c, KeyTask{b, kv_head, first_key, 0}, s, dq_group);
  for (int64_t g = 0; g < e.group(); ++g)
    WriteQueryGradient(c.p, c.packed, b, kv_head * e.group() + g, 0, c.p.mask.q_len(b),
                       dq_group + static_cast<size_t>(g) * rows_per_head);
}

}  // namespace

template <class T>
void BackwardImpl(const detail::BackwardProblem<T>& p) {
  const detail::Extents& e = p.extents;
  const size_t lanes = VectorLanes();
  const detail::TilePlan plan(p.mask, e, kBlockQueries, kBlockKeys, p.threads);
  const std::vector<ForwardTask> query_tasks = forward_tasks(e, p.mask, plan);
  const std::vector<KeyTask> kv_tasks = key_tasks(e, p.mask, plan);
  if (query_tasks.empty() && kv_tasks.empty()) {
    std::fill(p.args.dsinks.begin(), p.args.dsinks.end(), 0.0f);  // no rows: no gradient
    std::fill(p.args.dalibi_slopes.begin(), p.args.dalibi_slopes.end(), 0.0f);
    return;
  }

  // May throw (QKV_DOT_PRODUCTS=on without the unit): here, before the parallel region.
  const Bf16Unit unit = std::is_same_v<T, bfloat16> ? bf16_unit(p.precision) : Bf16Unit::fp32_fma;
  Packed packed(e, p.mask.sequences, lanes, kIsHalf<T>, unit);
  KeyValueFinite finite(e);
  const std::vector<KeyBlock> scans = finite.blocks_to_scan(plan, p.mask.sequences);
  const SharedMaskTiles shared(p.mask, e, plan);
  const bool single_pass = backward_single_pass(e);
  const bool want_dalibi = !p.args.dalibi_slopes.empty();
  std::vector<double> alibi_sums(
      !want_dalibi ? 0 : single_pass ? static_cast<size_t>(e.batch * e.q_heads) : query_tasks.size(), 0.0);
  const bool split_k_logits = std::is_same_v<T, float> && split_k_eligible(p.mask, p.modifiers);
  const Context<T> context{p, plan, finite, shared, packed, want_dalibi ? alibi_sums.data() : nullptr,
                           split_k_logits};

  const std::vector<std::pair<int64_t, int64_t>> head_groups =
      single_pass ? head_group_tasks(e, kv_tasks) : std::vector<std::pair<int64_t, int64_t>>{};
  const size_t most_tasks =
      single_pass ? head_groups.size() : std::max(query_tasks.size(), kv_tasks.size());
  const size_t dq_rows = single_pass ? static_cast<size_t>(e.group()) * DqRowsPerHead(e)
                                     : static_cast<size_t>(kBlockQueries);
  // The backward does about 3.5 forwards' worth of block products.
  const int threads = threads_for(p.threads, most_tasks, 3.5 * forward_flops(query_tasks, e));
#pragma omp parallel num_threads(threads) if (threads > 1)  // one thread: no region at all
  {
#pragma omp for schedule(dynamic, 16) nowait
    for (size_t t = 0; t < scans.size(); ++t) ScanKeyValueBlock(p, scans[t], finite);
#pragma omp for schedule(dynamic, 4) nowait
    for (size_t t = 0; t < shared.size(); ++t) shared.build(p.mask, plan, t);
#pragma omp for schedule(dynamic, 1)
    for (size_t t = 0; t < query_tasks.size(); ++t) PackQueryBlock(p, plan, query_tasks[t], packed);
    // (implicit barrier: every task below reads every query block's packed panels, the
    // finite flags and the shared mask tiles)
    BackwardScratch scratch(packed, p.mask.has_elementwise(), p.modifiers.softcap > 0.0f, lanes,
                            dq_rows, kIsHalf<T>, p.modifiers.has_score_mod(),
                            split_k_logits ? static_cast<size_t>(e.head_dim) : 0);
    if (single_pass) {
#pragma omp for schedule(dynamic, 1)
      for (size_t t = 0; t < head_groups.size(); ++t)
        HeadGroupGradient(context, head_groups[t].first, head_groups[t].second, scratch);
    } else {
#pragma omp for schedule(dynamic, 1) nowait
      for (size_t t = 0; t < kv_tasks.size(); ++t) KeyValueBlock(context, kv_tasks[t], scratch);
      // Pass 2 reads only the packed panels and K, V: no barrier needed before it.
#pragma omp for schedule(dynamic, 1)
      for (size_t t = 0; t < query_tasks.size(); ++t)
        QueryBlockGradient(context, query_tasks[t], scratch,
                           want_dalibi ? alibi_sums.data() + t : nullptr);
    }
  }
  // ∂L/∂slope_h: the per-(entry, head) or per-task sums, added in a fixed order.
  if (want_dalibi) {
    std::vector<double> per_head(static_cast<size_t>(e.q_heads), 0.0);
    if (single_pass) {
      for (int64_t b = 0; b < e.batch; ++b)
        for (int64_t h = 0; h < e.q_heads; ++h)
          per_head[static_cast<size_t>(h)] += alibi_sums[static_cast<size_t>(b * e.q_heads + h)];
    } else {
      for (size_t t = 0; t < query_tasks.size(); ++t)
        per_head[static_cast<size_t>(query_tasks[t].head)] += alibi_sums[t];
    }
    for (int64_t h = 0; h < e.q_heads; ++h)
      p.args.dalibi_slopes[static_cast<size_t>(h)] = static_cast<float>(per_head[static_cast<size_t>(h)]);
  }
  // ∂L/∂sink_h = Σ over entries and rows of the per-row terms, in a fixed order.
  if (!p.args.dsinks.empty()) {
    for (int64_t h = 0; h < e.q_heads; ++h) {
      double sum = 0.0;
      for (int64_t b = 0; b < e.batch; ++b) {
        const float* terms = packed.sink_terms_of(b, h);
        for (int64_t i = 0; i < p.mask.q_len(b); ++i) sum += terms[i];
      }
      p.args.dsinks[static_cast<size_t>(h)] = static_cast<float>(sum);
    }
  }
}

// One entry per storage type (HWY_EXPORT takes plain functions, not templates).
void BackwardFloat32(const detail::BackwardProblem<float>& p) { BackwardImpl(p); }
void BackwardBfloat16(const detail::BackwardProblem<bfloat16>& p) { BackwardImpl(p); }
void BackwardFloat16(const detail::BackwardProblem<float16>& p) { BackwardImpl(p); }

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::cpu {
HWY_EXPORT(BackwardFloat32);
HWY_EXPORT(BackwardBfloat16);
HWY_EXPORT(BackwardFloat16);

void backward(const detail::BackwardProblem<float>& problem) {
  apply_simd_target_override();
  HWY_DYNAMIC_DISPATCH(BackwardFloat32)(problem);
}
void backward(const detail::BackwardProblem<bfloat16>& problem) {
  apply_simd_target_override();
  HWY_DYNAMIC_DISPATCH(BackwardBfloat16)(problem);
}
void backward(const detail::BackwardProblem<float16>& problem) {
  apply_simd_target_override();
  HWY_DYNAMIC_DISPATCH(BackwardFloat16)(problem);
}
}  // namespace qkv::cpu
#endif
