// What a qkv::KVCacheConfig asks for, as the cache's sources read it (kv_cache.cpp,
// kv_cache_read.cpp).
#pragma once

#include <cstdint>

#include "qkv/half.hpp"
#include "qkv/kv_cache.hpp"

namespace qkv::detail {

inline bool channel_scaled(const KVCacheConfig& c) { return c.key_scales == KeyScales::channel; }
inline bool is_int4(const KVCacheConfig& c) { return c.dtype == StorageType::int4; }
inline bool half_scales(const KVCacheConfig& c) { return c.scale_dtype == StorageType::float16; }
// Float rows kept per sequence: the newest group's keys, and the window's K and V.
inline int64_t window_rows(const KVCacheConfig& c) { return channel_scaled(c) ? c.group_size + c.float_window.value_or(0) : 0; }

}  // namespace qkv::detail
