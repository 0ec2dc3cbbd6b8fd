// What qkv::BatchPlan::run over a qkv::KVCache needs of the cache: its rows as the kernels
// read them (the key/value source, int4 and the float window included), under its lock.
#pragma once

#include <shared_mutex>

#include "core/kv_source.hpp"
#include "qkv/kv_cache.hpp"

namespace qkv::detail {

struct CacheReader {
  // Held while the rows are read: appends and resets wait (as for KVCache::attend).
  static std::shared_lock<std::shared_mutex> lock(const KVCache& cache) { return std::shared_lock(*cache.mutex_); }
  static KvSource source(const KVCache& cache) { return cache.source(); }
};

}  // namespace qkv::detail
