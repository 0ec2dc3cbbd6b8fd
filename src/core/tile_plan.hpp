// The tile plan: every mask source of a call (causal, key_lengths, varlen boundaries,
// boolean and additive masks with their broadcast axes) reduced, once per call and
// before any kernel runs, to one class per (batch entry, query head, query block, key
// block) tile:
//
//   empty    no (query, key) pair of the tile takes part: skipped (no product, no exp)
//   full     every pair takes part with zero bias: no mask work at all
//   partial  anything else: the kernel masks the tile elementwise (vectorized)
//
// A programmable mask_mod (qkv/modifiers.hpp) then refines the classes: it is evaluated
// once per call over every pair the other masks leave in a tile (per head, or once for
// all heads when it does not vary with them), so its empty tiles are skipped and its
// full ones get no mask work.
//
// Forward and backward read the same plan, so they skip and mask the very same tiles.
// Cost: one pass over the mask's distinct rows (a mask broadcast over heads, batch or
// queries is read once, not once per head) plus O(1) work per tile (O(block rows) per
// tile when an elementwise mask is set). The per-row rule itself lives in
// core/problem.hpp (MaskRule), which the reference backend reads directly.
#pragma once

#include <cstdint>
#include <vector>

#include "core/problem.hpp"

namespace qkv::detail {

enum class Tile : std::uint8_t { empty = 0, partial = 1, full = 2 };

class TilePlan {
 public:
  TilePlan(const MaskRule& mask, const Extents& extents, int64_t block_queries,
           int64_t block_keys, int threads);

  int64_t block_queries() const { return block_q_; }
  // Whether classes (and degenerate rows) differ between query heads: false when the
  // masks broadcast over heads, which lets kernels share per-tile mask work across heads.
  bool per_head() const { return per_head_; }
  int64_t block_keys() const { return block_k_; }
  // Blocks of entry b's own sequence.
  int64_t query_blocks(int64_t b) const { return ceil_div(mask_->q_len(b), block_q_); }
  int64_t key_blocks(int64_t b) const { return ceil_div(mask_->sequences.k_len(b), block_k_); }

  Tile at(int64_t b, int64_t h, int64_t q_block, int64_t k_block) const {
    return classes_[tile_index(b, h, q_block) + static_cast<std::size_t>(k_block)];
  }
  // Non-empty key blocks of a query block: the work of its forward task.
  int64_t busy_key_blocks(int64_t b, int64_t h, int64_t q_block) const {
    return busy_[row_block_index(b, h, q_block)];
  }
  // [first, last] non-empty key block of a query block (first > last when none).
  int64_t first_key_block(int64_t b, int64_t h, int64_t q_block) const {
    return first_[row_block_index(b, h, q_block)];
  }
  int64_t last_key_block(int64_t b, int64_t h, int64_t q_block) const {
    return last_[row_block_index(b, h, q_block)];
  }
  // Rows that take their ≤ kRemovalBias keys literally (MaskRule::degenerate_row): per
  // query row from `first`, the row's largest such bias, or 0 for an ordinary row (null
  // when the call has no bias).
  const float* degenerate_rows(int64_t b, int64_t h, int64_t first) const {
    if (degenerate_.empty()) return nullptr;
    return degenerate_.data() + (static_cast<std::size_t>(b) * plan_heads_ + head(h)) *
                                    static_cast<std::size_t>(q_rows_) +
           static_cast<std::size_t>(first);
  }
  bool any_partial_in_key_block(int64_t b, int64_t kv_head, int64_t k_block) const {
    return partial_columns_[(static_cast<std::size_t>(b) * kv_heads_ + kv_head) *
                                static_cast<std::size_t>(k_blocks_) +
                            static_cast<std::size_t>(k_block)] != 0;
  }

 private:
  static int64_t ceil_div(int64_t n, int64_t m) { return (n + m - 1) / m; }
  std::size_t head(int64_t h) const { return per_head_ ? static_cast<std::size_t>(h) : 0; }
  std::size_t row_block_index(int64_t b, int64_t h, int64_t q_block) const {
    return (static_cast<std::size_t>(b) * plan_heads_ + head(h)) *
               static_cast<std::size_t>(q_blocks_) +
           static_cast<std::size_t>(q_block);
  }
  std::size_t tile_index(int64_t b, int64_t h, int64_t q_block) const {
    return row_block_index(b, h, q_block) * static_cast<std::size_t>(k_blocks_);
  }

  void classify_without_elementwise(int64_t b);
  void classify_with_elementwise(const Extents& e, int threads);
  void classify_with_mask_mod(int threads);
  void summarize(int64_t b, int64_t h, int64_t i, std::uint8_t* out) const;
  float degenerate_shift(int64_t b, int64_t h, int64_t i, const std::uint8_t* summary) const;
  void finish(int64_t group);

  const MaskRule* mask_;
  int64_t block_q_, block_k_;
  int64_t q_rows_;             // rows of the longest query sequence
  int64_t q_blocks_, k_blocks_;  // of the longest sequences
  bool per_head_;              // classes differ between query heads
  std::size_t plan_heads_;     // per_head_ ? Hq : 1
  int64_t batch_, q_heads_, kv_heads_;
  std::vector<Tile> classes_;           // [batch][plan head][query block][key block]
  std::vector<int32_t> busy_, first_, last_;  // [batch][plan head][query block]
  std::vector<float> degenerate_;             // [batch][plan head][query row], bias only
  std::vector<std::uint8_t> partial_columns_;  // [batch][kv head][key block]
};

}  // namespace qkv::detail
