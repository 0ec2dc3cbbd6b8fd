// KVCache: owns the cache memory and appends tokens (rounding once to the storage type:
// quantize_rows.cpp); how it is read and attended is kv_cache_read.cpp.
#include "qkv/kv_cache.hpp"

#include <functional>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <type_traits>

#include "cache/cache_config.hpp"
#include "cache/quantize_rows.hpp"
#include "core/checked_size.hpp"
#include "core/attention_rules.hpp"
#include "qkv/error.hpp"

namespace qkv {
namespace {

using detail::channel_scaled;
using detail::half_scales;
using detail::Int4Scale;
using detail::int4_scale;
using detail::is_int4;
using detail::store_float8_row;
using detail::store_int4_channel_row;
using detail::store_int8_channel_row;
using detail::store_row;
using detail::window_rows;

constexpr std::size_t kAlignment = 64;

std::byte* allocate_bytes(std::size_t bytes) {
  const std::size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* raw = std::aligned_alloc(kAlignment, rounded == 0 ? kAlignment : rounded);
  if (raw == nullptr) throw std::bad_alloc();
  return static_cast<std::byte*>(raw);
}

constexpr const char kName[] = "qkv::KVCache";

// The bytes of a cache's buffers. Every size is a product of the caller's numbers, so each
// is checked: an absurd config is refused here instead of wrapping to a tiny buffer that
// append() then overruns. The factors are named as the caller gave them.
struct CacheBytes {
  std::size_t keys = 0, values = 0, scales = 0, value_scales = 0, channel_scales = 0, partial = 0, window = 0,
              table = 0, lengths = 0;
};

CacheBytes cache_bytes(const KVCacheConfig& c, int64_t blocks_per_sequence) {
  using detail::SizeFactor;
  // Storage rows: [batch, capacity] or the pool's [num_blocks, block_size].
  const SizeFactor outer = c.paged ? SizeFactor{"config.num_blocks", c.num_blocks} : SizeFactor{"config.batch", c.batch};
  const SizeFactor inner =
      c.paged ? SizeFactor{"config.block_size", c.block_size} : SizeFactor{"config.capacity", c.capacity};
  const SizeFactor heads{"config.kv_heads", c.kv_heads};
  CacheBytes bytes;
  // A row's elements (int4: its bytes, two values each) and their size.
  const auto row = [&](const char* name, const char* int4_name, int64_t dim) {
    return is_int4(c) ? SizeFactor{int4_name, storage_row_bytes(c.dtype, dim)} : SizeFactor{name, dim};
  };
  const auto element = static_cast<std::size_t>(storage_bytes(c.dtype));
  const std::size_t scale = half_scales(c) ? sizeof(float16) : sizeof(float);
  bytes.keys = detail::checked_bytes(kName, "the key storage",
                                     {outer, inner, heads, row("config.head_dim", "⌈config.head_dim / 2⌉", c.head_dim)},
                                     element);
  bytes.values = detail::checked_bytes(kName, "the value storage",
                                       {outer, inner, heads, row("config.v_dim", "⌈config.v_dim / 2⌉", c.v_dim)}, element);
  if (c.dtype == StorageType::int8 || is_int4(c))
    bytes.scales = detail::checked_bytes(kName, "the row scales", {outer, inner, heads}, scale);
  if (is_int4(c))
    bytes.value_scales = detail::checked_bytes(
        kName, "the values' group scales",
        {outer, inner, heads, {"the value groups (config.v_dim)", 2 * detail::ceil_div(c.v_dim, kValueGroup)}},
        scale);
  if (channel_scaled(c)) {
    const SizeFactor groups{"the groups per row of blocks", detail::ceil_div(inner.value, c.group_size)};
    const SizeFactor dim{"config.head_dim", c.head_dim};
    bytes.channel_scales = detail::checked_bytes(kName, "the keys' channel scales", {outer, groups, heads, dim}, scale);
    const SizeFactor rows{"config.group_size + config.float_window", window_rows(c)};
    bytes.partial = detail::checked_bytes(kName, "the newest keys", {{"config.batch", c.batch}, rows, heads, dim},
                                          sizeof(float));
    if (c.float_window.value_or(0) > 0)
      bytes.window = detail::checked_bytes(kName, "the float window's values",
                                           {{"config.batch", c.batch}, rows, heads, {"config.v_dim", c.v_dim}},
                                           sizeof(float));
  }
  if (c.paged)
    bytes.table = detail::checked_bytes(kName, "the block table",
                                        {{"config.batch", c.batch}, {"blocks per sequence", blocks_per_sequence}},
                                        sizeof(int32_t));
  bytes.lengths = detail::checked_bytes(kName, "the lengths", {{"config.batch", c.batch}}, sizeof(int64_t));
  return bytes;
}

}  // namespace

void KVCache::FreeBytes::operator()(std::byte* p) const { std::free(p); }

void KVCache::ScaleArray::assign(std::size_t count, bool half) {
  if (half) {
    f16_.assign(count, float16(0.0f));
  } else {
    f32_.assign(count, 0.0f);
  }
}

void KVCache::ScaleArray::set(std::size_t i, float value) {
  if (half()) {
    f16_[i] = float16(value);
  } else {
    f32_[i] = value;
  }
}

void KVCache::ScaleArray::wrong_type(const char* name) const {
  detail::Checker(kName).fail(std::string(name) + ": the cache's scales are " + (half() ? "float16" : "float32") +
                              " (config.scale_dtype); ask for " + (half() ? "float16" : "float"));
}

KVCache::KVCache(const KVCacheConfig& config) : config_(config) {
  const detail::Checker check(kName);
  auto positive = [&](const char* name, int64_t value) {
    if (value < 1) check.fail(std::string("config.") + name + ": expected >= 1, got " + std::to_string(value));
  };
  positive("batch", config.batch);
  positive("capacity", config.capacity);
  positive("kv_heads", config.kv_heads);
  positive("head_dim", config.head_dim);
  if (config.v_dim < 0) check.fail("config.v_dim: expected >= 0 (0 = head_dim), got " + std::to_string(config.v_dim));
  if (config_.v_dim == 0) config_.v_dim = config.head_dim;
  if (config.dtype != StorageType::float32 && config.dtype != StorageType::bfloat16 &&
      config.dtype != StorageType::float16 && config.dtype != StorageType::int8 && config.dtype != StorageType::int4 &&
      !is_float8(config.dtype))
    check.fail("config.dtype: expected float32, bfloat16, float16, int8, int4, float8_e4m3fn or float8_e5m2, got value " +
               std::to_string(static_cast<int>(config.dtype)));
  for (const auto& [name, scales] : {std::pair{"config.k_scale", &config.k_scale}, std::pair{"config.v_scale", &config.v_scale}}) {
    if (!is_float8(config.dtype)) {
      if (!scales->empty())
        check.fail(std::string(name) + ": only float8 caches take given scales (this cache is " +
                   storage_name(config.dtype) + ")");
      continue;
    }
    if (!scales->empty() && scales->size() != 1 && static_cast<int64_t>(scales->size()) != config.kv_heads)
      check.fail(std::string(name) + ": expected 1 (per tensor) or " + std::to_string(config.kv_heads) +
                 " (config.kv_heads, per head) scales, got " + std::to_string(scales->size()));
    for (std::size_t h = 0; h < scales->size(); ++h)
      if (!((*scales)[h] > 0.0f) || !std::isfinite((*scales)[h]))
        check.fail(std::string(name) + "[" + std::to_string(h) + "]: expected a positive finite scale, got " +
                   std::to_string((*scales)[h]));
  }
  if (config.k_scale.empty() != config.v_scale.empty())
    check.fail(std::string("config.") + (config.k_scale.empty() ? "k_scale" : "v_scale") +
               ": given without the other (both, or neither: set by the first append)");
  if (config.key_scales != KeyScales::row && config.key_scales != KeyScales::channel)
    check.fail("config.key_scales: expected row or channel, got value " + std::to_string(static_cast<int>(config.key_scales)));
  if (is_int4(config) && !channel_scaled(config))
    check.fail("config.key_scales: int4 keys are scaled per channel (KeyScales::channel): one 4-bit scale per row "
               "loses most of post-RoPE keys (bench/KV_QUANTIZATION.md), got row");
  config_.scale_dtype = config.scale_dtype.value_or(is_int4(config) ? StorageType::float16 : StorageType::float32);
  if (config_.scale_dtype != StorageType::float32 && config_.scale_dtype != StorageType::float16)
    check.fail(std::string("config.scale_dtype: expected float32 or float16, got ") + storage_name(*config_.scale_dtype));
  if (half_scales(config_) && !is_int4(config))
    check.fail(std::string("config.scale_dtype: float16 scales are for int4 caches (int8 ones keep float32, which "
                           "qkv::decode's DecodeArgs take), got dtype ") + storage_name(config.dtype));
  const int64_t window =
      config.float_window.value_or(is_int4(config) ? std::min(kInt4FloatWindow, config.capacity) : 0);
  config_.float_window = window;
  if (window != 0 && !channel_scaled(config))
    check.fail("config.float_window: a float window is for caches with channel-scaled keys (int8 or int4, "
               "KeyScales::channel), got " + std::to_string(window));
  if (channel_scaled(config)) {
    if (config.dtype != StorageType::int8 && !is_int4(config))
      check.fail(std::string("config.key_scales: channel scales are for int8 and int4 caches, got dtype ") +
                 storage_name(config.dtype));
    if (window < 0 || window > config.capacity)
      check.fail("config.float_window: expected 0.." + std::to_string(config.capacity) +
                 " newest tokens kept float32 (config.capacity), got " + std::to_string(window));
    if (config.group_size < 1 || config.group_size > config.capacity)
      check.fail("config.group_size: expected 1.." + std::to_string(config.capacity) +
                 " tokens per channel-scale group (config.capacity), got " + std::to_string(config.group_size));
    if (config.paged && config.block_size % config.group_size != 0)
      check.fail("config.group_size: must divide config.block_size (" + std::to_string(config.block_size) +
                 ") so that a group never spans blocks, got " + std::to_string(config.group_size));
  }
  if (config.paged) {
    if (config.block_size < 1 || config.block_size > 4096)
      check.fail("config.block_size: expected 1..4096 keys per block, got " + std::to_string(config.block_size));
    blocks_per_sequence_ = detail::ceil_div(config.capacity, config.block_size);
    if (config.num_blocks < 0) check.fail("config.num_blocks: expected >= 0 (0 = enough for every sequence), got " + std::to_string(config.num_blocks));
    if (config_.num_blocks == 0)
      config_.num_blocks = detail::checked_product(
          kName, "config.num_blocks", {{"config.batch", config.batch}, {"blocks per sequence", blocks_per_sequence_}});
    if (config_.num_blocks > std::numeric_limits<int32_t>::max())
      check.fail("config.num_blocks: at most 2^31 - 1 blocks (the block table is int32), got " + std::to_string(config_.num_blocks));
  }
  const CacheBytes bytes = cache_bytes(config_, blocks_per_sequence_);
  if (config.paged) {
    detail::allocate_or_throw(kName, "the block table", bytes.table, [&] {
      table_.assign(bytes.table / sizeof(int32_t), -1);
      free_.resize(static_cast<std::size_t>(config_.num_blocks));
    });
    // Taken from the back: block 0 first, so a fresh cache fills the pool in order.
    for (std::size_t i = 0; i < free_.size(); ++i) free_[i] = static_cast<int32_t>(free_.size() - 1 - i);
  }
  detail::allocate_or_throw(kName, "the key storage", bytes.keys, [&] { k_.reset(allocate_bytes(bytes.keys)); });
  detail::allocate_or_throw(kName, "the value storage", bytes.values, [&] { v_.reset(allocate_bytes(bytes.values)); });
  if (bytes.scales != 0) {  // one scale per stored row (int4: keys only)
    detail::allocate_or_throw(kName, "the row scales", 2 * bytes.scales + bytes.value_scales, [&] {
      const std::size_t scale = half_scales(config_) ? sizeof(float16) : sizeof(float);
      k_scale_.assign(bytes.scales / scale, half_scales(config_));
      if (!is_int4(config_)) v_scale_.assign(bytes.scales / sizeof(float), 0.0f);
      if (is_int4(config_)) v_group_scale_.assign(bytes.value_scales / scale, half_scales(config_));
    });
  }
  if (channel_scaled(config_)) {
    window_rows_ = window_rows(config_);
    detail::allocate_or_throw(kName, "the keys' channel scales", 2 * bytes.channel_scales + bytes.partial + bytes.window, [&] {
      const std::size_t scale = half_scales(config_) ? sizeof(float16) : sizeof(float);
      k_channel_scale_.assign(bytes.channel_scales / scale, half_scales(config_));
      k_channel_zero_.assign(bytes.channel_scales / scale, half_scales(config_));
      k_partial_.assign(bytes.partial / sizeof(float), 0.0f);
      v_window_.assign(bytes.window / sizeof(float), 0.0f);
    });
    if (config_.float_window > 0) quantized_.assign(static_cast<std::size_t>(config_.batch), 0);
  }
  if (is_float8(config_.dtype)) {  // kv_heads scales each, repeated from a per-tensor one
    const auto per_head = [&](const std::vector<float>& given) {
      return given.size() == 1 ? std::vector<float>(static_cast<std::size_t>(config_.kv_heads), given[0]) : given;
    };
    config_.k_scale = per_head(config.k_scale);
    config_.v_scale = per_head(config.v_scale);
  }
  detail::allocate_or_throw(kName, "the lengths", bytes.lengths,
                            [&] { lengths_.assign(bytes.lengths / sizeof(int64_t), 0); });
  mutex_ = std::make_unique<std::shared_mutex>();
}

std::array<int64_t, 4> KVCache::k_shape() const {
  if (config_.paged) return {config_.num_blocks, config_.block_size, config_.kv_heads, config_.head_dim};
  return {config_.batch, config_.capacity, config_.kv_heads, config_.head_dim};
}

std::array<int64_t, 4> KVCache::k_channel_shape() const {
  if (!channel_scaled(config_)) return {0, 0, 0, 0};
  const auto shape = k_shape();
  return {shape[0], detail::ceil_div(shape[1], config_.group_size), shape[2], shape[3]};
}

int64_t KVCache::row_scale_at(int64_t row, int64_t head) const {
  if (!is_int4(config_)) return row * config_.kv_heads + head;
  const int64_t inner = config_.paged ? config_.block_size : config_.capacity;
  return (row / inner * config_.kv_heads + head) * inner + row % inner;
}

int64_t KVCache::value_group_at(int64_t row, int64_t head, int64_t i) const {
  const int64_t inner = config_.paged ? config_.block_size : config_.capacity;
  const int64_t scales = 2 * detail::ceil_div(config_.v_dim, kValueGroup);
  return ((row / inner * config_.kv_heads + head) * scales + i) * inner + row % inner;
}

int64_t KVCache::storage_row(int64_t seq, int64_t key) const {
  if (!config_.paged) return seq * config_.capacity + key;
  const int32_t block = table_[static_cast<std::size_t>(seq * blocks_per_sequence_ + key / config_.block_size)];
  return static_cast<int64_t>(block) * config_.block_size + key % config_.block_size;
}

// Group `group` of sequence seq's keys, whose first `rows` keys are in k_partial_: per kv
// head and channel, over the group's finite rows, the range [lo, hi] mapped onto the 256
// int8 levels — scale = hi/255 − lo/255, zero point = lo + 128·scale, so −128 is lo and 127
// is hi (KIVI's asymmetric quantization: a channel's values need not be centred on 0) —
// or the 16 int4 levels 0..15 (scale = hi/15 − lo/15, zero point lo), then every row
// against them. A channel with one value (or none finite) gets scale 0 and zero point lo
// (0).
void KVCache::quantize_key_group(int64_t seq, int64_t group, int64_t rows) {
  const int64_t hkv = config_.kv_heads, d = config_.head_dim, g = config_.group_size;
  const int64_t first = group * g;
  // The group's channel scales: [outer, groups, Hkv, d] at (sequence | block, group in it).
  const int64_t groups_per_outer = k_channel_shape()[1];
  const int64_t outer = config_.paged ? table_[static_cast<std::size_t>(seq * blocks_per_sequence_ + first / config_.block_size)] : seq;
  const int64_t group_in_outer = config_.paged ? (first % config_.block_size) / g : group;
  auto* keys = reinterpret_cast<std::uint8_t*>(k_.get());
  const bool int4 = is_int4(config_);
  const int64_t row_bytes = storage_row_bytes(config_.dtype, d), levels = int4 ? 15 : 255;
  const bool half = half_scales(config_);
  // One head's channel scales and zero points as stored (float16 ones widened).
  std::vector<float> scale_row(static_cast<std::size_t>(d)), zero_row(static_cast<std::size_t>(d));
  float* scale = scale_row.data();
  float* zero = zero_row.data();
  for (int64_t h = 0; h < hkv; ++h) {
    const auto at = static_cast<std::size_t>(((outer * groups_per_outer + group_in_outer) * hkv + h) * d);
    const auto partial_row = [&](int64_t i) {
      return &k_partial_[static_cast<std::size_t>(((seq * window_rows_ + (first + i) % window_rows_) * hkv + h) * d)];
    };
    std::fill(scale, scale + d, std::numeric_limits<float>::infinity());  // lo, for now
    std::fill(zero, zero + d, -std::numeric_limits<float>::infinity());   // hi, for now
    for (int64_t i = 0; i < rows; ++i) {
      const float* x = partial_row(i);
      if (!std::all_of(x, x + d, [](float v) { return std::isfinite(v); })) continue;
      for (int64_t c = 0; c < d; ++c) {
        scale[c] = std::min(scale[c], x[c]);
        zero[c] = std::max(zero[c], x[c]);
      }
    }
    for (int64_t c = 0; c < d; ++c) {
      const float lo = std::isfinite(scale[c]) ? scale[c] : 0.0f, hi = std::isfinite(zero[c]) ? zero[c] : 0.0f;
      if (int4) {
        const Int4Scale fit = int4_scale(lo, hi, half);
        scale[c] = fit.scale;
        zero[c] = fit.zero;
      } else {
        // hi/255 − lo/255, not (hi − lo)/255, and the zero point summed in double: a channel
        // holding both ±3e38 has a range past float's, and stays finite this way.
        scale[c] = hi / static_cast<float>(levels) - lo / static_cast<float>(levels);
        zero[c] = scale[c] == 0.0f ? lo : static_cast<float>(static_cast<double>(lo) + 128.0 * static_cast<double>(scale[c]));
      }
      k_channel_scale_.set(at + static_cast<std::size_t>(c), scale[c]);
      k_channel_zero_.set(at + static_cast<std::size_t>(c), zero[c]);
    }
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t row = storage_row(seq, first + i);
      std::uint8_t* out = keys + (row * hkv + h) * row_bytes;
      float row_scale = 0.0f;
      if (int4) {
        store_int4_channel_row(partial_row(i), scale, zero, d, out, &row_scale);
      } else {
        store_int8_channel_row(partial_row(i), scale, zero, d, reinterpret_cast<std::int8_t*>(out), &row_scale);
      }
      k_scale_.set(static_cast<std::size_t>(row_scale_at(row, h)), row_scale);
    }
  }
}

