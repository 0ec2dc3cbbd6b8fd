// qkv::KVCache — the keys and values of B sequences kept across generation steps.
//
// Memory is allocated once, at construction; append() never reallocates.
//   contiguous: K [B, capacity, Hkv, d] and V [B, capacity, Hkv, dv]
//   paged:      a pool of blocks K [num_blocks, block_size, Hkv, d] (V alike) and a block
//               table [B, ⌈capacity / block_size⌉] (int32, -1 = no block yet): the layout
//               vLLM uses. append() takes blocks from the pool as sequences grow;
//               reset(seq) gives a sequence's blocks back.
// Storage is float32, bfloat16 or float16: appended values are rounded once (to nearest
// even); attention widens them exactly and computes in float32. Or int8, quantized per
// row (one token's d values of one kv head) with its own float scale = max|x| / 127:
// each value within scale/2 of its stored int8 · scale, a quarter of float32's bytes
// plus 4 bytes a row. Keys may instead be quantized per channel (KeyScales::channel, for
// int8; KIVI): post-RoPE keys have a few channels many times larger than the rest, on
// which one scale per row spends most of the int8 range. Each group of group_size
// consecutive tokens of a sequence (per kv head) gets, per channel, the range [lo, hi]
// of its keys mapped onto the 256 levels: scale = (hi − lo) / 255 and a zero point, the
// stored key being int8 · scale + zero, every value within half a step (scale) of the
// original; a row's own scale is then 1 (NaN for a row holding NaN or ±inf). The newest,
// partial group is quantized from its rows so far and quantized again from their float32
// copy (kept per sequence, group_size rows) as tokens arrive, so the stored cache does not
// depend on how the tokens were split into appends once their group is full.
// int4 (StorageType::int4, keys always per channel): two values per byte, levels 0..15.
// Keys as above over 16 levels (scale = (hi − lo) / 15, zero point lo); each value row
// per group of 32 channels (kValueGroup), its own range mapped onto the 16 levels, a scale
// and zero point per group — within half a step of every value. About 0.5 + 8/G (keys)
// and 0.25 (values) bytes per value with float32 scales. With scale_dtype float16 (int4
// only, and its default) every scale, zero point and key row flag is float16 instead: 4 + 32/G bits per
// key (+ 16/d for the row flag) and 5 per value — 4.8 bits a value at G = 64, d = 128
// (4.9 at d = 64), where float32 scales take 5.6 (5.75). Each scale is rounded up and each zero point down to a
// float16 before the values are quantized against them, so the range still covers every
// value and each stays within half a (rounded) step; appended keys and values must then
// lie within float16's range, ±65504 (append refuses others, changing nothing).
// A float window (float_window = W > 0, for caches with channel-scaled keys): the newest
// tokens' keys and values are kept as float32 and attended as such; a group of keys is
// quantized (once) when its last key is W tokens behind the newest, so at least W and
// fewer than W + group_size of the newest tokens are exact. Attention weight sits on the
// recent tokens: on SmolLM2 a window of 32 cuts a 4-bit cache's KL divergence 3–4×
// (bench/KV_QUANTIZATION.md). Such caches (and int4 ones) attend through attend();
// views() refuses them, since DecodeArgs cannot describe their rows.
//
//   KVCache cache({.batch = 1, .capacity = 4096, .kv_heads = 8, .head_dim = 128,
//                  .dtype = StorageType::bfloat16});
//   cache.append(k_new, v_new);           // [B, T, Hkv, d]: T new tokens per sequence
//   cache.attend(q, out);                 // q [B, T, Hq, d] against everything cached
//
// attend() aligns the queries with the newest keys (Causal::bottom_right): query i of
// sequence b sees keys 0 .. length(b) − T + i. decode() (qkv/decode.hpp) is the same
// computation over caches the caller owns; views() hands this cache's memory to it.
//
// Threads: append, attend, reset and free_blocks may be called on one cache from several
// threads at once (the Python binding releases the GIL in append and attend). append and
// reset are serialized (each holds the cache exclusively, so every append sees and
// leaves consistent books: blocks in use + free == num_blocks, no block held twice);
// attends run concurrently with each other but never beside an append or reset, so an
// attend sees each sequence either before or after another thread's append, never half
// of it. Two threads appending to the same sequence are serialized too; their order is
// whichever takes the cache first, which is the caller's to arrange. NOT synchronized:
// lengths(), block_table(), k_scales(), v_scales(), k_channel_scales(), k_data(), v_data()
// and views()
// return the cache's own memory, valid to read only while no other thread appends or
// resets; and the constructor, destructor and moves, like any object's.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "qkv/attention.hpp"  // SeqOffsets
#include "qkv/decode.hpp"
#include "qkv/half.hpp"
#include "qkv/rotary.hpp"
#include "qkv/tensor.hpp"

