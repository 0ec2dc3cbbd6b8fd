// The score pipeline (core/score_pipeline.hpp) on the cpu schedules' units of work:
//   TileStages — a transposed score tile st[key][query] of one (batch, head) block, as the
//                tiled forward and backward compute it (and, in the backward, the
//                derivatives each stage keeps for the chain rule);
//   RowStages  — one row of scores s[key] of one (batch, head, query), as the split-K
//                schedule computes it (keys along the row: ALiBi's and score_mod's roles of
//                key and query swapped, a one-query tile with ld 1);
//   ChainStages — the backward's way back through the stages on a tile dSᵀ.
// Which stages run, and in which order, is decided by detail::apply_score_pipeline only.
#if defined(QKV_CPU_SCORE_PIPELINE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_SCORE_PIPELINE_INL_H_
#undef QKV_CPU_SCORE_PIPELINE_INL_H_
#else
#define QKV_CPU_SCORE_PIPELINE_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cmath>
#include <cstdint>

#include "hwy/highway.h"
#include "core/score_pipeline.hpp"
#include "cpu/block_mask.hpp"
#include "cpu/block_ops-inl.h"
#include "cpu/blocking.hpp"
#include "cpu/mask_tiles.hpp"
#include "cpu/modifier_tiles-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {

// One transposed tile: keys × width scores (width = the block's queries rounded up to whole
// vectors), of keys [first_key, first_key + keys) against `rows`.
struct TileStages {
  const detail::MaskRule& rule;
  const detail::ScoreModifiers& mods;
  const QueryRows& rows;
  int64_t first_key = 0, keys = 0;
  float* st = nullptr;
  std::size_t width = 0;
  // Only partial tiles of the plan are masked; full tiles have every pair taking part.
  bool partial = false;
  const SharedMaskTiles* shared = nullptr;  // additive tiles built once per call, if any
  float* add = nullptr;                     // scratch for one additive tile (keys × width)
  // Backward only (null in the forward): where the soft-cap's 1 − tanh² and score_mod's
  // derivative go, keys × width each.
  float* cap_slope = nullptr;
  float* mod_slope = nullptr;

  std::size_t key_count() const { return static_cast<std::size_t>(keys); }
  int64_t alibi_first_query() const {
    return rows.first + detail::ScoreModifiers::alibi_offset(rule, rows.batch);
  }

  void softcap(float cap) { SoftcapTile(st, key_count(), width, cap, cap_slope); }
  void alibi() {
    AlibiTile(st, key_count(), width, first_key, alibi_first_query(), mods.alibi_slopes[rows.head]);
  }
  void score_mod(const ScoreModHook& hook) { ApplyScoreMod(hook, rows, first_key, keys, st, width, mod_slope); }
  void mask() {
    if (!partial) return;
    const float* bias = nullptr;
    std::size_t bias_ld = width;
    if (rule.has_elementwise()) {
      bias = shared == nullptr ? nullptr : shared->find(rows.batch, rows.first / kBlockQueries, first_key / kBlockKeys);
      if (bias != nullptr) {
        bias_ld = SharedMaskTiles::kLd;
      } else {
        build_additive_tile(rule, rows, first_key, keys, add, width);
        bias = add;
      }
    }
    MaskTile(st, key_count(), width, first_key, rows.key_begin, rows.key_end, bias, bias_ld);
    overwrite_degenerate_columns(rule, rows, first_key, keys, st, width);
    if (rule.has_mask_mod()) ApplyMaskMod(rule.mask_mod, rows, first_key, keys, st, width);
  }
};

// One row of the split-K schedule: scores s[0, padded) of keys [first_key, first_key +
// padded) for query `query` of (batch, head); keys outside [key_begin, key_end) — and the
// padding past the block's `keys` — are removed (set to −inf, overwriting the score, so a
// NaN key behind the mask never reaches the row). No elementwise mask reaches this
// schedule (cpu::runs_split_k), so the mask stage is the key range alone — and, for a
// sequence with a tree (MaskRule::tree, qkv::BatchPlan), the tree among its new tokens.
struct RowStages {
  const detail::MaskRule& rule;
  const detail::ScoreModifiers& mods;
  int64_t batch = 0, head = 0, query = 0;
  int64_t first_key = 0;
  std::size_t keys = 0, padded = 0;
  int64_t key_begin = 0, key_end = 0;
  float* s = nullptr;

