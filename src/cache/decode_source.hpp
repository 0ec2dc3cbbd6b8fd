// qkv::KVCache's attend over a key/value source that DecodeArgs cannot describe (int4
// storage, a float window for the newest tokens): the queries, outputs and options are
// validated as qkv::decode validates them (same messages); the source is the cache's own,
// built by it, and trusted.
#pragma once

#include <cstdint>
#include <span>

#include "core/kv_source.hpp"
#include "qkv/options.hpp"
#include "qkv/tensor.hpp"

namespace qkv::detail {

void decode_cache_source(const KvSource& kv, int64_t capacity, std::span<const int64_t> cache_lengths,
                         View4<const float> q, View4<float> out, View3<float> lse, const AttentionOptions& options);

}  // namespace qkv::detail
