// qkv::BatchPlan's speculative-decoding trees (qkv/batch_plan.hpp, "Trees"): the layout's
// tree_mask and tree_mask_offsets checked against the step's sequences and copied into the
// plan, and the options a tree does not combine with refused by name. The kernels read the
// copy through MaskRule::tree (core/problem.hpp).
#pragma once

#include <cstdint>
#include <vector>

#include "qkv/batch_plan.hpp"
#include "qkv/options.hpp"

namespace qkv::detail {

class Checker;

// The plan's own copy (the caller's arrays may change once the plan is made): sequence b's
// n_b×n_b mask at bits[offsets[b]], or offsets[b] = −1 (no tree). Both empty when the
// layout has no tree_mask.
struct TreeMaskCopy {
  std::vector<std::uint8_t> bits;
  std::vector<int64_t> offsets;
};

// `cu_q`: the checked cu_seqlens_q (B + 1 entries). Each mask is copied compactly (only
// the n_b² entries a sequence uses), so overlapping or shared masks cost nothing extra.
TreeMaskCopy checked_tree_masks(const Checker& check, const BatchLayout& layout, const std::vector<int64_t>& cu_q);

// A plan with a tree_mask: causal none or bottom_right (the tree replaces causality among
// the new tokens either way), no window, no ALiBi.
void refuse_with_trees(const Checker& check, const AttentionOptions& options);

}  // namespace qkv::detail
