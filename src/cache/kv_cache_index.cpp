// qkv::KVCache::index_topk: the lightning indexer over a cache of index keys, and the
// exact key rows it (and its reference) read.
#include <cstdint>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <type_traits>

#include "core/attention_rules.hpp"
#include "core/index_topk_problem.hpp"
#include "cpu/dot_products.hpp"
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

namespace {

template <class T>
void cache_index_topk(const detail::KvSource& kv, const detail::IndexCacheShape& shape, View4<const T> q,
                      View3<const float> weights, View3<int32_t> indices, const AttentionOptions& options) {
  detail::IndexTopkProblem<T> problem =
      detail::validate_index_topk_cache(kv, shape, IndexTopkArgs<T>{q, {}, weights, indices}, options);
  const Backend backend = resolve_backend(options, /*is_double=*/false, /*wants_weights=*/false);
  // bf16 queries over plain bf16 rows (no float window: its rows are float32) take the
  // call's bf16 unit (vdpbf16ps or the AMX tiles), as qkv::index_topk's bf16 calls do.
  if constexpr (std::is_same_v<T, bfloat16>) {
    if (backend == Backend::cpu && kv.type == StorageType::bfloat16 && !kv.windowed()) {
      const cpu::Bf16Unit unit = cpu::bf16_unit(options.precision);
      problem.bf16_dots = unit != cpu::Bf16Unit::fp32_fma;
      problem.amx = unit == cpu::Bf16Unit::amx;
    }
  }
  try {
    if (backend == Backend::cpu) return cpu::index_topk(problem);
    reference::index_topk(problem);
  } catch (const std::bad_alloc&) {
    throw Error("qkv::KVCache::index_topk: out of memory for the running top-k's workspace");
  }
}

}  // namespace

void KVCache::index_topk(View4<const float> q, View3<const float> weights, View3<int32_t> indices,
                         const AttentionOptions& options) const {
  // Shared, as attend: never beside an append or reset, whose lengths and rows it reads.
  const std::shared_lock lock(*mutex_);
  cache_index_topk(source(), detail::IndexCacheShape{config_.batch, config_.kv_heads, config_.head_dim, lengths_}, q,
                   weights, indices, options);
}

void KVCache::index_topk(View4<const bfloat16> q, View3<const float> weights, View3<int32_t> indices,
                         const AttentionOptions& options) const {
  const std::shared_lock lock(*mutex_);
  cache_index_topk(source(), detail::IndexCacheShape{config_.batch, config_.kv_heads, config_.head_dim, lengths_}, q,
                   weights, indices, options);
}

}  // namespace qkv
