// The decode kernel's work, planned once per call: query tiles, key chunks, block size,
// the layout of each chunk's partial softmax state, and how many threads are worth it.
// Everything here depends on the shape only — never on the thread count — so the
// chunks, and with them the bits of the result, are the same for any number of threads.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <vector>

#include "cpu/blocking.hpp"
#include "core/problem.hpp"
#include "qkv/half.hpp"

namespace qkv::cpu {

// Queries of one sequence that share a pass over its keys. With G query heads per kv
// head, G·16 rows share each K/V row read (GQA 8: 128 rows, 32 KiB of scores at 64 keys).
inline constexpr int64_t kDecodeQueries = 16;

// Keys per chunk (the unit of parallel work): at least kMinChunkKeys, so a chunk's
// fixed costs (packing queries, its partial state, its share of the merge) stay below
// ~1% of its streaming; at most kMaxChunks per sequence, so the partial states stay
// small next to the cache (≤ 16·rows·(dv + 2) floats per sequence), while a single
// sequence of ≥ 1024 keys still splits across cores.
inline constexpr int64_t kMinChunkKeys = 512;
inline constexpr int64_t kMaxChunks = 16;

// Keys per block: the score tile (group rows × block) stays within kDecodeScoreFloats
// (16 KiB, in L1 next to the keys it is computed from), and a block is at most
// kDecodeMaxBlockKeys keys. Measured (32/8, d = 128, 32768 keys, 1 thread): 32…256
// keys are within ~10% of each other; 64 keeps a [keys, heads, d] or paged cache (one
// 4 KiB page per row of a head at 8 heads × 128 floats) within the L1 TLB for a block's
// K and V, while the per-block costs of a row (max, exp pass, rescaling its
// accumulator) are spread over 64 keys.
inline constexpr std::size_t kDecodeScoreFloats = 4096;
inline constexpr std::size_t kDecodeMaxBlockKeys = 64;

// Below these a thread is not worth waking (see threads_for in work_order.hpp).
inline constexpr double kDecodeMinFlopsPerThread = 4e6;
inline constexpr double kDecodeMinBytesPerThread = 1 << 20;  // ~40 µs of DRAM streaming

// One chunk of keys of one (sequence, query tile): the unit a thread runs.
struct DecodeTask {
  int64_t batch = 0;
  int64_t first_query = 0;
  int64_t queries = 0;
  int64_t first_key = 0;
  int64_t end_key = 0;
  std::size_t index = 0;  // position in DecodePlan::tasks, and of its partial state
};

// One (sequence, query tile) and its chunks, tasks [first_task, first_task + chunks).
struct DecodeUnit {
  int64_t batch = 0;
  int64_t first_query = 0;
  int64_t queries = 0;
  std::size_t first_task = 0;
  int64_t chunks = 0;
};

// Partial softmax state of a chunk: per row (h, i) of the tile, row index h·tile + i:
// acc[row·dv_pad + c], m[row], l[row].
struct ChunkState {
  float* acc;
  float* m;
  float* l;
};

struct DecodePlan {
  std::size_t d_pad = 0;       // head_dim rounded up to whole vectors
  std::size_t dv_pad = 0;      // v_dim rounded up to whole vectors
  std::size_t block_keys = 0;  // keys per block (a multiple of the vector length)
  // Head sizes that are not whole vectors: K/V rows are widened into zero-padded float
  // rows per block; otherwise the kernels read the cache in place.
  bool packed = false;
  std::size_t q_heads = 0;
  std::size_t group = 0;       // query heads per kv head
  std::size_t max_tile = 0;    // queries in the largest tile
  std::size_t state_floats = 0;  // per task
  std::vector<DecodeTask> tasks;
  std::vector<DecodeUnit> units;
  std::vector<std::size_t> order;  // task indices, longest chunk first
  double flops = 0.0;
  double bytes = 0.0;

  // `p` is a dense problem (batch entries of p.extents.q_len queries); `storage` is its
  // key/value source's element type.
  DecodePlan(const detail::ForwardProblem<float>& problem, StorageType storage, std::size_t lanes)
      : DecodePlan(problem.extents, problem.mask, storage, lanes) {}

  DecodePlan(const detail::Extents& p, const detail::MaskRule& mask, StorageType storage,
             std::size_t lanes)
      : d_pad(round_up(static_cast<std::size_t>(p.head_dim), lanes)),
        dv_pad(round_up(static_cast<std::size_t>(p.v_dim), lanes)),
        block_keys(std::clamp<std::size_t>(
            kDecodeScoreFloats /
                (static_cast<std::size_t>(p.group()) * static_cast<std::size_t>(std::min(p.q_len, kDecodeQueries))) /
                lanes * lanes,
            lanes, round_up(kDecodeMaxBlockKeys, lanes))),
        packed(d_pad != static_cast<std::size_t>(p.head_dim) || dv_pad != static_cast<std::size_t>(p.v_dim)),
        q_heads(static_cast<std::size_t>(p.q_heads)),
        group(static_cast<std::size_t>(p.group())),
        max_tile(static_cast<std::size_t>(std::min(p.q_len, kDecodeQueries))),
        state_floats(q_heads * max_tile * (dv_pad + 2)) {
    const double element_bytes = storage_bytes(storage);
    const auto block = static_cast<int64_t>(block_keys);
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t first = 0; first < p.q_len; first += kDecodeQueries) {
        DecodeUnit unit{b, first, std::min(kDecodeQueries, p.q_len - first), tasks.size(), 0};
        // Key ranges only move right with the query index: the tile's first query starts
        // earliest, its last one ends latest. Keys before `begin` (a sliding window's
        // past) are never read.
        const int64_t begin = mask.key_begin(b, first);
        const int64_t end = mask.key_end(b, first + unit.queries - 1);
        const int64_t chunk =
            static_cast<int64_t>(round_up(static_cast<std::size_t>(std::max(
                                              kMinChunkKeys, (end - begin + kMaxChunks - 1) / kMaxChunks)),
                                          static_cast<std::size_t>(block)));
        for (int64_t key = begin; key < end; key += chunk) {
          tasks.push_back({b, first, unit.queries, key, std::min(key + chunk, end), tasks.size()});
          ++unit.chunks;
          const auto keys = static_cast<double>(tasks.back().end_key - key);
          flops += 2.0 * keys * static_cast<double>(p.q_heads * unit.queries) *
                   static_cast<double>(p.head_dim + p.v_dim);
          bytes += keys * static_cast<double>(p.kv_heads * (p.head_dim + p.v_dim)) * element_bytes;
        }
        units.push_back(unit);
      }
    order.resize(tasks.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) {
      return tasks[x].end_key - tasks[x].first_key > tasks[y].end_key - tasks[y].first_key;
    });
  }

  std::size_t tile_rows() const { return q_heads * max_tile; }
  std::size_t group_rows() const { return group * max_tile; }

  ChunkState chunk_state(float* state, std::size_t tile) const {
    const std::size_t rows = q_heads * tile;
    return {state, state + rows * dv_pad, state + rows * dv_pad + rows};
  }

  // Threads worth starting: no more than asked, than tasks, or than the work pays for.
  // Changes speed only, never results.
  int threads(int requested) const {
    const double by_work = std::max({1.0, flops / kDecodeMinFlopsPerThread,
                                     bytes / kDecodeMinBytesPerThread});
    return static_cast<int>(std::min({static_cast<double>(requested),
                                      static_cast<double>(tasks.size()), by_work}));
  }
};

}  // namespace qkv::cpu