std::array<int64_t, 4> KVCache::v_shape() const {
  auto shape = k_shape();
  shape[3] = config_.v_dim;
  return shape;
}

// The new rows of one append: `count` entries, entry n going to sequence seqs[n] (or n),
// tokens(n) of them, row (n, t, h) of K at k_row(n, t, h) (V alike).
struct KVCache::NewRows {
  int64_t count = 0;
  std::span<const int64_t> seqs;
  std::function<int64_t(int64_t)> tokens;
  std::function<const float*(int64_t, int64_t, int64_t)> k_row, v_row;
  const char* tokens_name = "";  // the argument a sequence's token count comes from
};

void KVCache::append(View4<const float> k, View4<const float> v, std::span<const int64_t> seqs) {
  const detail::Checker check("qkv::KVCache::append");
  const detail::Described kf = detail::describe("k", k), vf = detail::describe("v", v);
  check.expect_well_formed(kf);
  check.expect_well_formed(vf);
  const int64_t count = seqs.empty() ? config_.batch : static_cast<int64_t>(seqs.size());
  const std::string rows_because = seqs.empty() ? "the cache's batch" : "one per entry of seqs";
  check.expect_extent(kf, 0, "sequences", count, rows_because);
  check.expect_extent(kf, 2, "kv heads", config_.kv_heads, "the cache's kv_heads");
  check.expect_extent(kf, 3, "head_dim", config_.head_dim, "the cache's head_dim");
  check.expect_extent(vf, 0, "sequences", count, rows_because);
  check.expect_extent(vf, 1, "tokens", k.shape[1], "as k.shape[1]");
  check.expect_extent(vf, 2, "kv heads", config_.kv_heads, "the cache's kv_heads");
  check.expect_extent(vf, 3, "head_dim", config_.v_dim, "the cache's v_dim");
  const int64_t tokens = k.shape[1];
  append_rows(check, NewRows{.count = count, .seqs = seqs, .tokens = [tokens](int64_t) { return tokens; },
                             .k_row = [&k](int64_t n, int64_t t, int64_t h) { return &k(n, t, h, 0); },
                             .v_row = [&v](int64_t n, int64_t t, int64_t h) { return &v(n, t, h, 0); },
                             .tokens_name = "k.shape[1] (tokens)"});
}

