// The indexer's CPU path (qkv/index_topk.hpp): scores streamed over key blocks, a running
// top-k per query row, never the Nq × Nk scores.
//
// Work item: one batch entry, a block of up to kQueryBlock query rows and a range of keys.
// (bfloat16 q and k on a bf16 unit: the keys read in place, S of each row's heads by the
// unit's ScoresTransposed — vdpbf16ps, or the AMX tiles — instead of the float product.)
// For each block of kKeyBlock keys (copied as float into scratch: widened from 16-bit
// storage, or read from a qkv::KVCache, each row as KVCache::stored gives it) and each row i
// of the item, one block product gives the row's head logits for those keys, keys as rows
// and heads as columns:
//
//   S[m, h] = k[j0 + m, :] · q[i, h, :]            (gemm-inl.h: the K block, Qᵀ packed)
//   score(i, j0 + m) = Σ_h w[i, h] · relu(scale · S[m, h])
//
// The head sum runs across vector lanes (heads padded to whole vectors with zero weights),
// then once across the lanes (SumOfLanes). Each score is offered to the row's RunningTopK, a
// buffer of candidates above a threshold that rejects most keys with one integer compare.
//
// Memory: the packed Qᵀ of a block (kQueryBlock·di·Hi floats), one key block as float, S for one key block (kKeyBlock·Hi floats) and kQueryBlock·2·topk candidate slots,
// per thread; plus, when keys are split for parallelism (a few rows against many keys,
// decode), each split's candidates until they are merged: O(threads·topk).
//
// Determinism: a score depends on (b, i, j) and the inputs only (same operations in the
// same order whatever the block, split or thread), and the top-k of distinct candidate keys
// (score rank, index) is one set, written sorted: bitwise the same for any thread count.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/index_topk.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/highway.h"
#include "cpu/block_ops-inl.h"
#include "cpu/gemm-inl.h"
#include "cpu/storage-inl.h"

#ifndef QKV_CPU_INDEX_TOPK_ONCE_
#define QKV_CPU_INDEX_TOPK_ONCE_
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/index_topk_problem.hpp"
#include "cpu/amx_dot.hpp"
#include "cpu/bf16_dot.hpp"
#include "cpu/simd_target.hpp"

