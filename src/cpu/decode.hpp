// The decode kernel's problem: few queries per sequence against many cached keys, read
// in place from contiguous or paged memory stored as float32, bfloat16, float16 or int8
// (with a scale per row).
// Built by the public entry points (qkv::decode, KVCache::attend, and attention_forward
// when its shape calls for it) after they validated everything; the kernel may assume
// every invariant written here.
#pragma once

#include <algorithm>
#include <cstdint>

#include "qkv/half.hpp"
#include "qkv/options.hpp"

namespace qkv::cpu {

// Strides (in elements) of a [batch | pool block, key, kv head, ...] view's first three
// axes: where each cached row (or its int8 scale) starts.
struct RowStrides {
  int64_t batch = 0, row = 0, head = 0;

  template <class View>
  static RowStrides of(const View& view) {
    return {view.strides[0], view.strides[1], view.strides[2]};
  }
};

// Where key/value rows live. Row (sequence b, key j, kv head h) of K starts at
//   contiguous: k + b·k_strides.batch + j·k_strides.row + h·k_strides.head
//   paged:      k + page·k_strides.batch + (j % page_size)·k_strides.row + h·k_strides.head,
//               page = block_table[b·table_stride + j / page_size]
// (paged: the batch stride steps between pool blocks). Elements of `type`; each row's
// head_dim (or v_dim) elements are contiguous. int8 storage: row (b, j, h) of K also has
// a float scale at k_scale + offset(k_scale_strides, b, j, h) (V alike); the row's values
// are int8 · scale.
struct KvSource {
  StorageType type = StorageType::float32;
  const void* k = nullptr;
  const void* v = nullptr;
  RowStrides k_strides, v_strides;
  const float* k_scale = nullptr;  // int8 only
  const float* v_scale = nullptr;
  RowStrides k_scale_strides, v_scale_strides;
  const int32_t* block_table = nullptr;  // null: contiguous
  int64_t table_stride = 0;
  int64_t page_size = 0;

  bool paged() const { return block_table != nullptr; }

  // Element offset of row (b, j, h) in a view with these strides (K, V or their scales).
  int64_t offset(const RowStrides& strides, int64_t batch, int64_t key, int64_t head) const {
    if (!paged()) return batch * strides.batch + key * strides.row + head * strides.head;
    const int64_t page = block_table[batch * table_stride + key / page_size];
    return page * strides.batch + (key % page_size) * strides.row + head * strides.head;
  }
  // Keys [key, run_end(key)) lie strides.row apart (the rest of key's page).
  int64_t run_end(int64_t key) const {
    return paged() ? (key / page_size + 1) * page_size : INT64_MAX;
  }
};

struct DecodeProblem {
  int64_t batch = 0;
  int64_t q_len = 0;     // Nq, any (tiles of 16 queries share one pass over K/V)
  int64_t q_heads = 0;   // Hq, a multiple of kv_heads
  int64_t kv_heads = 0;
  int64_t head_dim = 0;  // d ≥ 1
  int64_t v_dim = 0;     // dv ≥ 1

  const float* q = nullptr;  // q[b·q_batch + i·q_row + h·q_head + c]
  int64_t q_batch = 0, q_row = 0, q_head = 0;
  KvSource kv;

  // Keys of sequence b: [0, lengths[b]) (null: key_len for every sequence); query i sees
  // the prefix causality leaves it, exactly as MaskRule::key_end.
  const int64_t* lengths = nullptr;
  int64_t key_len = 0;
  Causal causal = Causal::none;

  float* out = nullptr;  // out[b·out_batch + i·out_row + h·out_head + c], c < v_dim
  int64_t out_batch = 0, out_row = 0, out_head = 0;
  float* lse = nullptr;  // optional: lse[b·lse_batch + h·lse_head + i·lse_row]
  int64_t lse_batch = 0, lse_head = 0, lse_row = 0;

  double scale = 1.0;
  int threads = 1;  // resolved, ≥ 1

  // Variants, as in AttentionOptions (validated): the sliding window cuts each row's key
  // range further (keys before a row's window are never read); soft-cap c·tanh(s/c),
  // then ALiBi's −slope·|i + Nk − Nq − j|, are applied to the scaled logits before the
  // masks; a sink joins each row's softmax denominator without a value.
  Window window;
  float softcap = 0.0f;                  // 0: off
  const float* alibi_slopes = nullptr;  // [q_heads], or null
  const float* sinks = nullptr;         // [q_heads], or null

  int64_t group() const { return q_heads / kv_heads; }
  int64_t valid_keys(int64_t b) const { return lengths == nullptr ? key_len : lengths[b]; }
  // Where query i meets the keys for the window (and ALiBi's distances): 0 for top_left,
  // bottom-right otherwise — exactly MaskRule::window_offset.
  int64_t window_offset(int64_t b) const {
    return causal == Causal::top_left ? 0 : valid_keys(b) - q_len;
  }
  // One past the last key query row i of sequence b sees (MaskRule::key_end). Never
  // decreases along i.
  int64_t key_end(int64_t b, int64_t i) const {
    const int64_t valid = valid_keys(b);
    int64_t end = valid;
    switch (causal) {
      case Causal::top_left:
        end = std::min(valid, i + 1);
        break;
      case Causal::bottom_right:
        end = std::clamp<int64_t>(i + 1 + (valid - q_len), 0, valid);
        break;
      case Causal::none:
        break;
    }
    if (window.right >= 0) end = std::clamp<int64_t>(i + window_offset(b) + window.right + 1, 0, end);
    return end;
  }
  // The first key query row i sees (MaskRule::key_begin): 0 without a left window. Never
  // decreases along i; the row sees [key_begin, key_end), possibly nothing.
  int64_t key_begin(int64_t b, int64_t i) const {
    if (window.left < 0) return 0;
    return std::clamp<int64_t>(i + window_offset(b) - window.left, 0, valid_keys(b));
  }
};

// Runs the decode kernel (fused, fp32 arithmetic, SIMD target chosen at runtime).
// Results are bitwise identical for every thread count.
void decode(const DecodeProblem& problem);

}  // namespace qkv::cpu