void KVCache::append_varlen(View3<const float> k, View3<const float> v, SeqOffsets cu_seqlens,
                            std::span<const int64_t> seqs) {
  const detail::Checker check("qkv::KVCache::append_varlen");
  const detail::Described kf = detail::describe("k", k), vf = detail::describe("v", v);
  check.expect_well_formed(kf);
  check.expect_well_formed(vf);
  const int64_t count = seqs.empty() ? config_.batch : static_cast<int64_t>(seqs.size());
  if (static_cast<int64_t>(cu_seqlens.size()) != count + 1) {
    check.fail("cu_seqlens: expected " + std::to_string(count + 1) + " entries (" +
               (seqs.empty() ? "the cache's batch" : "one per entry of seqs") + " + 1), got " +
               std::to_string(cu_seqlens.size()));
  }
  for (int64_t n = 0; n <= count; ++n) {
    const int64_t at = cu_seqlens[static_cast<std::size_t>(n)];
    const int64_t before = n == 0 ? 0 : cu_seqlens[static_cast<std::size_t>(n - 1)];
    if ((n == 0 && at != 0) || at < before || at > k.shape[0]) {
      check.fail("cu_seqlens[" + std::to_string(n) + "]: expected " +
                 (n == 0 ? std::string("0") : std::to_string(before) + ".." + std::to_string(k.shape[0]) +
                                                  " (prefix sums, within k.shape[0])") +
                 ", got " + std::to_string(at));
    }
  }
  check.expect_extent(kf, 0, "total", cu_seqlens[static_cast<std::size_t>(count)], "as cu_seqlens[-1]");
  check.expect_extent(kf, 1, "kv heads", config_.kv_heads, "the cache's kv_heads");
  check.expect_extent(kf, 2, "head_dim", config_.head_dim, "the cache's head_dim");
  check.expect_extent(vf, 0, "total", k.shape[0], "as k.shape[0]");
  check.expect_extent(vf, 1, "kv heads", config_.kv_heads, "the cache's kv_heads");
  check.expect_extent(vf, 2, "head_dim", config_.v_dim, "the cache's v_dim");
  const auto first = [&cu_seqlens](int64_t n) { return cu_seqlens[static_cast<std::size_t>(n)]; };
  append_rows(check, NewRows{.count = count, .seqs = seqs,
                             .tokens = [&first](int64_t n) { return first(n + 1) - first(n); },
                             .k_row = [&](int64_t n, int64_t t, int64_t h) { return &k(first(n) + t, h, 0); },
                             .v_row = [&](int64_t n, int64_t t, int64_t h) { return &v(first(n) + t, h, 0); },
                             .tokens_name = "cu_seqlens"});
}

