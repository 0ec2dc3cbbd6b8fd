// How a qkv::KVCache is read: as DecodeArgs views of its memory (views), as the kernels'
// key/value source (source), attended (attend), and dequantized (stored).
#include "qkv/kv_cache.hpp"

#include <cstdint>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "cache/cache_config.hpp"
#include "cache/decode_source.hpp"
#include "check/checker.hpp"
#include "core/checked_size.hpp"
#include "core/kv_source.hpp"
#include "reference/key_values.hpp"

namespace qkv {
namespace {

using detail::channel_scaled;
using detail::is_int4;

}  // namespace

template <class T>
DecodeArgs<T> KVCache::views() const {
  if (config_.float_window > 0)
    detail::Checker("qkv::KVCache::views").fail(
        "the cache has a float window (config.float_window): its newest keys are float32 rows that DecodeArgs "
        "cannot describe; attend through the cache");
  if (storage_type_of<T> != config_.dtype)
    detail::Checker("qkv::KVCache::views").fail(std::string("the cache stores ") + storage_name(config_.dtype) +
                                                   ", asked for " + storage_name(storage_type_of<T>));
  DecodeArgs<T> args;
  args.k_cache = View4<const T>::contiguous(static_cast<const T*>(k_data()), k_shape());
  args.v_cache = View4<const T>::contiguous(static_cast<const T*>(v_data()), v_shape());
  args.cache_lengths = lengths_;
  if (config_.paged)
    args.block_table = TensorView<const int32_t, 2>::contiguous(table_.data(), {config_.batch, blocks_per_sequence_});
  if constexpr (is_float8(storage_type_of<T>)) {
    // One scale per kv head, read as every row's: strides 0 along the rows. Empty before
    // the first append sets them (nothing is attended then).
    const auto shape = k_shape();
    const std::array<int64_t, 3> rows{shape[0], shape[1], shape[2]}, per_head{0, 0, 1};
    if (!config_.k_scale.empty()) {
      args.k_scale = View3<const float>(config_.k_scale.data(), rows, per_head);
      args.v_scale = View3<const float>(config_.v_scale.data(), rows, per_head);
    }
  }
  if constexpr (storage_type_of<T> == StorageType::int8) {
    const auto shape = k_shape();
    args.k_scale = View3<const float>::contiguous(k_scale_.span<float>("k_scales").data(), {shape[0], shape[1], shape[2]});
    args.v_scale = View3<const float>::contiguous(v_scale_.data(), {shape[0], shape[1], shape[2]});
    if (channel_scaled(config_)) {
      args.k_channel_scale = View4<const float>::contiguous(k_channel_scale_.span<float>("k_channel_scales").data(), k_channel_shape());
      args.k_channel_zero = View4<const float>::contiguous(k_channel_zero_.span<float>("k_channel_zeros").data(), k_channel_shape());
      args.key_group = config_.group_size;
    }
  }
  return args;
}

template DecodeArgs<float> KVCache::views<float>() const;
template DecodeArgs<bfloat16> KVCache::views<bfloat16>() const;
template DecodeArgs<float16> KVCache::views<float16>() const;
template DecodeArgs<std::int8_t> KVCache::views<std::int8_t>() const;
template DecodeArgs<float8_e4m3fn> KVCache::views<float8_e4m3fn>() const;
template DecodeArgs<float8_e5m2> KVCache::views<float8_e5m2>() const;

void KVCache::attend(View4<const float> q, View4<float> out, View3<float> lse) const {
  AttentionOptions step;  // as qkv::decode(args) takes it
  step.causal = Causal::bottom_right;
  attend(q, out, lse, step);
}

void KVCache::attend(View4<const float> q, View4<float> out, View3<float> lse,
                     const AttentionOptions& options) const {
  attend(q, out, lse, options, KeyIndices{});
}

void KVCache::attend(View4<const float> q, View4<float> out, View3<float> lse, const AttentionOptions& options,
                     const KeyIndices& indices) const {
  auto run = [&](auto args) {
    args.q = q;
    args.out = out;
    args.lse = lse;
    args.indices = indices;
    decode(args, options);
  };
  // Shared: attends run together, but never beside an append or reset, whose lengths,
  // block table and rows they read.
  const std::shared_lock lock(*mutex_);
  if (is_int4(config_) || config_.float_window > 0)  // rows DecodeArgs cannot describe
    return detail::decode_cache_source(source(), config_.capacity, lengths_, q, out, lse, options, indices);
  switch (config_.dtype) {
    case StorageType::float32: return run(views<float>());
    case StorageType::bfloat16: return run(views<bfloat16>());
    case StorageType::float16: return run(views<float16>());
    case StorageType::int8: return run(views<std::int8_t>());
    case StorageType::int4: return;  // above
    case StorageType::float8_e4m3fn: return run(views<float8_e4m3fn>());
    case StorageType::float8_e5m2: return run(views<float8_e5m2>());
  }
}

detail::KvSource KVCache::source() const {
  const auto scale_ptr = [](const ScaleArray& a) {
    return a.half() ? detail::ScalePtr(static_cast<const float16*>(a.data())) : detail::ScalePtr(static_cast<const float*>(a.data()));
  };
  detail::KvSource s;
  const auto [outer, inner, hkv, d] = k_shape();
  const int64_t dv = config_.v_dim;
  const int64_t k_row = storage_row_bytes(config_.dtype, d) / (is_int4(config_) ? 1 : storage_bytes(config_.dtype));
  const int64_t v_row = storage_row_bytes(config_.dtype, dv) / (is_int4(config_) ? 1 : storage_bytes(config_.dtype));
  (void)outer;
  s.type = config_.dtype;
  s.k = k_.get();
  s.v = v_.get();
  s.k_strides = {inner * hkv * k_row, hkv * k_row, k_row};
  s.v_strides = {inner * hkv * v_row, hkv * v_row, v_row};
  s.kv_heads = hkv;
  s.head_dim = d;
  s.v_dim = dv;
  if (!k_scale_.empty()) {
    s.k_scale = scale_ptr(k_scale_);
    s.k_scale_strides = is_int4(config_) ? detail::RowStrides{inner * hkv, 1, inner} : detail::RowStrides{inner * hkv, hkv, 1};
  }
  if (!v_scale_.empty()) {
    s.v_scale = v_scale_.data();
    s.v_scale_strides = {inner * hkv, hkv, 1};
  }
  if (is_float8(config_.dtype)) {  // one scale per kv head (none before the first append)
    s.k_scale = config_.k_scale.empty() ? nullptr : config_.k_scale.data();
    s.v_scale = config_.v_scale.empty() ? nullptr : config_.v_scale.data();
    s.k_scale_strides = s.v_scale_strides = {0, 0, 1};
  }
  if (is_int4(config_)) {
    const int64_t scales = 2 * detail::ceil_div(dv, kValueGroup);
    s.v_group_scale = scale_ptr(v_group_scale_);
    s.v_group_strides = {inner * hkv * scales, 1, inner * scales};  // value_group_at's order
    s.v_group_stride = inner;
    s.value_group = kValueGroup;
  }
  if (channel_scaled(config_)) {
    s.k_channel_scale = scale_ptr(k_channel_scale_);
    s.k_channel_zero = scale_ptr(k_channel_zero_);
    s.k_channel_strides = {k_channel_shape()[1] * hkv * d, hkv * d, d};
    s.key_group = config_.group_size;
  }
  if (config_.float_window > 0) {
    s.window_k = k_partial_.data();
    s.window_v = v_window_.data();
    s.window_rows = window_rows_;
    s.quantized_lengths = quantized_.data();
  }
  if (config_.paged) {
    s.block_table = table_.data();
    s.table_stride = blocks_per_sequence_;
    s.page_size = config_.block_size;
  }
  return s;
}

std::pair<std::vector<float>, std::vector<float>> KVCache::stored(int64_t seq) const {
  if (seq < 0 || seq >= config_.batch)
    detail::Checker("qkv::KVCache::stored").fail("seq: expected 0.." + std::to_string(config_.batch - 1) + ", got " + std::to_string(seq));
  const std::shared_lock lock(*mutex_);
  const detail::KvSource kv = source();
  const reference::SourceKeyValues read{kv};
  const int64_t length = lengths_[static_cast<std::size_t>(seq)], hkv = config_.kv_heads;
  const int64_t d = config_.head_dim, dv = config_.v_dim;
  std::vector<float> k(static_cast<std::size_t>(length * hkv * d)), v(static_cast<std::size_t>(length * hkv * dv));
  for (int64_t j = 0; j < length; ++j)
    for (int64_t h = 0; h < hkv; ++h) {
      for (int64_t c = 0; c < d; ++c)
        k[static_cast<std::size_t>((j * hkv + h) * d + c)] = static_cast<float>(read.key(seq, j, h, c));
      for (int64_t c = 0; c < dv; ++c)
        v[static_cast<std::size_t>((j * hkv + h) * dv + c)] = static_cast<float>(read.value(seq, j, h, c));
    }
  return {std::move(k), std::move(v)};
}

}  // namespace qkv
