// Where an attention problem's key and value rows live, for every path: a dense call's K/V
// views, a contiguous cache [B, capacity, Hkv, d] (any strides), or a paged pool
// [num_blocks, block_size, Hkv, d] with a block table — stored as float32, bfloat16,
// float16, int8 or float8 (with a float scale per row). Built by validation; read by the decode
// schedule and the reference (the tiled schedules read ForwardArgs::k/v, the same memory,
// which validation sets whenever K/V are a plain view of the call's storage type).
#pragma once

#include <cstddef>
#include <cstdint>

#include "qkv/half.hpp"

namespace qkv::detail {

// Scales and zero points as a cache stores them: float32, or float16 (qkv::KVCache's
// scale_dtype, for int4 caches: half the bytes of every scale). Indexed like a pointer;
// float16 widens to float exactly, so a reader sees the same numbers either way.
struct ScalePtr {
  const void* data = nullptr;
  bool half = false;  // float16, else float32

  ScalePtr() = default;
  ScalePtr(std::nullptr_t) {}                                    // NOLINT: none
  ScalePtr(const float* p) : data(p) {}                          // NOLINT: every float scale array
  ScalePtr(const float16* p) : data(p), half(true) {}            // NOLINT
  float operator[](int64_t i) const {
    return half ? static_cast<float>(static_cast<const float16*>(data)[i]) : static_cast<const float*>(data)[i];
  }
  ScalePtr operator+(int64_t i) const {
    return half ? ScalePtr(static_cast<const float16*>(data) + i) : ScalePtr(static_cast<const float*>(data) + i);
  }
  // float32 scales in place (null for float16 ones, which a reader widens first).
  const float* floats() const { return half ? nullptr : static_cast<const float*>(data); }
  const float16* halves() const { return half ? static_cast<const float16*>(data) : nullptr; }
  friend bool operator==(const ScalePtr& p, std::nullptr_t) { return p.data == nullptr; }
};

// Strides (in elements) of a [batch | pool block, key, kv head, ...] view's first three
// axes: where each key/value row (or its int8 scale) starts.
struct RowStrides {
  int64_t batch = 0, row = 0, head = 0;