void KVCache::append_rows(const detail::Checker& check, const NewRows& rows) {
  // Exclusive: the checks below read the lengths and the free list that the writes then
  // change, and another thread's append must not take the same free block in between.
  const std::unique_lock lock(*mutex_);
  std::vector<bool> seen(static_cast<std::size_t>(config_.batch), false);
  int64_t blocks_needed = 0;
  const auto seq_of = [&](int64_t n) { return rows.seqs.empty() ? n : rows.seqs[static_cast<std::size_t>(n)]; };
  for (int64_t n = 0; n < rows.count; ++n) {
    const int64_t seq = seq_of(n);
    if (seq < 0 || seq >= config_.batch)
      check.fail("seqs[" + std::to_string(n) + "]: expected a sequence 0.." + std::to_string(config_.batch - 1) + ", got " + std::to_string(seq));
    if (seen[static_cast<std::size_t>(seq)])
      check.fail("seqs[" + std::to_string(n) + "]: sequence " + std::to_string(seq) + " appears twice");
    seen[static_cast<std::size_t>(seq)] = true;
    const int64_t length = lengths_[static_cast<std::size_t>(seq)], tokens = rows.tokens(n);
    if (tokens > config_.capacity - length)
      check.fail(std::string(rows.tokens_name) + ": sequence " + std::to_string(seq) + " holds " + std::to_string(length) +
                 " of " + std::to_string(config_.capacity) + " keys; " + std::to_string(tokens) + " more do not fit");
    if (config_.paged) {
      const int64_t bs = config_.block_size;
      blocks_needed += detail::ceil_div(length + tokens, bs) - detail::ceil_div(length, bs);
    }
  }
  const auto free_now = static_cast<int64_t>(free_.size());  // not free_blocks(): the lock is held
  if (config_.paged && blocks_needed > free_now)
    check.fail(std::string(rows.tokens_name) + ": the pool has " + std::to_string(free_now) + " free blocks, " +
               std::to_string(blocks_needed) + " are needed (config.num_blocks)");

  // float16 scales: every finite key and value within float16's range (their zero points
  // and scales are float16; see the header).
  if (half_scales(config_)) {
    const auto in_range = [&](const char* what, const float* row, int64_t count, int64_t n, int64_t t, int64_t h) {
      for (int64_t c = 0; c < count; ++c)
        if (std::isfinite(row[c]) && std::abs(row[c]) > 65504.0f)
          check.fail(std::string(what) + "[" + std::to_string(n) + ", " + std::to_string(t) + ", " + std::to_string(h) +
                     ", " + std::to_string(c) + "]: " + std::to_string(row[c]) +
                     " is beyond float16's range (±65504), which this cache's float16 scales (config.scale_dtype) cover");
    };
    for (int64_t n = 0; n < rows.count; ++n)
      for (int64_t t = 0; t < rows.tokens(n); ++t)
        for (int64_t h = 0; h < config_.kv_heads; ++h) {
          in_range("k", rows.k_row(n, t, h), config_.head_dim, n, t, h);
          in_range("v", rows.v_row(n, t, h), config_.v_dim, n, t, h);
        }
  }

  // Everything checked: from here on nothing throws.
  if (is_float8(config_.dtype) && config_.k_scale.empty()) set_float8_scales(rows);
  const int64_t hkv = config_.kv_heads, d = config_.head_dim, dv = config_.v_dim;
  const auto k_row_bytes = static_cast<std::size_t>(storage_row_bytes(config_.dtype, d));
  const auto v_row_bytes = static_cast<std::size_t>(storage_row_bytes(config_.dtype, dv));
  const int64_t value_scales = is_int4(config_) ? 2 * detail::ceil_div(dv, kValueGroup) : 1;
  std::vector<float> row_scales(static_cast<std::size_t>(value_scales));  // one row's, before they are stored
  auto* kb = reinterpret_cast<std::byte*>(k_.get());
  auto* vb = reinterpret_cast<std::byte*>(v_.get());
  for (int64_t n = 0; n < rows.count; ++n) {
    const int64_t seq = seq_of(n), tokens = rows.tokens(n);
    int64_t& length = lengths_[static_cast<std::size_t>(seq)];
    for (int64_t t = 0; t < tokens; ++t, ++length) {
      int64_t row = seq * config_.capacity + length;  // storage row of (seq, key)
      if (config_.paged) {
        int32_t& block = table_[static_cast<std::size_t>(seq * blocks_per_sequence_ + length / config_.block_size)];
        if (block < 0) {
          block = free_.back();
          free_.pop_back();
        }
        row = static_cast<int64_t>(block) * config_.block_size + length % config_.block_size;
      }
      const int64_t g = config_.group_size, window = *config_.float_window;
      const auto window_at = static_cast<std::size_t>((seq * window_rows_ + length % std::max<int64_t>(window_rows_, 1)) * hkv);
      for (int64_t h = 0; h < hkv; ++h) {
        const auto scale_at = static_cast<std::size_t>(row * hkv + h);
        if (channel_scaled(config_)) {  // kept as float32 until its group is quantized, below
          const float* key = rows.k_row(n, t, h);
          std::copy(key, key + d, &k_partial_[(window_at + static_cast<std::size_t>(h)) * static_cast<std::size_t>(d)]);
        } else if (is_float8(config_.dtype)) {
          store_float8_row(config_.dtype, rows.k_row(n, t, h), d, config_.k_scale[static_cast<std::size_t>(h)],
                           kb + static_cast<std::size_t>(row * hkv + h) * k_row_bytes);
        } else {
          store_row(config_.dtype, rows.k_row(n, t, h), d, kb + static_cast<std::size_t>(row * hkv + h) * k_row_bytes,
                    row_scales.data(), false);
          if (!k_scale_.empty()) k_scale_.set(static_cast<std::size_t>(row_scale_at(row, h)), row_scales[0]);
        }
        if (is_float8(config_.dtype)) {
          store_float8_row(config_.dtype, rows.v_row(n, t, h), dv, config_.v_scale[static_cast<std::size_t>(h)],
                           vb + static_cast<std::size_t>(row * hkv + h) * v_row_bytes);
        } else {
          store_row(config_.dtype, rows.v_row(n, t, h), dv, vb + static_cast<std::size_t>(row * hkv + h) * v_row_bytes,
                    row_scales.data(), half_scales(config_));
        }
        if (is_int4(config_)) {
          for (int64_t i = 0; i < value_scales; ++i)
            v_group_scale_.set(static_cast<std::size_t>(value_group_at(row, h, i)), row_scales[static_cast<std::size_t>(i)]);
        } else if (!v_scale_.empty()) {
          v_scale_[scale_at] = row_scales[0];
        }
        if (window > 0) {  // attended as float32 while in the window
          const float* value = rows.v_row(n, t, h);
          std::copy(value, value + dv, &v_window_[(window_at + static_cast<std::size_t>(h)) * static_cast<std::size_t>(dv)]);
        }
      }
      if (channel_scaled(config_) && window == 0) {
        // A group is quantized when it is full, and the newest one again at each append.
        if ((length + 1) % g == 0 || t + 1 == tokens) quantize_key_group(seq, length / g, length % g + 1);
      } else if (window > 0) {
        // A group is quantized, once, when its last key is `window` behind the newest
        // (before the window's rows that hold it are taken by newer keys).
        int64_t& quantized = quantized_[static_cast<std::size_t>(seq)];
        while (quantized + g + window <= length + 1) {
          quantize_key_group(seq, quantized / g, g);
          quantized += g;
        }
      }
    }
  }
}

