// The validated form of one qkv::index_topk call (built only by validate_index_topk.cpp),
// and the ranking both backends share.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>

#include "core/kv_source.hpp"
#include "core/problem.hpp"
#include "qkv/index_topk.hpp"

namespace qkv::detail {

template <class T>
struct IndexTopkProblem {
  IndexTopkArgs<T> args;
  int64_t batch = 0, q_len = 0, k_len = 0, heads = 0, head_dim = 0, topk = 0;
  // Causality and key_lengths only: row i of entry b may pick keys [0, key_end(b, i)).
  MaskRule mask;
  double scale = 1.0;
  int threads = 1;
  // qkv::KVCache::index_topk: the keys are kv head 0 of this cache source (args.k is
  // empty, k_len the capacity, mask.key_lengths the cache lengths), each row read as
  // cache_key_row gives it.
  const KvSource* cache = nullptr;
  // bfloat16 q and k with Precision::fast where the call has a bf16 unit: the head logits
  // as pairs of exact products summed on the unit — vdpbf16ps (cpu/bf16_dot.hpp), or the
  // AMX tiles (`amx`: cpu/amx_dot.hpp) — not float32 FMAs: a different summation order
  // (and subnormals flushed), so other bits; each unit's the same for any thread count.
  bool bf16_dots = false;
  bool amx = false;
};

// Key row j of sequence b of a cache source's kv head 0, as float: exactly the values
// qkv::KVCache::stored returns (computed the same way, in the same baseline-compiled
// code), so the indexer over a cache ranks the same scores as over its stored keys.
void cache_key_row(const KvSource& kv, int64_t b, int64_t j, float* out);

template <class T>
IndexTopkProblem<T> validate_index_topk(const IndexTopkArgs<T>& args, const AttentionOptions& options);

// What KVCache::index_topk knows of its cache besides the key source.
struct IndexCacheShape {
  int64_t batch = 0, kv_heads = 0, head_dim = 0;
  std::span<const int64_t> lengths;  // per sequence
};

// The cache form (KVCache::index_topk): q float, the keys from `cache` (kept alive by the
// caller for the problem's life), the cache lengths as key lengths; messages name
// qkv::KVCache::index_topk.
// T: the queries' type, float or bfloat16 (the weights are float either way).
template <class T>
IndexTopkProblem<T> validate_index_topk_cache(const KvSource& cache, const IndexCacheShape& shape,
                                              const IndexTopkArgs<T>& args, const AttentionOptions& options);

// The rank of a float score as an unsigned integer, so that integer order is the
// indexer's order: numbers ascending (−0 taken as +0), every NaN above +inf (torch.topk's
// order). A float's bits order like sign-magnitude integers: flipping all bits of a
// negative one and the sign bit of a positive one makes them order like unsigned ones.
inline uint32_t score_rank(float score) {
  if (std::isnan(score)) return std::numeric_limits<uint32_t>::max();
  const uint32_t bits = std::bit_cast<uint32_t>(score + 0.0f);  // −0 + 0 = +0
  return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

// One candidate as one integer: the score's rank above, the key index below, stored as
// (2³² − 1 − j) so that of two equal scores the lower index is the larger key. A row's
// top-k is then the k largest keys, a unique set (keys are distinct), whatever the order
// the candidates arrive in. Indices are < 2³¹ (validated).
inline uint64_t candidate_key(float score, int64_t j) {
  return (static_cast<uint64_t>(score_rank(score)) << 32) |
         (0xFFFFFFFFu - static_cast<uint32_t>(j));
}
inline int32_t candidate_index(uint64_t key) {
  return static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(key & 0xFFFFFFFFu));
}

// A running top-k over distinct candidate keys in caller-owned storage of slots(capacity)
// words: candidates above the threshold are appended; when the buffer is full, a
// selection (std::nth_element, linear) keeps the best `capacity` and raises the threshold
// to the weakest of them. A key that fails the threshold costs one compare; one that
// passes, a store (a heap's sift was ~40% of the score-offering loop, ~9% of a 32k-key
// decode call: every level a mispredicted branch). The kept set is the top-k of every key offered, which is
// one set whatever the order of offers or compactions, so results do not depend on it.
class RunningTopK {
 public:
  static constexpr int64_t slots(int64_t capacity) { return 2 * capacity; }

  RunningTopK() = default;
  RunningTopK(uint64_t* storage, int64_t capacity)
      : keys_(storage), capacity_(capacity), threshold_(capacity > 0 ? 0 : UINT64_MAX) {}

  // Whether `key` can still enter (every candidate key is > 0: see candidate_key).
  bool admits(uint64_t key) const { return key > threshold_; }

  void offer(uint64_t key) {
    if (!admits(key)) return;
    keys_[count_++] = key;
    if (count_ == slots(capacity_)) keep_best();
  }

  // At most `capacity` candidates left, the best ones (data()[0, size())), in no order.
  void finish() {
    if (count_ > capacity_) keep_best();
  }
  int64_t size() const { return count_; }
  const uint64_t* data() const { return keys_; }

  // The kept indices by descending key into out[0, width), −1 past them; the buffer is
  // consumed (sorted in place).
  void write_sorted(int32_t* out, int64_t stride, int64_t width) {
    finish();
    std::sort(keys_, keys_ + count_, [](uint64_t a, uint64_t b) { return a > b; });
    for (int64_t t = 0; t < width; ++t) out[t * stride] = t < count_ ? candidate_index(keys_[t]) : -1;
    count_ = 0;
    threshold_ = capacity_ > 0 ? 0 : UINT64_MAX;
  }

 private:
  void keep_best() {
    std::nth_element(keys_, keys_ + (capacity_ - 1), keys_ + count_, [](uint64_t a, uint64_t b) { return a > b; });
    count_ = capacity_;
    threshold_ = keys_[capacity_ - 1];  // the weakest kept: the nth element, all before it larger
  }

  uint64_t* keys_ = nullptr;
  int64_t capacity_ = 0;
  uint64_t threshold_ = UINT64_MAX;
  int64_t count_ = 0;
};

}  // namespace qkv::detail

// The backends (reference/index_topk.cpp, cpu/index_topk.cpp).
namespace qkv::reference {
template <class T>
void index_topk(const detail::IndexTopkProblem<T>& problem);
}  // namespace qkv::reference

namespace qkv::cpu {
void index_topk(const detail::IndexTopkProblem<float>& problem);
void index_topk(const detail::IndexTopkProblem<bfloat16>& problem);
void index_topk(const detail::IndexTopkProblem<float16>& problem);
}  // namespace qkv::cpu
