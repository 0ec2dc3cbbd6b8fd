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
IndexTopkProblem<float> validate_index_topk_cache(const KvSource& cache, const IndexCacheShape& shape,
                                                  const IndexTopkArgs<float>& args, const AttentionOptions& options);

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

// A running top-k over candidate keys in caller-owned storage of `capacity` slots: a
// min-heap, so the weakest kept candidate is at the root and a new one costs one compare
// unless it beats it (then one sift-down, log k).
class RunningTopK {
 public:
  RunningTopK() = default;
  RunningTopK(uint64_t* slots, int64_t capacity) : heap_(slots), capacity_(capacity) {}

  void offer(uint64_t key) {
    if (count_ < capacity_) {
      int64_t child = count_++;  // sift up
      while (child > 0) {
        const int64_t parent = (child - 1) / 2;
        if (heap_[parent] <= key) break;
        heap_[child] = heap_[parent];
        child = parent;
      }
      heap_[child] = key;
    } else if (capacity_ > 0 && key > heap_[0]) {
      int64_t parent = 0;  // replace the root, sift down
      while (true) {
        int64_t child = 2 * parent + 1;
        if (child >= count_) break;
        if (child + 1 < count_ && heap_[child + 1] < heap_[child]) ++child;
        if (key <= heap_[child]) break;
        heap_[parent] = heap_[child];
        parent = child;
      }
      heap_[parent] = key;
    }
  }

  // Candidates that can no longer enter: every key ≤ this (the full heap's root).
  bool full() const { return count_ == capacity_; }
  uint64_t weakest() const { return heap_[0]; }
  int64_t size() const { return count_; }
  const uint64_t* data() const { return heap_; }

  // The kept indices by descending key into out[0, width), −1 past them; the heap is
  // consumed (sorted in place).
  void write_sorted(int32_t* out, int64_t stride, int64_t width) {
    std::sort(heap_, heap_ + count_, [](uint64_t a, uint64_t b) { return a > b; });
    for (int64_t t = 0; t < width; ++t) out[t * stride] = t < count_ ? candidate_index(heap_[t]) : -1;
    count_ = 0;
  }

 private:
  uint64_t* heap_ = nullptr;
  int64_t capacity_ = 0;
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
