// The reference's reading of key and value elements, as doubles: from the call's K/V
// views (each element exactly static_cast<double>), or from a cache's key/value source
// (core/kv_source.hpp: contiguous or paged, any storage type widened exactly, int8 times
// its row's scale and, for keys scaled per channel, (int8 · channel scale + zero point) ·
// row scale; int4 keys alike, int4 values level · group scale + group zero point; the
// float window's rows as they are — the values the split-K schedule attends over).
#pragma once

#include <cstdint>

#include "core/kv_source.hpp"
#include "qkv/half.hpp"

namespace qkv::reference {

template <class Rows>
struct ViewKeyValues {
  const Rows& rows;
  double key(int64_t b, int64_t j, int64_t h, int64_t c) const {
    return static_cast<double>(rows.k(b, j, h)[c]);
  }
  double value(int64_t b, int64_t j, int64_t h, int64_t c) const {
    return static_cast<double>(rows.v(b, j, h)[c]);
  }
};

struct SourceKeyValues {
  const detail::KvSource& kv;

  double key(int64_t b, int64_t j, int64_t h, int64_t c) const {
    if (j >= kv.quantized_length(b)) return kv.window_key(b, j, h)[c];  // the float window
    if (kv.split_keys() && c >= kv.rope_from)  // the key's second part (latent attention)
      return element(kv.k_rope, kv.k_rope_strides, kv.k_scale, kv.k_scale_strides, b, j, h, c - kv.rope_from);
    const double stored = element(kv.k, kv.k_strides, kv.k_scale, kv.k_scale_strides, b, j, h, c);
    if (!kv.channel_scaled()) return stored;
    // int8 · row scale · channel scale + row scale · zero point
    const detail::ScalePtr zero = kv.channel_zeros(b, j, h);
    const double row_scale = kv.k_scale[kv.offset(kv.k_scale_strides, b, j, h)];
    return stored * static_cast<double>(kv.channel_scales(b, j, h)[c]) +
           (zero != nullptr ? row_scale * static_cast<double>(zero[c]) : 0.0);
  }
  double value(int64_t b, int64_t j, int64_t h, int64_t c) const {
    if (j >= kv.quantized_length(b)) return kv.window_value(b, j, h)[c];
    if (kv.type == StorageType::int4) {  // level · s + z of the channel's group
      const detail::ScalePtr scales = kv.value_group_scales(b, j, h);
      const int64_t group = c / kv.value_group;
      return static_cast<double>(level(kv.v, kv.v_strides, b, j, h, c)) *
                 static_cast<double>(scales[group * kv.v_group_stride]) +
             static_cast<double>(scales[(kv.value_groups() + group) * kv.v_group_stride]);
    }
    return element(kv.v, kv.v_strides, kv.v_scale, kv.v_scale_strides, b, j, h, c);
  }

 private:
  double element(const void* base, const detail::RowStrides& strides, const detail::ScalePtr scales,
                 const detail::RowStrides& scale_strides, int64_t b, int64_t j, int64_t h,
                 int64_t c) const {
    const int64_t at = kv.offset(strides, b, j, h) + c;
    switch (kv.type) {
      case StorageType::float32: return static_cast<const float*>(base)[at];
      case StorageType::bfloat16: return static_cast<float>(static_cast<const bfloat16*>(base)[at]);
      case StorageType::float16: return static_cast<float>(static_cast<const float16*>(base)[at]);
      case StorageType::int8:
        return static_cast<double>(static_cast<const std::int8_t*>(base)[at]) *
               static_cast<double>(scales[kv.offset(scale_strides, b, j, h)]);
      case StorageType::int4:  // keys: level · row scale
        return static_cast<double>(level(base, strides, b, j, h, c)) *
               static_cast<double>(scales[kv.offset(scale_strides, b, j, h)]);
      case StorageType::float8_e4m3fn:
        return static_cast<double>(static_cast<float>(static_cast<const float8_e4m3fn*>(base)[at])) *
               static_cast<double>(scales[kv.offset(scale_strides, b, j, h)]);
      case StorageType::float8_e5m2:
        return static_cast<double>(static_cast<float>(static_cast<const float8_e5m2*>(base)[at])) *
               static_cast<double>(scales[kv.offset(scale_strides, b, j, h)]);
    }
    return 0.0;
  }
  // Level c (0..15) of an int4 row (qkv/half.hpp's uint4x2 layout).
  int level(const void* base, const detail::RowStrides& strides, int64_t b, int64_t j, int64_t h, int64_t c) const {
    const auto count = static_cast<std::size_t>(base == kv.k ? kv.head_dim : kv.v_dim);
    const Int4Position at = int4_position(static_cast<std::size_t>(c), count);
    const std::uint8_t byte = static_cast<const std::uint8_t*>(base)[kv.offset(strides, b, j, h) + static_cast<int64_t>(at.byte)];
    return at.high ? byte >> 4 : byte & 0x0F;
  }
};

}  // namespace qkv::reference
