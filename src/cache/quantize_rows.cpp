// The row quantizers of qkv::KVCache (quantize_rows.hpp): one float row rounded once to
// the cache's storage type, with its scales.
#include "cache/quantize_rows.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "core/checked_size.hpp"
#include "qkv/half.hpp"
#include "qkv/kv_cache.hpp"

namespace qkv::detail {
namespace {

template <class T>
void store_row(const float* src, int64_t count, void* dst) {
  T* out = static_cast<T*>(dst);
  for (int64_t c = 0; c < count; ++c) {
    if constexpr (std::is_same_v<T, float>) {
      out[c] = src[c];
    } else {
      out[c] = T(src[c]);  // round to nearest even, once
    }
  }
}

// int8: symmetric per-row quantization. scale = max|x| / 127 and q = x / scale rounded
// to nearest (ties to even), so every value is within scale/2 of q·scale and the row's
// largest magnitude is exactly ±127·scale. An all-zero row (or one below 127 × the
// smallest float, whose scale would round to 0) gets scale 0; a row holding
// NaN or ±inf gets scale NaN, so that whatever attends to it sees NaN, as with the
// other storage types.
void store_int8_row(const float* src, int64_t count, void* dst, float* scale) {
  auto* out = static_cast<std::int8_t*>(dst);
  float largest = 0.0f;
  bool finite = true;
  for (int64_t c = 0; c < count; ++c) {
    finite = finite && std::isfinite(src[c]);
    largest = std::max(largest, std::abs(src[c]));
  }
  // A row whose largest magnitude is below 127 × the smallest float has no representable
  // scale (it would round to 0): stored as zeros, like an all-zero row.
  const float row_scale = largest / 127.0f;
  if (!finite || row_scale == 0.0f) {
    *scale = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
    std::fill(out, out + count, std::int8_t{0});
    return;
  }
  *scale = row_scale;
  for (int64_t c = 0; c < count; ++c) {
    const float q = std::nearbyint(src[c] / *scale);
    out[c] = static_cast<std::int8_t>(std::clamp(q, -127.0f, 127.0f));
  }
}

// int4 levels of one value against (scale, lo): round((x − lo) / scale) (ties to even; in
// double) clamped to 0..15, so x is within half a step of level · scale + lo; 0 for a
// scale of 0 (the range held one value: lo itself).
std::uint8_t int4_level(float x, float scale, float lo) {
  if (scale == 0.0f) return 0;
  const double q = std::nearbyint((static_cast<double>(x) - lo) / static_cast<double>(scale));
  return static_cast<std::uint8_t>(std::clamp(q, 0.0, 15.0));
}

// Writes level `level` of channel c of a row of `count` into its nibble (qkv/half.hpp's
// uint4x2 layout); the row's bytes start zeroed.
void put_int4(std::uint8_t* row, std::size_t c, std::size_t count, std::uint8_t level) {
  const Int4Position at = int4_position(c, count);
  row[at.byte] = static_cast<std::uint8_t>(row[at.byte] | (at.high ? level << 4 : level));
}

// int4 values: per group of kValueGroup channels, the row's range [lo, hi] in that group
// mapped onto the 16 levels (int4_scale: scale (hi − lo) / 15, zero point lo, float32 or
// float16 as `half` says). `scales` gets the groups' scales then their zero points. A row
// holding NaN or ±inf: levels 0, scales NaN (whatever attends to it sees NaN), zero
// points 0.
void store_int4_value_row(const float* src, int64_t count, std::uint8_t* out, float* scales, bool half) {
  const int64_t groups = detail::ceil_div(count, kValueGroup);
  const bool finite = std::all_of(src, src + count, [](float x) { return std::isfinite(x); });
  const auto n = static_cast<std::size_t>(count);
  std::fill(out, out + (n + 1) / 2, std::uint8_t{0});
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t from = g * kValueGroup, to = std::min(count, from + kValueGroup);
    if (!finite) {
      scales[g] = std::numeric_limits<float>::quiet_NaN();
      scales[groups + g] = 0.0f;
      continue;
    }
    const auto [lo, hi] = std::minmax_element(src + from, src + to);
    const Int4Scale fit = int4_scale(*lo, *hi, half);
    scales[g] = fit.scale;
    scales[groups + g] = fit.zero;
    for (int64_t c = from; c < to; ++c)
      put_int4(out, static_cast<std::size_t>(c), n, int4_level(src[c], fit.scale, fit.zero));
  }
}

}  // namespace

