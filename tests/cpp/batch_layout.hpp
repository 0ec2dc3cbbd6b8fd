// Tests: a qkv::BatchLayout from a step's arrays (they must outlive the layout, which
// views them): paged with `table` when block_size > 0, else contiguous.
#pragma once

#include <qkv/batch_plan.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
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

// A block table [batch, max_blocks] over a pool of `pool_blocks` blocks in shuffled order
// (seeded): every sequence's blocks scattered through the pool, none shared.
inline Tensor<int32_t, 2> shuffled_table(int64_t batch, int64_t max_blocks, int64_t pool_blocks, unsigned seed) {
  std::vector<int32_t> order(static_cast<std::size_t>(pool_blocks));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(seed));
  Tensor<int32_t, 2> table({batch, max_blocks});
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < max_blocks; ++j) table(b, j) = order[static_cast<std::size_t>(b * max_blocks + j)];
  return table;
}

}  // namespace qkv::test
