// The parallel work of the CPU kernels as lists of independent tasks, heaviest first.
// Threads take tasks dynamically; since every task writes its own output block and
// computes it the same way on any thread, the order affects only speed, never bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

#include "core/problem.hpp"
#include "cpu/blocking.hpp"

namespace qkv::cpu {

// One block of kBlockQueries queries of one (batch, query head).
struct ForwardTask {
  int64_t batch = 0;
  int64_t head = 0;
  int64_t first_query = 0;
  int64_t cost = 0;  // keys the block may visit
};

// One block of kBlockKeys keys of one (batch, key/value head), for dK and dV.
struct KeyTask {
  int64_t batch = 0;
  int64_t kv_head = 0;
  int64_t first_key = 0;
  int64_t cost = 0;  // query rows (over the head group) that may see the block
};

// Keys visible to the last query of the block: with causality or padding the visible
// prefix grows with the query index, so this bounds the block's work.
inline int64_t query_block_cost(const detail::MaskRule& mask, int64_t batch, int64_t first,
                                int64_t q_len) {
  const int64_t last = std::min(first + kBlockQueries, q_len) - 1;
  return mask.key_end(batch, last);  // monotone in the query index for every causal mode
}

inline std::vector<ForwardTask> forward_tasks(const detail::Extents& e,
                                              const detail::MaskRule& mask) {
  std::vector<ForwardTask> tasks;
  for (int64_t b = 0; b < e.batch; ++b)
    for (int64_t h = 0; h < e.q_heads; ++h)
      for (int64_t first = 0; first < e.q_len; first += kBlockQueries)
        tasks.push_back({b, h, first, query_block_cost(mask, b, first, e.q_len)});
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const ForwardTask& x, const ForwardTask& y) { return x.cost > y.cost; });
  return tasks;
}

// First query whose visible prefix reaches past `key` (the prefix is monotone in the
// query index), i.e. the queries [result, Nq) may see key `key`.
inline int64_t first_query_seeing(const detail::MaskRule& mask, int64_t batch, int64_t key,
                                  int64_t q_len) {
  int64_t lo = 0, hi = q_len;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (mask.key_end(batch, mid) > key) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

// Threads worth starting: no more than the tasks, and each with at least
// kMinFlopsPerThread of work — below that, waking and joining a thread (microseconds,
// far more on a busy machine) costs more than it saves. The choice changes speed only:
// results are the same for any thread count.
inline constexpr double kMinFlopsPerThread = 4e6;

inline int threads_for(int requested, std::size_t tasks, double flops) {
  const double by_work = std::max(1.0, flops / kMinFlopsPerThread);
  return static_cast<int>(std::min({static_cast<double>(requested), static_cast<double>(tasks), by_work}));
}

// Multiply-add flops of the score and value products of a list of query-block tasks.
inline double forward_flops(const std::vector<ForwardTask>& tasks, const detail::Extents& e) {
  double keys = 0.0;
  for (const ForwardTask& task : tasks) keys += static_cast<double>(task.cost);
  return 2.0 * static_cast<double>(kBlockQueries) * keys *
         static_cast<double>(e.head_dim + e.v_dim);
}

// The backward's schedule. Single pass: one task per (batch, kv head) walks its key
// blocks in order and adds each block's dS·K to dQ as it goes — 5 block products per
// (key block, query block) pair. Two passes: dK/dV per key block, then dQ per query
// block — 7 products (S and dP computed twice), but parallel even for a single head.
// Single pass whenever there are enough heads to keep every core busy (4 per core
// bounds the idle tail at a quarter of a head's work). Decided by the shape and the
// machine, never by the threads option: results stay identical for any thread count.
inline bool backward_single_pass(const detail::Extents& e) {
  const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  return e.batch * e.kv_heads >= 4 * cores;
}

inline std::vector<KeyTask> key_tasks(const detail::Extents& e, const detail::MaskRule& mask) {
  std::vector<KeyTask> tasks;
  for (int64_t b = 0; b < e.batch; ++b)
    for (int64_t kv = 0; kv < e.kv_heads; ++kv)
      for (int64_t first = 0; first < e.k_len; first += kBlockKeys) {
        const int64_t seeing = e.q_len - first_query_seeing(mask, b, first, e.q_len);
        if (first >= mask.valid_keys(b)) {
          // Padding: nobody reads these keys; the task still writes their zero gradients.
          tasks.push_back({b, kv, first, 0});
          continue;
        }
        tasks.push_back({b, kv, first, seeing * e.group()});
      }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const KeyTask& x, const KeyTask& y) { return x.cost > y.cost; });
  return tasks;
}

}  // namespace qkv::cpu