  void softcap(float cap) { SoftcapTile(s, 1, padded, cap, nullptr); }
  // AlibiTile's (keys, width) = (1, padded) with the roles of key and query swapped: the
  // distance |i + offset − j| is symmetric.
  void alibi() {
    AlibiTile(s, 1, padded, query + detail::ScoreModifiers::alibi_offset(rule, batch), first_key,
              mods.alibi_slopes[head]);
  }
  // A one-query tile whose keys run along the row (ld 1). Only the block's real keys.
  void score_mod(const ScoreModHook& hook) {
    hook.tile(hook.context, hooks::ScoreTile{.scores = s, .derivative = nullptr, .ld = 1, .batch = batch,
                                             .head = head, .first_query = query, .queries = 1,
                                             .first_key = first_key, .keys = static_cast<int64_t>(keys)});
  }
  void mask() {
    const auto block = static_cast<int64_t>(keys);
    if (padded != keys || first_key < key_begin || first_key + block > key_end) {
      const int64_t hidden_before = std::clamp<int64_t>(key_begin - first_key, 0, block);
      const int64_t visible_end = std::clamp<int64_t>(key_end - first_key, hidden_before, block);
      std::fill(s, s + hidden_before, kMinusInf);
      std::fill(s + visible_end, s + padded, kMinusInf);
    }
    if (!rule.tree.has(batch)) return;
    // The block's keys among the new tokens (at most one or two blocks of a sequence):
    // those the tree hides from this row removed like the rest.
    for (int64_t j = std::max(first_key, rule.tree_begin(batch)); j < first_key + block; ++j)
      if (!rule.tree_sees(batch, query, j)) s[j - first_key] = kMinusInf;
  }
};

// −Σ_(j, i < count) dSᵀ[j][i]·|aligned_first + i − (first_key + j)|: one tile's share of
// ∂L/∂slope (ALiBi's bias is −slope·distance). Summed per query column in float over the
// tile's ≤ 64 keys (vectorizable), then in double.
inline double AlibiSlopeGradient(const float* dst, size_t keys, size_t width, size_t count,
                                 int64_t first_key, int64_t aligned_first) {
  float column[kBlockQueries] = {};
  const float base = static_cast<float>(aligned_first - first_key);
  for (size_t j = 0; j < keys; ++j) {
    const float* row = dst + j * width;
    const float shift = base - static_cast<float>(j);
    for (size_t i = 0; i < count; ++i) column[i] += row[i] * std::abs(shift + static_cast<float>(i));
  }
  double sum = 0.0;
  for (size_t i = 0; i < count; ++i) sum -= static_cast<double>(column[i]);
  return sum;
}

// The way back through the score pipeline (detail::chain_score_pipeline) on one tile
// dSᵀ (keys × width), with the derivatives TileStages kept in the forward direction.
struct ChainStages {
  const QueryRows& rows;
  int64_t alibi_offset = 0;  // ScoreModifiers::alibi_offset of the entry
  int64_t first_key = 0;
  size_t keys = 0, width = 0;
  float* dst = nullptr;
  const float* cap_slope = nullptr;
  const float* mod_slope = nullptr;
  double* alibi_sum = nullptr;  // null: no slope gradient wanted
  const detail::ScoreModifiers* mods = nullptr;  // the call's, for per-head stages

  void alibi() {
    if (alibi_sum != nullptr)
      *alibi_sum += AlibiSlopeGradient(dst, keys, width, static_cast<size_t>(rows.count), first_key,
                                       rows.first + alibi_offset);
  }
  void score_mod(const ScoreModHook&) { ChainScoreMod(dst, mod_slope, keys, width); }
  void softcap(float) { MultiplyTile(dst, cap_slope, keys * width); }  // through tanh
};

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