  template <class View>
  static RowStrides of(const View& view) {
    return {view.strides[0], view.strides[1], view.strides[2]};
  }
};

// Row (sequence b, key j, kv head h) of K starts at
//   contiguous: k + b·k_strides.batch + j·k_strides.row + h·k_strides.head
//   paged:      k + page·k_strides.batch + (j % page_size)·k_strides.row + h·k_strides.head,
//               page = block_table[b·table_stride + j / page_size]
// (paged: the batch stride steps between pool blocks). Elements of `type`; each row's
// head_dim (or v_dim) elements are contiguous. int8 storage: row (b, j, h) of K also has
// a float scale at k_scale + offset(k_scale_strides, b, j, h) (V alike); the row's values
// are int8 · scale. int8 keys may also be scaled per channel over groups of key_group
// consecutive keys (qkv::KVCache's KeyScales::channel): key (b, j, h, c) is then
// k_scale(b, j, h) · (int8 · k_channel_scale(b, group of j, h, c) + k_channel_zero(…, c))
// (no zero points: 0), the group's d scales (zero points) contiguous at channel_scales(b,
// j, h) (channel_zeros) — contiguous caches: group j / key_group of
// sequence b; paged: group (j % page_size) / key_group of j's pool block (page_size a
// multiple of key_group, so a group never spans blocks).
// int4 storage (qkv::KVCache only): rows of ⌈d / 2⌉ bytes (uint4x2, strides in bytes),
// levels u = 0..15; keys always per channel as above, key = k_scale · (u · channel scale
// + zero point); value (b, j, h, c) = u · s + z with (s, z) of the row's channel group
// c / value_group: the row's groups' scales then zero points, 2·⌈dv / value_group⌉ of
// them, v_group_stride apart, from v_group_scale + offset(v_group_strides, b, j, h)
// (qkv::KVCache stores them group-major per head and block, so that one group's scales
// of consecutive keys are contiguous: the decode kernel reads them as vectors).
// Scales and zero points are float32 (ScalePtr), or float16 for an int4 KVCache with
// scale_dtype float16 (its keys' row scales, channel scales and zero points, and value
// group scales alike).
// A float window (quantized caches of qkv::KVCache with a float_window): the keys j ≥
// quantized_lengths[b] of sequence b are read, K and V, as float32 from the window rows
// window_k / window_v, [B, window_rows, Hkv, d | dv] contiguous, key j in row j %
// window_rows; the keys before are the quantized storage's.
// Gathered keys (qkv::decode with key lists, cache/decode_sparse.cpp): key j of batch
// entry b and kv head h is position key_positions[b·positions_stride + j] of sequence
// key_sequence[b], kv head h + key_head, of the storage described by the rest — every
// accessor below maps (b, j, h) so first, so every reader (the decode kernel, the
// reference) reads the listed rows in place. Each key is its own run (run_end), and the
// window holds the keys from gathered_stored[b] on (the positions ascend, so the
// window's keys are the list's tail).
// Keys in two parts (latent attention, qkv::mla_decode): channels [0, rope_from) of key
// (b, j, h) are k's row, channels [rope_from, head_dim) are the row of k_rope (same
// storage type, rows located through the same batch/table/positions, k_rope_strides) —
// the latent row c_kv and the rotary key k_pe kept in two caches, never copied into one.
// The values are then usually k's rows themselves (v = k, v_dim = rope_from).
struct KvSource {
  StorageType type = StorageType::float32;
  const void* k = nullptr;
  const void* v = nullptr;
  RowStrides k_strides, v_strides;
  ScalePtr k_scale;  // int8 and int4 (int4 values: none)
  ScalePtr v_scale;
  RowStrides k_scale_strides, v_scale_strides;
  ScalePtr k_channel_scale;  // keys scaled per channel, else null
  ScalePtr k_channel_zero;   // and their zero points (null: none)
  RowStrides k_channel_strides;            // axes [batch | block, group, kv head], both
  int64_t key_group = 0;                   // keys per channel-scale group
  ScalePtr v_group_scale;                  // int4 values: scales then zero points per row
  RowStrides v_group_strides;
  int64_t v_group_stride = 1;              // between one row's scales (and zero points)
  int64_t value_group = 0;                 // int4 values: channels per group
  const float* window_k = nullptr;         // float window (null: none)
  const float* window_v = nullptr;
  int64_t window_rows = 0;
  int64_t kv_heads = 0, head_dim = 0, v_dim = 0;  // the window rows' layout
  const int64_t* quantized_lengths = nullptr;     // per sequence, with a window
  const int32_t* block_table = nullptr;  // null: contiguous
  int64_t table_stride = 0;
  int64_t page_size = 0;
  const int64_t* key_positions = nullptr;  // gathered keys (null: none; see above)
  int64_t positions_stride = 0;
  const int64_t* key_sequence = nullptr;
  int64_t key_head = 0;
  const int64_t* gathered_stored = nullptr;  // with a window
  const void* k_rope = nullptr;  // keys in two parts (null: one; see above)
  RowStrides k_rope_strides;
  int64_t rope_from = 0;

  bool split_keys() const { return k_rope != nullptr; }
  bool gathered() const { return key_positions != nullptr; }
  // (b, j, h) of the problem as the storage's (sequence, position, kv head).
  void locate(int64_t& batch, int64_t& key, int64_t& head) const {
    if (!gathered()) return;
    key = key_positions[batch * positions_stride + key];
    batch = key_sequence[batch];
    head += key_head;
  }

  bool paged() const { return block_table != nullptr; }
  bool scaled() const { return type == StorageType::int8 || type == StorageType::int4 || is_float8(type); }
  bool windowed() const { return window_k != nullptr; }
  // Keys of sequence b before this are the quantized storage's, the rest the window's.
  int64_t quantized_length(int64_t batch) const {
    if (!windowed()) return INT64_MAX;
    return gathered() ? gathered_stored[batch] : quantized_lengths[batch];
  }
  const float* window_key(int64_t batch, int64_t key, int64_t head) const {
    locate(batch, key, head);
    return window_k + ((batch * window_rows + key % window_rows) * kv_heads + head) * head_dim;
  }
  const float* window_value(int64_t batch, int64_t key, int64_t head) const {
    locate(batch, key, head);
    return window_v + ((batch * window_rows + key % window_rows) * kv_heads + head) * v_dim;
  }
  int64_t value_groups() const { return (v_dim + value_group - 1) / value_group; }
  // int4 values: the row's group scales (value_groups() of them, then as many zero
  // points, v_group_stride apart).
  ScalePtr value_group_scales(int64_t batch, int64_t key, int64_t head) const {
    return v_group_scale + offset(v_group_strides, batch, key, head);
  }

