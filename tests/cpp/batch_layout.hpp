// Tests: a qkv::BatchLayout from a step's arrays (they must outlive the layout, which
// views them): paged with `table` when block_size > 0, else contiguous.
#pragma once

#include <qkv/batch_plan.hpp>

#include <cstdint>
#include <span>
#include <vector>

namespace qkv::test {

struct LayoutSizes {
  int64_t heads = 0, kv_heads = 0, head_dim = 0, v_dim = 0;
};

inline BatchLayout batch_layout(const std::vector<int64_t>& cu, const std::vector<int64_t>& lengths,
                                const Tensor<int32_t, 2>& table, int64_t block_size, LayoutSizes sizes,
                                StorageType storage) {
  BatchLayout l;
  l.cu_seqlens_q = std::span<const int64_t>(cu);
  l.cache_lengths = std::span<const int64_t>(lengths);
  if (block_size > 0) {
    l.block_table = table.cview();
    l.block_size = block_size;
  }
  l.num_heads = sizes.heads;
  l.num_kv_heads = sizes.kv_heads;
  l.head_dim = sizes.head_dim;
  l.v_dim = sizes.v_dim;
  l.storage = storage;
  return l;
}

}  // namespace qkv::test