namespace qkv {
namespace detail {
class Checker;
struct KvSource;
struct CacheReader;  // src/cache/cache_reader.hpp
}

// How int8 keys are scaled: one scale per stored row, or a scale and zero point per
// channel over groups of tokens (see above; int4 keys: always per channel). int8 values
// are scaled per row, int4 values per row and group of kValueGroup channels.
enum class KeyScales { row, channel };
inline constexpr int64_t kValueGroup = 32;
inline constexpr int64_t kInt4FloatWindow = 32;  // KVCacheConfig::float_window's default for int4

struct KVCacheConfig {
  int64_t batch = 1;      // sequences, ≥ 1
  int64_t capacity = 0;   // keys per sequence at most, ≥ 1
  int64_t kv_heads = 1;   // ≥ 1
  int64_t head_dim = 0;   // d ≥ 1
  int64_t v_dim = 0;      // dv; 0: head_dim
  StorageType dtype = StorageType::float32;
  bool paged = false;
  int64_t block_size = 16;  // paged: keys per block, 1..4096 (16..256 typical)
  int64_t num_blocks = 0;   // paged: pool size; 0: enough for every sequence at capacity
  KeyScales key_scales = KeyScales::row;  // int8; int4 takes channel only
  int64_t group_size = 32;  // KeyScales::channel: tokens per group, 1..capacity (paged: divides block_size)
  // KeyScales::channel: newest tokens kept float32, 0..capacity (0: none). Unset: int4
  // caches keep kInt4FloatWindow (or capacity, if smaller), others none; config() holds
  // the number chosen. Without a window a 4-bit cache misses the quality bar on SmolLM2
  // (mean KLD 2.1e-2, top-1 91.9%; with 32: 2.3e-3, 99%: bench/KV_QUANTIZATION.md).
  std::optional<int64_t> float_window;
  // int4: float32 or float16 (unset: float16, the same accuracy on SmolLM2 in 15% fewer
  // bytes); other types: float32. config() holds the type chosen.
  std::optional<StorageType> scale_dtype;
  // float8 caches (float8_e4m3fn, float8_e5m2): the keys' and values' scales, stored value
  // = float8(x / scale) · scale — one (per tensor) or kv_heads (per kv head), positive and
  // finite. Empty: per kv head, set by the first append that brings tokens to max |x| over
  // its finite values of that head / the format's largest finite value (448 or 57344; 1
  // where the head has no nonzero finite value), then kept for the cache's life (reset
  // keeps them; a later value beyond scale · largest saturates, qkv/float8.hpp).
  // config() holds the kv_heads scales once they are known. Other storage types: empty.
  std::vector<float> k_scale, v_scale;
};

class KVCache {
 public:
  explicit KVCache(const KVCacheConfig& config);

  const KVCacheConfig& config() const { return config_; }
  // Keys held per sequence.
  std::span<const int64_t> lengths() const { return lengths_; }
  // Paged: blocks not assigned to any sequence.
  int64_t free_blocks() const;

  // Appends T new tokens to each sequence of `seqs` (default: every sequence, in order):
  // k [n, T, Hkv, d], v [n, T, Hkv, dv] with n = seqs.size() (or batch). Throws
  // qkv::Error, changing nothing, on a bad shape, a repeated or unknown sequence, a
  // sequence that would pass capacity, or a pool with too few free blocks.
  void append(View4<const float> k, View4<const float> v, std::span<const int64_t> seqs = {});
  // The same for a serving step's packed new tokens (a varlen batch, as qkv::BatchPlan
  // takes them): entry n of `seqs` (default: sequence n) gets rows [cu_seqlens[n],
  // cu_seqlens[n+1]) of k [total, Hkv, d] and v [total, Hkv, dv] — any number each, 0
  // included. Checked in full before anything is written, as append is.
  void append_varlen(View3<const float> k, View3<const float> v, SeqOffsets cu_seqlens,
                     std::span<const int64_t> seqs = {});
  // The same with the new keys rotated on the way in (RoPE, qkv/rotary.hpp; v is not
  // rotated): new token t of entry n is rotary row n·T + t (append) or cu_seqlens[n] + t
  // (append_varlen), or that entry of rotary.positions. k itself is not written (the
  // rotated rows go through scratch). The Rotary's errors, like every other, change nothing.
  void append(View4<const float> k, View4<const float> v, const Rotary& rotary, std::span<const int64_t> seqs = {});
  void append_varlen(View3<const float> k, View3<const float> v, SeqOffsets cu_seqlens, const Rotary& rotary,
                     std::span<const int64_t> seqs = {});