namespace qkv::cpu::index_topk_plan {

// Query rows per work item: they share each key block (read from memory once for all of
// them) and each item's packing of Qᵀ.
inline constexpr int64_t kQueryBlock = 8;
// Keys per block product: K block (128·di floats) and S (128·Hi floats) stay in L2.
inline constexpr int64_t kKeyBlock = 128;
// Keys are split across items only when there are fewer row blocks than 2 per thread, and
// never into pieces under this many key blocks (a split's candidates cost a merge).
inline constexpr int64_t kMinSplitBlocks = 8;

struct Item {
  int64_t batch, first_row, row_end;  // query rows [first_row, row_end)
  int64_t first_key, key_end;         // keys [first_key, key_end) (before causality)
  int64_t cost;                       // keys the item's rows may see, for the order
};

struct Plan {
  std::vector<Item> items;   // (entry, row block, split) in that order
  std::vector<int64_t> order;  // items by descending cost: the heaviest first
  int64_t splits = 1;          // key splits per row block
  int64_t capacity = 0;        // candidates kept per row: min(topk, Nk)
};

template <class T>
Plan make_plan(const detail::IndexTopkProblem<T>& p) {
  Plan plan;
  plan.capacity = std::min(p.topk, p.k_len);
  const int64_t row_blocks = (p.q_len + kQueryBlock - 1) / kQueryBlock;
  const int64_t units = p.batch * row_blocks;
  const int64_t key_blocks = (p.k_len + kKeyBlock - 1) / kKeyBlock;
  if (units > 0 && units < 2 * p.threads) {
    const int64_t wanted = (2 * p.threads + units - 1) / units;
    plan.splits = std::clamp<int64_t>(wanted, 1, std::max<int64_t>(1, key_blocks / kMinSplitBlocks));
  }
  const int64_t split_keys = (key_blocks + plan.splits - 1) / plan.splits * kKeyBlock;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t block = 0; block < row_blocks; ++block)
      for (int64_t split = 0; split < plan.splits; ++split) {
        Item item;
        item.batch = b;
        item.first_row = block * kQueryBlock;
        item.row_end = std::min(p.q_len, item.first_row + kQueryBlock);
        item.first_key = std::min(p.k_len, split * split_keys);
        item.key_end = std::min(p.k_len, item.first_key + split_keys);
        item.cost = 0;
        for (int64_t i = item.first_row; i < item.row_end; ++i)
          item.cost += std::max<int64_t>(0, std::min(item.key_end, p.mask.key_end(b, i)) - item.first_key);
        plan.items.push_back(item);
      }
  plan.order.resize(plan.items.size());
  for (std::size_t t = 0; t < plan.order.size(); ++t) plan.order[t] = static_cast<int64_t>(t);
  std::stable_sort(plan.order.begin(), plan.order.end(),
                   [&](int64_t x, int64_t y) { return plan.items[x].cost > plan.items[y].cost; });
  return plan;
}

}  // namespace qkv::cpu::index_topk_plan
#endif  // QKV_CPU_INDEX_TOPK_ONCE_

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {
namespace {

using index_topk_plan::kKeyBlock;
using index_topk_plan::kQueryBlock;

// Per-thread workspace, allocated before the parallel region (an allocation failure is
// then an Error on the caller's thread, not a terminate inside OpenMP).
struct IndexScratch {
  hwy::AlignedFreeUniquePtr<float[]> queries_t;  // [kQueryBlock][di][heads_pad]: Qᵀ per row
  hwy::AlignedFreeUniquePtr<float[]> weights;    // [kQueryBlock][heads_pad], zero past Hi
  hwy::AlignedFreeUniquePtr<float[]> keys;       // [kKeyBlock][di]: the key block as float
  hwy::AlignedFreeUniquePtr<float[]> logits;     // S: [kKeyBlock][heads_pad]
  std::vector<uint64_t> candidates;              // [kQueryBlock][slots(capacity)] when keys are not split
  // bf16_dots: each row's heads as bf16 pairs, [kQueryBlock][⌈di/2⌉][q_ld] (instead of Qᵀ and keys)
  std::vector<uint32_t> query_pairs;
  size_t q_ld = 0;

  IndexScratch(size_t head_dim, size_t heads_pad, int64_t capacity, bool own_candidates, bool bf16_dots)
      : queries_t(AllocateFloats(bf16_dots ? 0 : kQueryBlock * head_dim * heads_pad)),
        weights(AllocateFloats(kQueryBlock * heads_pad)),
        keys(AllocateFloats(bf16_dots ? 0 : kKeyBlock * head_dim)),
        logits(AllocateFloats(kKeyBlock * heads_pad)),
        candidates(own_candidates ? static_cast<size_t>(kQueryBlock * detail::RunningTopK::slots(capacity)) : 0),
        q_ld(bf16dot::pair_ld(heads_pad)) {
    if (bf16_dots) query_pairs.assign(kQueryBlock * (head_dim + 1) / 2 * q_ld, 0u);
  }
};

// score(i, j0 + m) for m < count from S (row m: the heads of key j0 + m), offered to `row`.
HWY_INLINE void OfferScores(const float* HWY_RESTRICT logits, size_t heads_pad, const float* HWY_RESTRICT weights,
                            float scale, int64_t first_key, int64_t count, detail::RunningTopK& row) {
  const FloatTag d;
  const size_t lanes = hn::Lanes(d);
  const auto zero = hn::Zero(d), scale_v = hn::Set(d, scale);
  for (int64_t m = 0; m < count; ++m) {
    const float* s = logits + static_cast<size_t>(m) * heads_pad;
    auto sum = zero;
    for (size_t h = 0; h < heads_pad; h += lanes) {
      const auto scaled = hn::Mul(hn::Load(d, s + h), scale_v);
      // relu that keeps NaN: zero where scaled < 0 (false for NaN).
      const auto relu = hn::IfThenZeroElse(hn::Lt(scaled, zero), scaled);
      sum = hn::MulAdd(hn::Load(d, weights + h), relu, sum);
    }
    const uint64_t key = detail::candidate_key(hn::GetLane(hn::SumOfLanes(d, sum)), first_key + m);
    if (row.admits(key)) row.offer(key);
  }
}

// row[c] = float(in[c]) · scale for c < d (int8 and float8 rows).
template <class T>
HWY_INLINE void ScaledRow(const T* HWY_RESTRICT in, float scale, size_t d, float* HWY_RESTRICT row) {
  const FloatTag df;
  const size_t lanes = hn::Lanes(df);
  const auto scale_v = hn::Set(df, scale);
  size_t c = 0;
  for (; c + lanes <= d; c += lanes) hn::StoreU(hn::Mul(LoadWidened(df, in + c), scale_v), df, row + c);
  for (; c < d; ++c) row[c] = static_cast<float>(in[c]) * scale;
}

// Keys [j0, j0 + count) of sequence b of a cache (kv head 0) into out [count][d] as float,
// each row exactly as KVCache::stored gives it: float copied, bfloat16/float16 widened,
// int8 and float8 with a row scale times it (the product of an int8 or a float8 and a
// float is exact in double, so float's rounded product is stored()'s); every other row (channel-scaled or int4
// keys, the float window) through detail::cache_key_row, stored()'s own arithmetic.
HWY_INLINE void LoadCacheKeys(const detail::KvSource& kv, int64_t b, int64_t j0, int64_t count, size_t d,
                              float* HWY_RESTRICT out) {
  const bool plain = !kv.channel_scaled() && kv.type != StorageType::int4;
  const int64_t quantized = kv.quantized_length(b);
  for (int64_t m = 0; m < count; ++m) {
    const int64_t j = j0 + m;
    float* row = out + static_cast<size_t>(m) * d;
    if (!plain || j >= quantized) {
      detail::cache_key_row(kv, b, j, row);
      continue;
    }
    const int64_t at = kv.offset(kv.k_strides, b, j, 0);
    switch (kv.type) {
      case StorageType::float32:
        WidenRows(static_cast<const float*>(kv.k) + at, 0, 1, d, row, d);
        break;
      case StorageType::bfloat16:
        WidenRows(static_cast<const bfloat16*>(kv.k) + at, 0, 1, d, row, d);
        break;
      case StorageType::float16:
        WidenRows(static_cast<const float16*>(kv.k) + at, 0, 1, d, row, d);
        break;
      case StorageType::int8:
        ScaledRow(static_cast<const std::int8_t*>(kv.k) + at, kv.k_scale[kv.offset(kv.k_scale_strides, b, j, 0)], d, row);
        break;
      case StorageType::float8_e4m3fn:
        ScaledRow(static_cast<const float8_e4m3fn*>(kv.k) + at, kv.k_scale[kv.offset(kv.k_scale_strides, b, j, 0)], d, row);
        break;
      case StorageType::float8_e5m2:
        ScaledRow(static_cast<const float8_e5m2*>(kv.k) + at, kv.k_scale[kv.offset(kv.k_scale_strides, b, j, 0)], d, row);
        break;
      case StorageType::int4:
        break;  // not plain: above
    }
  }
}

template <class T>
void RunItem(const detail::IndexTopkProblem<T>& p, const index_topk_plan::Item& item, size_t heads_pad,
             IndexScratch& scratch, uint64_t* candidates, int64_t* counts, int64_t capacity, bool write_out) {
  const auto& a = p.args;
  const size_t d = static_cast<size_t>(p.head_dim), heads = static_cast<size_t>(p.heads);
  const int64_t rows = item.row_end - item.first_row;
  int64_t row_end_key[kQueryBlock];
  int64_t last_key = item.first_key;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = item.first_row + r;
    row_end_key[r] = std::min(item.key_end, p.mask.key_end(item.batch, i));
    last_key = std::max(last_key, row_end_key[r]);
    float* w = scratch.weights.get() + static_cast<size_t>(r) * heads_pad;
    for (size_t h = 0; h < heads_pad; ++h) w[h] = h < heads ? a.weights(item.batch, i, h) : 0.0f;
    if (p.bf16_dots) {
      if constexpr (std::is_same_v<T, bfloat16>)  // the heads' pairs (zero columns past Hi)
        bf16dot::PackQueryPairs(&a.q(item.batch, i, 0, 0), a.q.strides[2], heads, d,
                                scratch.query_pairs.data() + static_cast<size_t>(r) * (d + 1) / 2 * scratch.q_ld,
                                scratch.q_ld);
      continue;
    }
    // Qᵀ of row i: column h is head h's query (zero columns past Hi).
    float* q_t = scratch.queries_t.get() + static_cast<size_t>(r) * d * heads_pad;
    for (size_t h = 0; h < heads_pad; ++h) {
      const T* q_row = h < heads ? &a.q(item.batch, i, h, 0) : nullptr;
      for (size_t c = 0; c < d; ++c) q_t[c * heads_pad + h] = h < heads ? Widen(q_row[c]) : 0.0f;
    }
  }
  detail::RunningTopK best[kQueryBlock];
  const int64_t slots = detail::RunningTopK::slots(capacity);
  for (int64_t r = 0; r < rows; ++r) best[r] = detail::RunningTopK(candidates + r * slots, capacity);

  const float scale = static_cast<float>(p.scale);
  const int64_t key_stride = a.k.strides[1];
  for (int64_t j0 = item.first_key; j0 < last_key; j0 += kKeyBlock) {
    const int64_t block_keys = std::min(kKeyBlock, last_key - j0);
    if (p.bf16_dots) {  // bfloat16 keys read in place, the head logits on the unit
      if constexpr (std::is_same_v<T, bfloat16>) {
        const amx::TileScope tile_scope(p.amx);  // one configuration for the block's rows
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t count = std::min(block_keys, row_end_key[r] - j0);
          if (count <= 0) continue;
          const uint32_t* pairs = scratch.query_pairs.data() + static_cast<size_t>(r) * (d + 1) / 2 * scratch.q_ld;
          // Every column up to heads_pad: the zero query columns give 0 there, which the
          // zero weights then keep out of the sum (garbage there could be NaN). A cache's
          // rows one run of evenly strided rows (a page) at a time.
          for (int64_t m = 0; m < count;) {
            const int64_t j = j0 + m;
            int64_t run = count - m;
            const bfloat16* rows_at = nullptr;
            int64_t row_stride = key_stride;
            if (p.cache != nullptr) {
              run = std::min(run, p.cache->run_end(j) - j);
              rows_at = static_cast<const bfloat16*>(p.cache->k) + p.cache->offset(p.cache->k_strides, item.batch, j, 0);
              row_stride = p.cache->k_strides.row;
            } else {
              rows_at = &a.k(item.batch, j, 0);
            }
            (p.amx ? amx::ScoresTransposed : bf16dot::ScoresTransposed)(
                rows_at, row_stride, static_cast<size_t>(run), d, pairs, scratch.q_ld, heads_pad, 1.0f,
                scratch.logits.get() + static_cast<size_t>(m) * heads_pad, heads_pad);
            m += run;
          }
          OfferScores(scratch.logits.get(), heads_pad, scratch.weights.get() + static_cast<size_t>(r) * heads_pad,
                      scale, j0, count, best[r]);
        }
      }
      continue;
    }
    // The block is copied (widened) into scratch even for float keys: the product then
    // broadcasts from a block the copy just streamed into cache, which measured ~10–15%
    // faster for one decode row than broadcasting from the keys in place (the first of
    // the block's column panels otherwise waits on memory with six strided streams).
    if (p.cache != nullptr) {
      LoadCacheKeys(*p.cache, item.batch, j0, block_keys, d, scratch.keys.get());
    } else {
      WidenRows(&a.k(item.batch, j0, 0), key_stride, static_cast<size_t>(block_keys), d, scratch.keys.get(), d);
    }
    const StridedA keys{scratch.keys.get(), d, 1};
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t count = std::min(block_keys, row_end_key[r] - j0);
      if (count <= 0) continue;
      Gemm(static_cast<size_t>(count), heads_pad, d, keys,
           scratch.queries_t.get() + static_cast<size_t>(r) * d * heads_pad, heads_pad, scratch.logits.get(),
           heads_pad, /*accumulate=*/false);
      OfferScores(scratch.logits.get(), heads_pad, scratch.weights.get() + static_cast<size_t>(r) * heads_pad,
                  scale, j0, count, best[r]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (write_out) {
      best[r].write_sorted(&a.indices(item.batch, item.first_row + r, 0), a.indices.strides[2], p.topk);
    } else {
      best[r].finish();  // the best `capacity` first: what the merge reads
      counts[r] = best[r].size();
    }
  }
}

// Row (b, i)'s candidates from every key split of its block, merged into one top-k.
template <class T>
void MergeRow(const detail::IndexTopkProblem<T>& p, const index_topk_plan::Plan& plan, int64_t b, int64_t i,
              const uint64_t* split_candidates, const int64_t* split_counts, uint64_t* merged) {
  const int64_t capacity = plan.capacity, row_blocks = (p.q_len + kQueryBlock - 1) / kQueryBlock;
  const int64_t block = i / kQueryBlock, r = i % kQueryBlock;
  detail::RunningTopK row(merged, capacity);
  for (int64_t split = 0; split < plan.splits; ++split) {
    const int64_t item = (b * row_blocks + block) * plan.splits + split;
    const int64_t slot = item * kQueryBlock + r;
    const uint64_t* keys = split_candidates + slot * detail::RunningTopK::slots(capacity);
    for (int64_t t = 0; t < split_counts[slot]; ++t) row.offer(keys[t]);
  }
  row.write_sorted(&p.args.indices(b, i, 0), p.args.indices.strides[2], p.topk);
}

template <class T>
void IndexTopkImpl(const detail::IndexTopkProblem<T>& p) {
  const auto& a = p.args;
  if (p.batch == 0 || p.q_len == 0 || p.topk == 0) return;
  if (p.k_len == 0) {  // no key at all: every row is −1
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t i = 0; i < p.q_len; ++i)
        for (int64_t t = 0; t < p.topk; ++t) a.indices(b, i, t) = -1;
    return;
  }
  const index_topk_plan::Plan plan = index_topk_plan::make_plan(p);
  const size_t lanes = VectorLanes();
  const size_t heads_pad = (static_cast<size_t>(p.heads) + lanes - 1) / lanes * lanes;
  const bool split = plan.splits > 1;
  const int64_t capacity = plan.capacity;
  const int threads = static_cast<int>(std::min<int64_t>(p.threads, static_cast<int64_t>(plan.items.size())));
  std::vector<IndexScratch> scratch;
  scratch.reserve(static_cast<size_t>(threads));
  for (int t = 0; t < threads; ++t)
    scratch.emplace_back(static_cast<size_t>(p.head_dim), heads_pad, capacity, !split, p.bf16_dots);
  // Split keys: each item's candidates live until the merge.
  const int64_t slots = detail::RunningTopK::slots(capacity);
  std::vector<uint64_t> split_candidates(split ? plan.items.size() * kQueryBlock * static_cast<size_t>(slots) : 0);
  std::vector<int64_t> split_counts(split ? plan.items.size() * kQueryBlock : 0);
  std::vector<std::vector<uint64_t>> merged(split ? static_cast<size_t>(threads) : 0);
  for (auto& m : merged) m.resize(static_cast<size_t>(slots));

  auto run_item = [&](int64_t t, int thread) {
    const auto& item = plan.items[static_cast<size_t>(t)];
    if (split) {
      RunItem(p, item, heads_pad, scratch[thread], split_candidates.data() + t * kQueryBlock * slots,
              split_counts.data() + t * kQueryBlock, capacity, false);
    } else {
      RunItem(p, item, heads_pad, scratch[thread], scratch[thread].candidates.data(), nullptr, capacity, true);
    }
  };
  const int64_t rows = p.batch * p.q_len;
  if (threads <= 1) {
    for (int64_t t : plan.order) run_item(t, 0);
    if (split)
      for (int64_t row = 0; row < rows; ++row)
        MergeRow(p, plan, row / p.q_len, row % p.q_len, split_candidates.data(), split_counts.data(), merged[0].data());
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int thread = omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
    for (size_t o = 0; o < plan.order.size(); ++o) run_item(plan.order[o], thread);
    if (split) {
#pragma omp for schedule(static)
      for (int64_t row = 0; row < rows; ++row)
        MergeRow(p, plan, row / p.q_len, row % p.q_len, split_candidates.data(), split_counts.data(),
                 merged[static_cast<size_t>(thread)].data());
    }
  }
}

}  // namespace

void IndexTopkFloat32(const detail::IndexTopkProblem<float>& p) { IndexTopkImpl(p); }
void IndexTopkBfloat16(const detail::IndexTopkProblem<bfloat16>& p) { IndexTopkImpl(p); }
void IndexTopkFloat16(const detail::IndexTopkProblem<float16>& p) { IndexTopkImpl(p); }

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::cpu {
HWY_EXPORT(IndexTopkFloat32);
HWY_EXPORT(IndexTopkBfloat16);
HWY_EXPORT(IndexTopkFloat16);

void index_topk(const detail::IndexTopkProblem<float>& problem) {
  apply_simd_target_override();
  HWY_DYNAMIC_DISPATCH(IndexTopkFloat32)(problem);
}
void index_topk(const detail::IndexTopkProblem<bfloat16>& problem) {
  apply_simd_target_override();
  HWY_DYNAMIC_DISPATCH(IndexTopkBfloat16)(problem);
}
void index_topk(const detail::IndexTopkProblem<float16>& problem) {
  apply_simd_target_override();
  HWY_DYNAMIC_DISPATCH(IndexTopkFloat16)(problem);
}
}  // namespace qkv::cpu
#endif
