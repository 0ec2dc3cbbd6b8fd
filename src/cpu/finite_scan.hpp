// Which key blocks hold a non-finite K or V value, found once per call.
//
// A partial tile removes some keys, yet its block products still multiply their rows:
// P = 0 (or dS = 0) times a NaN/Inf in V (or K) would leak the bad value into rows that
// never saw that key. So the key blocks that partial tiles read are scanned once, before
// the kernels run, and only a block found non-finite takes the slow path that skips the
// zero terms. Full tiles need no scan (every key takes part, so a NaN there belongs in
// the output) and empty tiles are never read.
#pragma once

#include <cstdint>
#include <vector>

#include "core/problem.hpp"
#include "core/tile_plan.hpp"
#include "cpu/blocking.hpp"

namespace qkv::cpu {

// One key block of one (entry, kv head).
struct KeyBlock {
  int64_t batch = 0, kv_head = 0, block = 0;
};

class KeyValueFinite {
 public:
  explicit KeyValueFinite(const detail::Extents& e)
      : kv_heads_(e.kv_heads),
        blocks_((e.k_len + kBlockKeys - 1) / kBlockKeys),
        flags_(static_cast<std::size_t>(e.batch * e.kv_heads * blocks_), kAllFinite) {}

  // The key blocks that partial tiles read: the ones to scan.
  std::vector<KeyBlock> blocks_to_scan(const detail::TilePlan& plan,
                                       const detail::Sequences& sequences) const {
    std::vector<KeyBlock> blocks;
    for (int64_t b = 0; b < sequences.count; ++b)
      for (int64_t kv = 0; kv < kv_heads_; ++kv)
        for (int64_t kb = 0; kb < plan.key_blocks(b); ++kb)
          if (plan.any_partial_in_key_block(b, kv, kb)) blocks.push_back({b, kv, kb});
    return blocks;
  }

  void record(const KeyBlock& block, bool keys_finite, bool values_finite) {
    flags_[index(block.batch, block.kv_head, block.block)] =
        static_cast<std::uint8_t>((keys_finite ? kKeysFinite : 0) | (values_finite ? kValuesFinite : 0));
  }
  bool keys(int64_t b, int64_t kv_head, int64_t block) const {
    return flags_[index(b, kv_head, block)] & kKeysFinite;
  }
  bool values(int64_t b, int64_t kv_head, int64_t block) const {
    return flags_[index(b, kv_head, block)] & kValuesFinite;
  }

 private:
  static constexpr std::uint8_t kKeysFinite = 1, kValuesFinite = 2;
  static constexpr std::uint8_t kAllFinite = kKeysFinite | kValuesFinite;
  std::size_t index(int64_t b, int64_t kv_head, int64_t block) const {
    return static_cast<std::size_t>((b * kv_heads_ + kv_head) * blocks_ + block);
  }
  int64_t kv_heads_, blocks_;
  std::vector<std::uint8_t> flags_;  // [entry][kv head][key block]; distinct bytes per block
};

}  // namespace qkv::cpu