  // out [B, T, Hq, dv] (and lse [B, Hq, T], optional: {}) = attention of q [B, T, Hq, d]
  // against every sequence's cached keys, with the options qkv::decode reads: set
  // causal = Causal::bottom_right for the usual step (the T queries are each sequence's
  // newest tokens); AttentionOptions' default, none, lets every query see every key.
  void attend(View4<const float> q, View4<float> out, View3<float> lse,
              const AttentionOptions& options) const;
  // The same over key lists (DeepSeek sparse attention's top-k; DecodeArgs::indices
  // says what they hold): [B, T, topk] or [B, Hkv, T, topk] of cache positions, −1 none.
  void attend(View4<const float> q, View4<float> out, View3<float> lse, const AttentionOptions& options,
              const KeyIndices& indices) const;
  // The usual step: the same with every option at its default but causal = bottom_right.
  void attend(View4<const float> q, View4<float> out, View3<float> lse = {}) const;

  // DeepSeek's lightning indexer (qkv/index_topk.hpp) with this cache's keys as its keys
  // (kv_heads = 1, head_dim = di; the values are not read: give the cache v_dim = 1):
  // indices [B, Nq, topk] = the top-k keys of sequence b's length(b) cached keys for
  // q [B, Nq, Hi, di] (float) and weights [B, Nq, Hi], rows aligned as options.causal says
  // (bottom_right, the usual step: row i sees keys 0 .. length(b) − Nq + i). The keys are
  // read in place, each exactly as stored() gives it. Takes the options index_topk takes
  // except key_lengths (the cache lengths). q may be bfloat16 (a bf16 model's): over a
  // bfloat16 cache, with Precision::fast where vdpbf16ps is the CPU's bf16 unit, the head
  // logits run there as qkv::index_topk's do. See docs/indexer.md.
  void index_topk(View4<const float> q, View3<const float> weights, View3<int32_t> indices,
                  const AttentionOptions& options = {}) const;
  void index_topk(View4<const bfloat16> q, View3<const float> weights, View3<int32_t> indices,
                  const AttentionOptions& options = {}) const;

  void reset();             // every sequence empty (paged: all blocks back to the pool)
  void reset(int64_t seq);  // one sequence empty

  // The cache's memory as decode() takes it, in the storage type T (must match dtype).
  template <class T>
  DecodeArgs<T> views() const;

  // The scale arrays below hold S = float, or float16 for a cache with scale_dtype
  // float16 (asking for the other type throws qkv::Error).
  // int8: the rows' scales, shaped k_shape()[0..2] (empty for other storage types); float8:
  // the kv_heads scales (empty until the first append sets them, if not given); int4:
  // the keys' row flags (1, or NaN for a row holding NaN or ±inf), [B | blocks, Hkv,
  // capacity | block_size]: each head's rows together, so that decode widens a run of
  // them (float16) in one pass.
  template <class S = float>
  std::span<const S> k_scales() const {
    if constexpr (std::is_same_v<S, float>)
      if (is_float8(config_.dtype)) return config_.k_scale;
    return k_scale_.span<S>("k_scales");
  }
  std::span<const float> v_scales() const {
    return is_float8(config_.dtype) ? std::span<const float>(config_.v_scale) : std::span<const float>(v_scale_);
  }
  // KeyScales::channel: the keys' channel scales and zero points, [B, ⌈capacity /
  // group_size⌉, Hkv, d] or paged [num_blocks, block_size / group_size, Hkv, d] (empty
  // otherwise).
  template <class S = float>
  std::span<const S> k_channel_scales() const { return k_channel_scale_.span<S>("k_channel_scales"); }
  template <class S = float>
  std::span<const S> k_channel_zeros() const { return k_channel_zero_.span<S>("k_channel_zeros"); }
  std::array<int64_t, 4> k_channel_shape() const;

  // int4: the value rows' group scales then zero points, [B | blocks, Hkv, 2·⌈dv /
  // kValueGroup⌉, capacity | block_size] (empty for other storage types): one group's
  // scales of a head's consecutive rows together, so that decode reads them as vectors.
  template <class S = float>
  std::span<const S> v_group_scales() const { return v_group_scale_.span<S>("v_group_scales"); }
  // With a float window: keys [0, quantized_lengths()[b]) of sequence b are read from the
  // quantized storage, the newer ones from the float window (empty without one).
  std::span<const int64_t> quantized_lengths() const { return quantized_; }

