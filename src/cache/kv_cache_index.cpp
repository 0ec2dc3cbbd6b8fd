// qkv::KVCache::index_topk: the lightning indexer over a cache of index keys, and the
// exact key rows it (and its reference) read.
#include <cstdint>
#include <mutex>
#include <new>
#include <shared_mutex>

#include "core/attention_rules.hpp"
#include "core/index_topk_problem.hpp"
#include "qkv/error.hpp"
#include "qkv/kv_cache.hpp"
#include "reference/key_values.hpp"

namespace qkv {

namespace detail {

// reference::SourceKeyValues in double, rounded once to float: KVCache::stored's own
// formula, compiled with the library's baseline flags as stored() is (no contraction of
// its multiply-adds into fused ones that would round differently).
void cache_key_row(const KvSource& kv, int64_t b, int64_t j, float* out) {
  const reference::SourceKeyValues read{kv};
  for (int64_t c = 0; c < kv.head_dim; ++c) out[c] = static_cast<float>(read.key(b, j, 0, c));
}

}  // namespace detail

void KVCache::index_topk(View4<const float> q, View3<const float> weights, View3<int32_t> indices,
                         const AttentionOptions& options) const {
  // Shared, as attend: never beside an append or reset, whose lengths and rows it reads.
  const std::shared_lock lock(*mutex_);
  const detail::KvSource kv = source();
  const detail::IndexCacheShape shape{config_.batch, config_.kv_heads, config_.head_dim, lengths_};
  const detail::IndexTopkProblem<float> problem =
      detail::validate_index_topk_cache(kv, shape, IndexTopkArgs<float>{q, {}, weights, indices}, options);
  const Backend backend = resolve_backend(options, /*is_double=*/false, /*wants_weights=*/false);
  try {
    if (backend == Backend::cpu) return cpu::index_topk(problem);
    reference::index_topk(problem);
  } catch (const std::bad_alloc&) {
    throw Error("qkv::KVCache::index_topk: out of memory for the running top-k's workspace");
  }
}

}  // namespace qkv
