// The queries of one block and the scalar half of masking a partial tile: building the
// transposed additive tile add[key][query] (0 or the bias where the pair takes part, −inf
// where it does not) from the boolean and additive masks. block_ops-inl.h applies it,
// and the key_end edge, with SIMD. Only partial tiles of the plan get here.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "core/problem.hpp"

namespace qkv::cpu {

// The queries of one block and the key prefix each of them may see.
struct QueryRows {
  int64_t batch = 0;
  int64_t head = 0;
  int64_t first = 0;                 // index of the first query in its sequence
  int64_t count = 0;                 // queries in the block
  const int32_t* key_begin = nullptr;  // per query: its first visible key (window)
  const int32_t* key_end = nullptr;    // per query: one past its last visible key
  // Per query (null: none): a degenerate row's largest bias, 0 for ordinary rows
  // (MaskRule, TilePlan::degenerate_rows).
  const float* degenerate = nullptr;
};

// Fills key_begin and key_end for the block's queries and empties the `width − count`
// padding columns after them (lengths fit int32: validation caps them).
inline void describe_rows(const detail::MaskRule& mask, QueryRows& rows, int32_t* key_begin,
                          int32_t* key_end, std::size_t width) {
  for (int64_t i = 0; i < rows.count; ++i) {
    key_begin[i] = static_cast<int32_t>(mask.key_begin(rows.batch, rows.first + i));
    key_end[i] = static_cast<int32_t>(mask.key_end(rows.batch, rows.first + i));
  }
  std::fill(key_begin + rows.count, key_begin + width, 0);
  std::fill(key_end + rows.count, key_end + width, 0);
  rows.key_begin = key_begin;
  rows.key_end = key_end;
}

// add[j·ld + i] for keys j < keys and queries i < rows.count: the bias where key
// first_key + j takes part in row i (MaskRule::takes_part), −inf where it does not.
// Reads each query's mask row contiguously; the transposed writes stay in L1.
inline void build_additive_tile(const detail::MaskRule& mask, const QueryRows& rows,
                                int64_t first_key, int64_t keys, float* add, std::size_t ld) {
  constexpr float kRemoved = -std::numeric_limits<float>::infinity();
  const int64_t keep_step = mask.keep.empty() ? 0 : mask.keep.strides[3];
  const int64_t bias_step = mask.bias.empty() ? 0 : mask.bias.strides[3];
  for (int64_t i = 0; i < rows.count; ++i) {
    const int64_t query = rows.first + i;
    const std::uint8_t* keep =
        mask.keep.empty() ? nullptr : &mask.keep(rows.batch, rows.head, query, first_key);
    const float* bias =
        mask.bias.empty() ? nullptr : &mask.bias(rows.batch, rows.head, query, first_key);
    const bool literal = rows.degenerate != nullptr && rows.degenerate[i] != 0.0f;
    float* column = add + i;
    for (int64_t j = 0; j < keys; ++j) {
      const bool kept = keep == nullptr || keep[j * keep_step] != 0;
      const float value = bias == nullptr ? 0.0f : bias[j * bias_step];
      const bool takes_part =
          kept && value != kRemoved && (literal || !(value <= detail::MaskRule::kRemovalBias));
      column[static_cast<std::size_t>(j) * ld] = takes_part ? value : kRemoved;
    }
  }
}

// Degenerate rows (every kept key's bias ≤ kRemovalBias, some finite): in fp32, as in
// PyTorch, s + bias rounds to the bias for any logit s far below |bias| (|s| < 1e22 at
// −1e30), so the row's weights are the softmax of its biases alone. Computed as
// bias − (the row's largest bias), which keeps the weights exact and the LSE meaningful
// for the backward (finfo.min + log n would round back to finfo.min). Overwrites those
// columns of a masked tile st[key][query].
inline void overwrite_degenerate_columns(const detail::MaskRule& mask, const QueryRows& rows,
                                         int64_t first_key, int64_t keys, float* st,
                                         std::size_t ld) {
  if (rows.degenerate == nullptr) return;
  for (int64_t i = 0; i < rows.count; ++i) {
    const float shift = rows.degenerate[i];
    if (shift == 0.0f) continue;
    const int64_t query = rows.first + i;
    const int64_t key_begin = rows.key_begin[i], key_end = rows.key_end[i];
    for (int64_t j = 0; j < keys; ++j) {
      const int64_t key = first_key + j;
      const bool takes_part = key >= key_begin && key < key_end &&
                              mask.takes_part(rows.batch, rows.head, query, key, true);
      st[static_cast<std::size_t>(j) * ld + static_cast<std::size_t>(i)] =
          takes_part ? mask.bias_at(rows.batch, rows.head, query, key) - shift
                     : -std::numeric_limits<float>::infinity();
    }
  }
}

// The backward's LSE of a degenerate row, in the shifted frame overwrite_degenerate_columns
// computes in: log Σ exp(bias − shift) over the keys that take part. The forward's LSE
// (shift + this) rounds to the shift in fp32, as PyTorch's does, so the backward rebuilds
// it here (rare rows, O(Nk) each).
inline float degenerate_row_lse(const detail::MaskRule& mask, int64_t b, int64_t h, int64_t i,
                                float shift) {
  double sum = 0.0;
  for (int64_t j = mask.key_begin(b, i), end = mask.key_end(b, i); j < end; ++j)
    if (mask.takes_part(b, h, i, j, true))
      sum += std::exp(static_cast<double>(mask.bias_at(b, h, i, j)) - shift);
  return static_cast<float>(std::log(sum));
}

}  // namespace qkv::cpu