  // The keys and values attention reads for sequence seq, as float32: K [length, Hkv, d]
  // and V [length, Hkv, dv] row-major — the storage widened or dequantized (scales and
  // zero points applied), the float window's rows as they are. For tests and tools: the
  // exact values any error should be measured against.
  std::pair<std::vector<float>, std::vector<float>> stored(int64_t seq) const;

  // Raw storage, for bindings that hand it out without copying.
  const void* k_data() const { return k_.get(); }
  const void* v_data() const { return v_.get(); }
  void* k_data() { return k_.get(); }
  void* v_data() { return v_.get(); }
  // The 4-D shape of the K (or V, with dv) storage: [B, capacity, …] or [num_blocks, block_size, …]
  // (in values: an int4 row of d values is ⌈d / 2⌉ bytes).
  std::array<int64_t, 4> k_shape() const;
  std::array<int64_t, 4> v_shape() const;
  // Paged: [B, blocks per sequence], row-major; empty when contiguous.
  std::span<const int32_t> block_table() const { return table_; }
  int64_t blocks_per_sequence() const { return blocks_per_sequence_; }

 private:
  struct FreeBytes {
    void operator()(std::byte* p) const;
  };
  void reset_locked(int64_t seq);  // reset(seq) with the lock held
  struct NewRows;                  // kv_cache.cpp
  void append_rows(const detail::Checker& check, const NewRows& rows);
  KVCacheConfig config_;
  // Held exclusively by append and reset, shared by attend and free_blocks. Behind a
  // pointer so that a cache stays movable (std::vector<KVCache>, Transformer::make_caches).
  std::unique_ptr<std::shared_mutex> mutex_;
  int64_t blocks_per_sequence_ = 0;
  std::unique_ptr<std::byte, FreeBytes> k_, v_;
  // Scales or zero points in config.scale_dtype: float32, or float16 (one of the two
  // vectors is used).
  class ScaleArray {
   public:
    void assign(std::size_t count, bool half);
    // Stores value, which a float16 array holds exactly (the quantizer rounds it first).
    void set(std::size_t i, float value);
    bool empty() const { return f32_.empty() && f16_.empty(); }
    bool half() const { return !f16_.empty(); }
    const void* data() const { return half() ? static_cast<const void*>(f16_.data()) : f32_.data(); }
    template <class S>
    std::span<const S> span(const char* name) const {
      static_assert(std::is_same_v<S, float> || std::is_same_v<S, float16>, "scales are float or float16");
      if (std::is_same_v<S, float16> != half() && !empty()) wrong_type(name);
      if constexpr (std::is_same_v<S, float>) {
        return f32_;
      } else {
        return f16_;
      }
    }

   private:
    [[noreturn]] void wrong_type(const char* name) const;
    std::vector<float> f32_;
    std::vector<float16> f16_;
  };
  std::vector<int64_t> lengths_;
  std::vector<int32_t> table_;  // paged: [batch, blocks_per_sequence_], -1 = none
  std::vector<int32_t> free_;   // paged: unassigned pool blocks, taken from the back
  ScaleArray k_scale_;          // int8: one scale per stored row (k_shape()[0..2]); int4: the row flags
  std::vector<float> v_scale_;  // int8: one scale per stored value row
  // KeyScales::channel: the channel scales (k_channel_shape()), and each sequence's newest
  // keys as float32, [batch, window_rows_, Hkv, d] (key j in row j % window_rows_:
  // group_size + float_window rows), to quantize a group when it is due. With a float
  // window the values too ([batch, window_rows_, Hkv, dv]).
  ScaleArray k_channel_scale_, k_channel_zero_;
  std::vector<float> k_partial_, v_window_;
  ScaleArray v_group_scale_;  // int4 values
  std::vector<int64_t> quantized_;    // float window: keys quantized per sequence
  void set_float8_scales(const NewRows& rows);  // the first append's, when not given
  int64_t window_rows_ = 0;
  int64_t storage_row(int64_t seq, int64_t key) const;  // the row of (seq, key) in k_/v_
  // Where (storage row, head)'s scale is in k_scale_: int8 [outer, inner, Hkv]; int4
  // [outer, Hkv, inner].
  int64_t row_scale_at(int64_t row, int64_t head) const;
  // Where its value group scale (or zero point) i is in v_group_scale_: [outer, Hkv,
  // 2·groups, inner].
  int64_t value_group_at(int64_t row, int64_t head, int64_t i) const;
  void quantize_key_group(int64_t seq, int64_t group, int64_t rows);
  detail::KvSource source() const;  // the cache as the kernels read it
  friend struct detail::CacheReader;  // qkv::BatchPlan::run over a cache: its source, under its lock
};

}  // namespace qkv
