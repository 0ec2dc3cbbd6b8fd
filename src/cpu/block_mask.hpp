// Masking of one transposed score tile st[key][query] (scalar code: it runs only on the
// blocks that need it — a causal diagonal, a partial padding block, or any block when
// an elementwise mask is set).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#include "core/problem.hpp"

namespace qkv::cpu {

// The queries of one block and the key prefix each of them may see.
struct QueryRows {
  int64_t batch = 0;
  int64_t head = 0;
  int64_t first = 0;            // index of the first query
  int64_t count = 0;            // queries in the block
  const int64_t* key_end = nullptr;  // per query: one past its last visible key
  int64_t min_key_end = 0;
  int64_t max_key_end = 0;
};

// Fills key_end[0..count) and the min/max over the block.
inline void describe_rows(const detail::MaskRule& mask, QueryRows& rows, int64_t* key_end) {
  rows.min_key_end = std::numeric_limits<int64_t>::max();
  rows.max_key_end = 0;
  for (int64_t i = 0; i < rows.count; ++i) {
    key_end[i] = mask.key_end(rows.batch, rows.first + i);
    rows.min_key_end = std::min(rows.min_key_end, key_end[i]);
    rows.max_key_end = std::max(rows.max_key_end, key_end[i]);
  }
  rows.key_end = key_end;
}

// Does the key block [first_key, first_key + keys) need per-element masking?
inline bool needs_mask(const detail::MaskRule& mask, const QueryRows& rows, int64_t first_key,
                       int64_t keys) {
  return mask.has_elementwise() || first_key + keys > rows.min_key_end;
}

// Removed (query, key) pairs become -inf; the additive bias is added to the rest.
inline void apply_mask(const detail::MaskRule& mask, const QueryRows& rows, int64_t first_key,
                       int64_t keys, float* st, std::size_t ld) {
  constexpr float kRemoved = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < keys; ++j) {
    const int64_t key = first_key + j;
    float* row = st + static_cast<std::size_t>(j) * ld;
    for (int64_t i = 0; i < rows.count; ++i) {
      if (key >= rows.key_end[i] || !mask.keeps(rows.batch, rows.head, rows.first + i, key)) {
        row[i] = kRemoved;
        continue;
      }
      if (!mask.bias.empty()) {
        const float bias = mask.bias(rows.batch, rows.head, rows.first + i, key);
        row[i] = bias == kRemoved ? kRemoved : row[i] + bias;
      }
    }
  }
}

}  // namespace qkv::cpu