  // Element offset of row (b, j, h) in a view with these strides (K, V or their scales).
  int64_t offset(const RowStrides& strides, int64_t batch, int64_t key, int64_t head) const {
    locate(batch, key, head);
    if (!paged()) return batch * strides.batch + key * strides.row + head * strides.head;
    const int64_t page = block_table[batch * table_stride + key / page_size];
    return page * strides.batch + (key % page_size) * strides.row + head * strides.head;
  }
  bool channel_scaled() const { return !(k_channel_scale == nullptr); }
  // The d channel scales (and zero points) of key j's group (b, h): see above.
  int64_t channel_offset(int64_t batch, int64_t key, int64_t head) const {
    const RowStrides& s = k_channel_strides;
    locate(batch, key, head);
    if (!paged()) return batch * s.batch + (key / key_group) * s.row + head * s.head;
    const int64_t page = block_table[batch * table_stride + key / page_size];
    return page * s.batch + ((key % page_size) / key_group) * s.row + head * s.head;
  }
  ScalePtr channel_scales(int64_t batch, int64_t key, int64_t head) const {
    return k_channel_scale + channel_offset(batch, key, head);
  }
  // Null without zero points.
  ScalePtr channel_zeros(int64_t batch, int64_t key, int64_t head) const {
    return k_channel_zero == nullptr ? ScalePtr{} : k_channel_zero + channel_offset(batch, key, head);
  }
  // Keys [key, run_end(key)) lie strides.row apart (the rest of key's page).
  int64_t run_end(int64_t key) const {
    if (gathered()) return key + 1;
    return paged() ? (key / page_size + 1) * page_size : INT64_MAX;
  }

  // The source of a plain K/V view pair (a dense call, or a contiguous cache).
  template <class View>
  static KvSource of_views(StorageType type, const View& k, const View& v) {
    KvSource source;
    source.type = type;
    source.k = k.data;
    source.v = v.data;
    source.k_strides = RowStrides::of(k);
    source.v_strides = RowStrides::of(v);
    return source;
  }

  // The source of a cache's K/V views and, for int8 storage, their row scales (views
  // shaped like the cache without its last axis; ignored for other types). Contiguous;
  // a paged cache sets block_table, table_stride and page_size after.
  template <class View, class ScaleView>
  static KvSource of_cache(StorageType type, const View& k, const View& v, const ScaleView& k_scales,
                           const ScaleView& v_scales) {
    KvSource source = of_views(type, k, v);
    if (type == StorageType::int8 || is_float8(type)) {
      source.k_scale = k_scales.data;
      source.v_scale = v_scales.data;
      source.k_scale_strides = RowStrides::of(k_scales);
      source.v_scale_strides = RowStrides::of(v_scales);
    }
    return source;
  }
  // The same, with int8 keys' channel scales (an empty view: none) in groups of key_group.
  template <class View, class ScaleView, class ChannelView>
  static KvSource of_cache(StorageType type, const View& k, const View& v, const ScaleView& k_scales,
                           const ScaleView& v_scales, const ChannelView& k_channel_scales,
                           const ChannelView& k_channel_zeros, int64_t key_group) {
    KvSource source = of_cache(type, k, v, k_scales, v_scales);
    if (type == StorageType::int8 && !k_channel_scales.empty()) {
      source.k_channel_scale = k_channel_scales.data;
      source.k_channel_zero = k_channel_zeros.data;  // validated: the strides of the scales
      source.k_channel_strides = RowStrides::of(k_channel_scales);
      source.key_group = key_group;
    }
    return source;
  }
};

}  // namespace qkv::detail
