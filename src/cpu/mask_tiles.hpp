// Transposed additive mask tiles (block_mask.hpp, build_additive_tile) built once per
// call and shared by every query head, for masks that broadcast over heads (transformers'
// [B, 1, N, N], PyTorch's [B, 1, 1, N]): building one costs about as much as the tile's
// score product (a transposing scalar pass over 64×64 entries), so sharing it across Hq
// heads takes it off the hot path. Only partial tiles get one; a call whose tiles would
// need more than kBudgetBytes, or whose mask varies over heads, builds them per head on
// the fly instead.
#pragma once

#include <cstdint>
#include <vector>

#include "core/checked_size.hpp"
#include "core/problem.hpp"
#include "core/tile_plan.hpp"
#include "cpu/block_mask.hpp"
#include "cpu/blocking.hpp"
#include "hwy/aligned_allocator.h"

namespace qkv::cpu {

class SharedMaskTiles {
 public:
  // Row length of a stored tile: kBlockQueries, a whole number of vectors on every target.
  static constexpr std::size_t kLd = static_cast<std::size_t>(kBlockQueries);
  static constexpr double kBudgetBytes = 256.0 * (1 << 20);

  struct Slot {
    int64_t batch, q_block, k_block;
  };

  SharedMaskTiles(const detail::MaskRule& mask, const detail::Extents& e,
                  const detail::TilePlan& plan) {
    if (!mask.has_elementwise() || plan.per_head() || e.q_heads < 2) return;
    std::vector<int32_t> index;
    for (int64_t b = 0; b < e.batch; ++b)
      for (int64_t qb = 0; qb < plan.query_blocks(b); ++qb)
        for (int64_t kb = 0; kb < plan.key_blocks(b); ++kb)
          if (plan.at(b, 0, qb, kb) == detail::Tile::partial) slots_.push_back({b, qb, kb});
    const double bytes = static_cast<double>(slots_.size()) * kBlockKeys * kLd * sizeof(float);
    if (bytes > kBudgetBytes) {
      slots_.clear();
      return;
    }
    q_blocks_ = (e.q_len + kBlockQueries - 1) / kBlockQueries;
    k_blocks_ = (e.k_len + kBlockKeys - 1) / kBlockKeys;
    // As many entries as the plan has tiles per head (whose size it checked); 4 bytes each.
    const auto entries = static_cast<std::size_t>(e.batch * q_blocks_ * k_blocks_);
    detail::allocate_or_throw("qkv (the shared mask tiles of an attention call)", "the tile index",
                              entries * sizeof(int32_t), [&] { index_.assign(entries, -1); });
    for (std::size_t s = 0; s < slots_.size(); ++s)
      index_[position(slots_[s].batch, slots_[s].q_block, slots_[s].k_block)] = static_cast<int32_t>(s);
    tiles_ = hwy::AllocateAligned<float>(std::max<std::size_t>(1, slots_.size() * kBlockKeys * kLd));
  }

  std::size_t size() const { return slots_.size(); }

  // Builds tile `s` (any thread; each slot is written by one).
  void build(const detail::MaskRule& mask, const detail::TilePlan& plan, std::size_t s) const {
    const Slot& slot = slots_[s];
    const int64_t first = slot.q_block * kBlockQueries;
    QueryRows rows{.batch = slot.batch, .head = 0, .first = first,
                   .count = std::min(kBlockQueries, mask.q_len(slot.batch) - first),
                   .degenerate = plan.degenerate_rows(slot.batch, 0, first)};
    const int64_t first_key = slot.k_block * kBlockKeys;
    const int64_t keys = std::min(kBlockKeys, mask.sequences.k_len(slot.batch) - first_key);
    build_additive_tile(mask, rows, first_key, keys, tile(s), kLd);
  }

  // The shared tile of (entry, query block, key block), or null: build it yourself.
  const float* find(int64_t b, int64_t q_block, int64_t k_block) const {
    if (index_.empty()) return nullptr;
    const int32_t s = index_[position(b, q_block, k_block)];
    return s < 0 ? nullptr : tile(static_cast<std::size_t>(s));
  }

 private:
  std::size_t position(int64_t b, int64_t qb, int64_t kb) const {
    return static_cast<std::size_t>((b * q_blocks_ + qb) * k_blocks_ + kb);
  }
  float* tile(std::size_t s) const { return tiles_.get() + s * kBlockKeys * kLd; }

  std::vector<Slot> slots_;
  std::vector<int32_t> index_;  // [entry][query block][key block] → slot, −1 if none
  int64_t q_blocks_ = 0, k_blocks_ = 0;
  hwy::AlignedFreeUniquePtr<float[]> tiles_;
};

}  // namespace qkv::cpu
