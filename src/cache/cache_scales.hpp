// The scales of a quantized cache, checked the same way for every entry point that reads
// a cache (qkv::decode, qkv::BatchPlan::run): int8 rows' scales, and int8 keys' optional
// channel scales (qkv/decode.hpp says what each holds).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "core/attention_rules.hpp"
#include "qkv/half.hpp"
#include "qkv/tensor.hpp"

namespace qkv::detail {

struct CacheScales {
  View3<const float> k_scale, v_scale;
  View4<const float> k_channel_scale, k_channel_zero;
  int64_t key_group = 0;
};

// Checks `scales` against the caches' shapes (k_shape/v_shape: [B | blocks, capacity |
// block_size, Hkv, d]) for `storage`; appends the views read to `inputs` (for the
// outputs-apart check). first_axis names axis 0 in messages ("batch", "blocks", ...).
void check_cache_scales(const Checker& check, StorageType storage, const CacheScales& scales,
                        const std::array<int64_t, 4>& k_shape, const std::array<int64_t, 4>& v_shape,
                        bool paged, const char* first_axis, std::vector<Described>& inputs);

}  // namespace qkv::detail
