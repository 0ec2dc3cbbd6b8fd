// The parallel work of the CPU kernels as lists of independent tasks, heaviest first.
// Threads take tasks dynamically; since every task writes its own output block and
// computes it the same way on any thread, the order affects only speed, never bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/attention_rules.hpp"
#include "core/problem.hpp"
#include "core/tile_plan.hpp"
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

// Every query block of every (entry, head), costed by the keys its non-empty tiles hold:
// the plan's skipped tiles cost nothing, so a batch of very different lengths (or masks)
// is split by the work it really has.
inline std::vector<ForwardTask> forward_tasks(const detail::Extents& e, const detail::MaskRule& mask,
                                              const detail::TilePlan& plan) {
  std::vector<ForwardTask> tasks;
  for (int64_t b = 0; b < e.batch; ++b)
    for (int64_t h = 0; h < e.q_heads; ++h)
      for (int64_t first = 0; first < mask.q_len(b); first += kBlockQueries)
        tasks.push_back({b, h, first, plan.busy_key_blocks(b, h, first / kBlockQueries) * kBlockKeys});
  // Heaviest (entry, head) first and, inside it, its heaviest block first — not the
  // heaviest blocks of all heads first: consecutive tasks then read the same K/V head,
  // which stays in L2/L3, instead of cycling through every head's K/V (causal, 1 thread,
  // N = 4096, 8 heads, d = 64: 221 → 184 ms, causal/dense 0.63 → 0.52, by CPU time). The tail is still the
  // lightest blocks, which is what dynamic scheduling needs.
  std::vector<int64_t> head_cost(static_cast<std::size_t>(e.batch * e.q_heads), 0);
  for (const ForwardTask& t : tasks) head_cost[static_cast<std::size_t>(t.batch * e.q_heads + t.head)] += t.cost;
  std::stable_sort(tasks.begin(), tasks.end(), [&](const ForwardTask& x, const ForwardTask& y) {
    const int64_t hx = head_cost[static_cast<std::size_t>(x.batch * e.q_heads + x.head)];
    const int64_t hy = head_cost[static_cast<std::size_t>(y.batch * e.q_heads + y.head)];
    if (hx != hy) return hx > hy;
    if (x.batch != y.batch || x.head != y.head) return x.batch * e.q_heads + x.head < y.batch * e.q_heads + y.head;
    return x.cost > y.cost;
  });
  return tasks;
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
  const int64_t cores = detail::hardware_threads();
  return e.batch * e.kv_heads >= 4 * cores;
}

// Every key block of every (entry, kv head), costed by the query rows (over the head
// group) of its non-empty tiles. Blocks nobody reads still get a task: it writes their
// zero gradients.
inline std::vector<KeyTask> key_tasks(const detail::Extents& e, const detail::MaskRule& mask,
                                      const detail::TilePlan& plan) {
  std::vector<KeyTask> tasks;
  for (int64_t b = 0; b < e.batch; ++b) {
    const int64_t q_blocks = plan.query_blocks(b);
    for (int64_t kv = 0; kv < e.kv_heads; ++kv)
      for (int64_t first = 0; first < mask.sequences.k_len(b); first += kBlockKeys) {
        int64_t cost = 0;
        for (int64_t h = kv * e.group(); h < (kv + 1) * e.group(); ++h)
          for (int64_t qb = 0; qb < q_blocks; ++qb)
            if (plan.at(b, h, qb, first / kBlockKeys) != detail::Tile::empty) cost += kBlockQueries;
        tasks.push_back({b, kv, first, cost});
      }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const KeyTask& x, const KeyTask& y) { return x.cost > y.cost; });
  return tasks;
}

// The single-pass backward's tasks, one per (entry, kv head), heaviest first (varlen
// entries differ in length): returns (entry, kv head) pairs.
inline std::vector<std::pair<int64_t, int64_t>> head_group_tasks(const detail::Extents& e,
                                                                 const std::vector<KeyTask>& keys) {
  std::vector<int64_t> cost(static_cast<std::size_t>(e.batch * e.kv_heads), 0);
  for (const KeyTask& task : keys) cost[static_cast<std::size_t>(task.batch * e.kv_heads + task.kv_head)] += task.cost;
  std::vector<std::pair<int64_t, int64_t>> tasks;
  for (int64_t b = 0; b < e.batch; ++b)
    for (int64_t kv = 0; kv < e.kv_heads; ++kv) tasks.push_back({b, kv});
  std::stable_sort(tasks.begin(), tasks.end(), [&](const auto& x, const auto& y) {
    return cost[static_cast<std::size_t>(x.first * e.kv_heads + x.second)] >
           cost[static_cast<std::size_t>(y.first * e.kv_heads + y.second)];
  });
  return tasks;
}

}  // namespace qkv::cpu