// Per kv head: max |x| over the append's finite keys (values) of that head / the format's
// largest finite value, so that the largest maps onto it; 1 where a head has none nonzero.
void KVCache::set_float8_scales(const NewRows& rows) {
  const int64_t hkv = config_.kv_heads;
  std::vector<float> k_max(static_cast<std::size_t>(hkv), 0.0f), v_max(static_cast<std::size_t>(hkv), 0.0f);
  bool any = false;
  for (int64_t n = 0; n < rows.count; ++n)
    for (int64_t t = 0; t < rows.tokens(n); ++t) {
      any = true;
      for (int64_t h = 0; h < hkv; ++h) {
        const auto largest = [](float m, const float* x, int64_t count) {
          for (int64_t c = 0; c < count; ++c)
            if (std::isfinite(x[c])) m = std::max(m, std::abs(x[c]));
          return m;
        };
        k_max[static_cast<std::size_t>(h)] = largest(k_max[static_cast<std::size_t>(h)], rows.k_row(n, t, h), config_.head_dim);
        v_max[static_cast<std::size_t>(h)] = largest(v_max[static_cast<std::size_t>(h)], rows.v_row(n, t, h), config_.v_dim);
      }
    }
  if (!any) return;  // no tokens: the next append decides
  const float largest = config_.dtype == StorageType::float8_e5m2 ? float8_e5m2::kMax : float8_e4m3fn::kMax;
  const auto scale = [largest](float m) {
    const float s = m / largest;
    return s > 0.0f && std::isfinite(s) ? s : 1.0f;  // none nonzero (or m / largest underflows)
  };
  config_.k_scale.resize(static_cast<std::size_t>(hkv));
  config_.v_scale.resize(static_cast<std::size_t>(hkv));
  for (std::size_t h = 0; h < static_cast<std::size_t>(hkv); ++h) {
    config_.k_scale[h] = scale(k_max[h]);
    config_.v_scale[h] = scale(v_max[h]);
  }
}

int64_t KVCache::free_blocks() const {
  const std::shared_lock lock(*mutex_);
  return static_cast<int64_t>(free_.size());
}

void KVCache::reset() {
  const std::unique_lock lock(*mutex_);
  for (int64_t seq = 0; seq < config_.batch; ++seq) reset_locked(seq);
}

void KVCache::reset(int64_t seq) {
  if (seq < 0 || seq >= config_.batch)
    detail::Checker("qkv::KVCache::reset").fail("seq: expected 0.." + std::to_string(config_.batch - 1) + ", got " + std::to_string(seq));
  const std::unique_lock lock(*mutex_);
  reset_locked(seq);
}

void KVCache::reset_locked(int64_t seq) {
  lengths_[static_cast<std::size_t>(seq)] = 0;
  if (!quantized_.empty()) quantized_[static_cast<std::size_t>(seq)] = 0;
  if (!config_.paged) return;
  for (int64_t j = 0; j < blocks_per_sequence_; ++j) {
    int32_t& block = table_[static_cast<std::size_t>(seq * blocks_per_sequence_ + j)];
    if (block >= 0) free_.push_back(block);
    block = -1;
  }
}


}  // namespace qkv
