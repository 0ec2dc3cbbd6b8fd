// The row quantizers of qkv::KVCache (kv_cache.cpp): each rounds one float row once to
// the cache's storage type and returns the row's scales; quantize_rows.cpp says how each
// rounds and what a row holding NaN or ±inf gets.
#pragma once

#include <cstdint>

#include "qkv/half.hpp"

namespace qkv::detail {

// A row of `count` floats into `dst` as `type`: float32, bfloat16 and float16 rounded to
// nearest even; int8 with its scale into scale[0]; int4 values with their groups' scales
// then zero points into scale[0, 2·groups) (float16-exact when `half`).
void store_row(StorageType type, const float* src, int64_t count, void* dst, float* scale, bool half);

// float8 (e4m3fn or e5m2): float8(x / scale), rounded to nearest even, finite values
// beyond the format's range saturated (qkv/float8.hpp).
void store_float8_row(StorageType type, const float* src, int64_t count, float scale, void* dst);

// Keys scaled per channel: against their group's channel scales and zero points, the
// row's own scale (1, or NaN) into *row_scale.
void store_int8_channel_row(const float* src, const float* scale, const float* zero, int64_t count,
                            std::int8_t* out, float* row_scale);
void store_int4_channel_row(const float* src, const float* scale, const float* zero, int64_t count,
                            std::uint8_t* out, float* row_scale);

// The scale and zero point of int4 levels 0..15 for the range [lo, hi].
struct Int4Scale {
  float scale, zero;
};
Int4Scale int4_scale(float lo, float hi, bool half);

}  // namespace qkv::detail
