// qkv::BatchPlan's tree masks, checked and copied (cache/tree_mask.hpp).
#include "cache/tree_mask.hpp"

#include <string>

#include "check/checker.hpp"

namespace qkv::detail {

namespace {

std::string at(const char* name, int64_t index) { return std::string(name) + "[" + std::to_string(index) + "]"; }

}  // namespace

TreeMaskCopy checked_tree_masks(const Checker& check, const BatchLayout& layout, const std::vector<int64_t>& cu_q) {
  TreeMaskCopy copy;
  const std::span<const std::uint8_t> mask = layout.tree_mask;
  const SeqOffsets& offsets = layout.tree_mask_offsets;
  if (mask.empty() && offsets.size() == 0) return copy;
  const auto batch = static_cast<int64_t>(cu_q.size()) - 1;
  if (mask.empty())
    check.fail("tree_mask: expected the flattened masks that tree_mask_offsets point into, got none "
               "(without trees leave tree_mask_offsets empty too)");
  if (static_cast<int64_t>(offsets.size()) != batch)
    check.fail("tree_mask_offsets: expected one offset per sequence (" + std::to_string(batch) +
               ", as cu_seqlens_q; -1: no tree) with a tree_mask, got " + std::to_string(offsets.size()));
  const auto size = static_cast<int64_t>(mask.size());
  copy.offsets.assign(static_cast<std::size_t>(batch), -1);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t offset = offsets[static_cast<std::size_t>(b)];
    if (offset == -1) continue;
    const int64_t n = cu_q[b + 1] - cu_q[b];
    const int64_t entries = n * n;  // n ≤ 2^31 − 1 (checked_query_offsets): no overflow
    if (offset < 0 || offset > size - entries) {
      check.fail(at("tree_mask_offsets", b) + ": expected -1 (no tree) or 0.." + std::to_string(size - entries) +
                 " (sequence " + std::to_string(b) + "'s " + std::to_string(n) + "x" + std::to_string(n) +
                 " mask within the " + std::to_string(size) + " entries of tree_mask), got " + std::to_string(offset));
    }
    copy.offsets[static_cast<std::size_t>(b)] = static_cast<int64_t>(copy.bits.size());
    for (int64_t i = 0; i < n; ++i) {
      // Every token sees itself: a row then never sees nothing, and a mask of the wrong
      // sequence, or shifted, is caught here rather than attended.
      if (mask[static_cast<std::size_t>(offset + i * n + i)] == 0) {
        check.fail(at("tree_mask", offset + i * n + i) + " (sequence " + std::to_string(b) + ", token " +
                   std::to_string(i) + " sees itself): expected true (every token sees itself), got false");
      }
      for (int64_t j = 0; j < n; ++j)
        copy.bits.push_back(mask[static_cast<std::size_t>(offset + i * n + j)] != 0 ? 1 : 0);
    }
  }
  return copy;
}

void refuse_with_trees(const Checker& check, const AttentionOptions& options) {
  if (options.causal == Causal::top_left)
    check.fail("options.causal: expected none or bottom_right with a tree_mask (the tree orders the new tokens, "
               "the cached prefix stays visible), got top_left");
  if (options.window.active())
    check.fail("options.window: not with a tree_mask (a window counts positions along the sequence; a tree's "
               "tokens are not in sequence)");
  if (!options.alibi_slopes.empty())
    check.fail("options.alibi_slopes: not with a tree_mask (ALiBi's distances are positions along the sequence; "
               "a tree's tokens are not in sequence)");
}

}  // namespace qkv::detail
