// qkv::decode — attention of a few new queries per sequence against a key/value cache
// that the caller owns, read in place: the step of autoregressive generation.
//
//   q        [B, Nq, Hq, d]    float32, any strides (last dimension contiguous)
//   cache, contiguous:  k_cache [B, capacity, Hkv, d],  v_cache [B, capacity, Hkv, dv]
//   cache, paged:       k_cache [num_blocks, block_size, Hkv, d] (the pool), v_cache alike,
//                       block_table [B, max_blocks] (int32): key j of sequence b lives in
//                       pool block block_table[b, j / block_size], row j % block_size
//   cache_lengths [B]   keys held for each sequence, the new tokens' own keys included
//   out      [B, Nq, Hq, dv]   float32;  lse [B, Hq, Nq] optional
//
// K/V elements are float32, bfloat16 or float16 (widened exactly; arithmetic in float32),
// or int8 with a float scale per row (k_scale, v_scale; qkv::KVCache quantizes so): the
// kernel multiplies each key's dot product by its scale and each weight by its value
// row's scale, so the result is attention over the values int8 · scale. int8 keys may
// carry channel scales and zero points too (k_channel_scale, k_channel_zero): the kernel
// multiplies the query by its keys' group's channel scales before the dot product and
// adds q · zero points after — nothing is dequantized to memory.
// float8_e4m3fn / float8_e5m2 caches (qkv/float8.hpp; vLLM's and SGLang's FP8 KV caches,
// torch's float8 tensors) carry scales the same way, usually one per tensor or per kv
// head: give k_scale / v_scale as views with strides 0 along the rows (a [B | blocks,
// capacity | block_size, Hkv] view of Hkv floats with strides {0, 0, 1}, or {0, 0, 0}
// for one). The bytes are widened in place (exactly, NaN and e5m2's ±inf kept), never
// dequantized to memory: the result is attention over float8 · scale.
// With the default Causal::bottom_right, the Nq queries are the last Nq tokens of their
// sequence: query i of sequence b sees keys j ≤ i + cache_lengths[b] − Nq. A query that
// sees no key (a sequence shorter than Nq, or empty) gets out 0 and lse −inf.
// Keys at or past cache_lengths[b] are never read.
//
// Every argument is validated before any output is written; a bad call throws qkv::Error
// naming the argument. Results are bitwise identical for every thread count.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "qkv/half.hpp"
#include "qkv/options.hpp"
#include "qkv/sparse.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

template <class T>  // the cache's storage type: float, bfloat16, float16, int8_t, float8_e4m3fn, float8_e5m2
struct DecodeArgs {
  View4<const float> q;
  View4<const T> k_cache, v_cache;
  std::span<const int64_t> cache_lengths;
  TensorView<const int32_t, 2> block_table;  // empty: contiguous cache
  View4<float> out;
  View3<float> lse;  // optional
  // int8 and float8 caches only (empty otherwise; required for them): one float scale per
  // cached row, the row's values being element · scale — [B, capacity, Hkv] or, paged,
  // [num_blocks, block_size, Hkv], any strides (0 repeats a per-head or per-tensor scale).
  View3<const float> k_scale, v_scale;
  // int8 keys scaled per channel as well (qkv::KVCache with KeyScales::channel; empty:
  // per row only): key (b, j, h, c) = k_scale(b, j, h) · (k_cache · k_channel_scale(b,
  // j / key_group, h, c) + k_channel_zero(b, j / key_group, h, c)), a float scale (and
  // optionally a zero point; empty: 0) per channel for each group of key_group
  // consecutive keys — [B, ⌈capacity / key_group⌉, Hkv, d]; paged [num_blocks,
  // block_size / key_group, Hkv, d], block_size a multiple of key_group (row
  // j % block_size of its block is in the block's group (j % block_size) / key_group).
  // The zero points have the scales' shape and strides.
  View4<const float> k_channel_scale, k_channel_zero;
  int64_t key_group = 0;
  // Optional key lists (DeepSeek sparse attention's top-k, as qkv/sparse.hpp defines
  // them): [B, Nq, topk] shared by the heads, or [B, Hkv, Nq, topk] per kv head, int32
  // or int64; entries are cache positions 0..cache_lengths[b] − 1 of their sequence, or
  // −1 for none. A query attends the keys it lists (repeats once) that causal allows;
  // an index outside [−1, cache_lengths[b]) is a qkv::Error naming its batch entry and
  // row, and nothing is written. options.window and alibi_slopes are refused with them.
  KeyIndices indices;
};

// The options are the same AttentionOptions as every other entry point's. qkv::decode
// reads scale, causal (Causal::bottom_right for the usual step, where the queries are
// their sequence's newest tokens; AttentionOptions' default, none, lets every query see
// every cached key), window, softcap, alibi_slopes, sinks and execution (threads; backend:
// automatic and cpu run the cpu backend's split-K schedule, reference the fp64 oracle over
// the same cache). cache_lengths take the place of key_lengths; options.mask,
// key_lengths, dropout, modifiers and execution.check_finite are refused with qkv::Error.
void decode(const DecodeArgs<float>& args, const AttentionOptions& options);
void decode(const DecodeArgs<bfloat16>& args, const AttentionOptions& options);
void decode(const DecodeArgs<float16>& args, const AttentionOptions& options);
void decode(const DecodeArgs<std::int8_t>& args, const AttentionOptions& options);
void decode(const DecodeArgs<float8_e4m3fn>& args, const AttentionOptions& options);
void decode(const DecodeArgs<float8_e5m2>& args, const AttentionOptions& options);
// The usual step, as DecodeOptions (removed; see docs/cpp.md) meant by default: every
// option at its default but causal = Causal::bottom_right.
void decode(const DecodeArgs<float>& args);
void decode(const DecodeArgs<bfloat16>& args);
void decode(const DecodeArgs<float16>& args);
void decode(const DecodeArgs<std::int8_t>& args);
void decode(const DecodeArgs<float8_e4m3fn>& args);
void decode(const DecodeArgs<float8_e5m2>& args);

}  // namespace qkv