// int8 keys scaled per channel: `scale` and `zero` hold the row's group's channel scales
// and zero points; the stored key is int8 · scale + zero, q_c = (x_c − zero_c) / scale_c
// rounded to nearest (ties to even; in double) and clamped to −128..127 — within half a
// step, scale_c, of x_c; a channel with scale 0 (one value in the whole group) is stored
// as zero points alone. The row's own scale is 1, or NaN for a row holding NaN or ±inf
// (stored as zeros), so that whatever attends to it sees NaN.
void store_int8_channel_row(const float* src, const float* scale, const float* zero, int64_t count,
                            std::int8_t* out, float* row_scale) {
  const bool finite = std::all_of(src, src + count, [](float x) { return std::isfinite(x); });
  *row_scale = finite ? 1.0f : std::numeric_limits<float>::quiet_NaN();
  for (int64_t c = 0; c < count; ++c) {
    if (!finite || scale[c] == 0.0f) {
      out[c] = 0;
      continue;
    }
    const double q = std::nearbyint((static_cast<double>(src[c]) - zero[c]) / static_cast<double>(scale[c]));
    out[c] = static_cast<std::int8_t>(std::clamp(q, -128.0, 127.0));
  }
}

// The scale and zero point of int4 levels 0..15 for the range [lo, hi]: float32 scales
// hi/15 − lo/15 and lo; float16 ones the zero point rounded down and the scale rounded
// up (from the rounded zero point), so that z + 15·s ≥ hi still and every value of the
// range is within half a step of a level. Ranges within ±65504 (append checks) keep
// both finite.
Int4Scale int4_scale(float lo, float hi, bool half) {
  if (!half) return {hi / 15.0f - lo / 15.0f, lo};  // hi − lo itself overflows for ranges past ±1.7e38
  float16 zero(lo);
  if (static_cast<float>(zero) > lo) zero = float16::from_bits(half_detail::next_float16_down(zero.bits));
  const double step = (static_cast<double>(hi) - static_cast<float>(zero)) / 15.0;
  float16 scale(static_cast<float>(step));
  if (static_cast<double>(static_cast<float>(scale)) < step) scale = float16::from_bits(half_detail::next_float16_up(scale.bits));
  return {static_cast<float>(scale), static_cast<float>(zero)};
}

// int4 keys scaled per channel (as store_int8_channel_row, levels 0..15, zero point lo).
void store_int4_channel_row(const float* src, const float* scale, const float* zero, int64_t count,
                            std::uint8_t* out, float* row_scale) {
  const bool finite = std::all_of(src, src + count, [](float x) { return std::isfinite(x); });
  *row_scale = finite ? 1.0f : std::numeric_limits<float>::quiet_NaN();
  const auto n = static_cast<std::size_t>(count);
  std::fill(out, out + (n + 1) / 2, std::uint8_t{0});
  if (finite)
    for (std::size_t c = 0; c < n; ++c) put_int4(out, c, n, int4_level(src[c], scale[c], zero[c]));
}

void store_float8_row(StorageType type, const float* src, int64_t count, float scale, void* dst) {
  auto* out = static_cast<std::uint8_t*>(dst);
  for (int64_t c = 0; c < count; ++c) {
    const float x = src[c] / scale;
    out[c] = type == StorageType::float8_e5m2 ? float8_e5m2(x).bits : float8_e4m3fn(x).bits;
  }
}

void store_row(StorageType type, const float* src, int64_t count, void* dst, float* scale, bool half) {
  switch (type) {
    case StorageType::float32: return store_row<float>(src, count, dst);
    case StorageType::bfloat16: return store_row<bfloat16>(src, count, dst);
    case StorageType::float16: return store_row<float16>(src, count, dst);
    case StorageType::int8: return store_int8_row(src, count, dst, scale);
    case StorageType::int4: return store_int4_value_row(src, count, static_cast<std::uint8_t*>(dst), scale, half);
    case StorageType::float8_e4m3fn:
    case StorageType::float8_e5m2: return store_float8_row(type, src, count, *scale, dst);
  }
}

}  // namespace qkv::detail
