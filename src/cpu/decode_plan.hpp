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

#include "cpu/amx_rows.hpp"
#include "cpu/blocking.hpp"
#include "cpu/dot_products.hpp"
#include "core/problem.hpp"
#include "qkv/half.hpp"
#include "qkv/threads.hpp"

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

// Keys per block of the latent step instead (decode_latent-inl.h: one kv head of ≥ 16
// bfloat16 query rows on vdpbf16ps), whose scores sit transposed in their own scratch, not
// in the float step's L1 budget (which gives 32 keys at 128 heads and 16 at 128 heads × 2
// queries): P·V's reductions run over the block's key pairs, the score tiles over 6 keys
// at a time, the product tiles over 6 heads. Measured (Zen 4, dc 512 + dr 64, 1 thread,
// the C++ call, best of interleaved rounds, ms) with the cache in L3 ("hot": 4096 keys,
// batch 1, the same call repeated) and streamed from memory ("cold": 32768 keys, or 4096
// × batch 8), which is how a serving step reads it; the choice starred:
//   16 heads  hot: 32 keys 1.08, 48* 1.16, 64 (the budget's) 1.19; 2 queries 1.89 / 1.78* / 2.22
//             cold 32k: 32 9.52, 48* 8.83–8.92, 64 8.89–9.07, 96 9.04; batch 8: 48* 9.49, 64 9.60
//   32 heads  hot: 32 1.89, 48* 1.75, 64 (the budget's) 2.09, 96 2.09
//             cold batch 8: 48* 16.55, 64 17.56, 96 15.72; 32k: 48* 15.43, 64 14.98, 96 14.46
//   64 heads  hot: 32 3.61, 48 3.42, 64* (the budget's) 3.29, 96 4.08
//             cold 32k: 64* 26.7, 96 25.9; batch 8: 64* 29.1, 96 28.5
//   128 heads hot: 32 (the budget's) 7.35, 64 6.8, 96* 6.6; 2 queries 15.7 at 32, 13.75 at 96
//             cold 32k: 48 55.0, 64 53.7, 96* 52.7, 128 52.1; batch 8: 61.5 at 32, 55.5 at 96
// Below 128 heads the hot cache favours small blocks and the cold one larger ones; each
// choice is within 8% of the best of both. Other vdpbf16ps CPUs (Zen 5) are unmeasured.
inline std::size_t latent_block_keys(std::size_t q_heads) {
  return q_heads <= 32 ? 48 : q_heads <= 64 ? 64 : 96;
}

// Below these a thread is not worth waking (see threads_for in work_order.hpp). Bytes:
// ~40 µs of DRAM streaming; over spinning workers (qkv/threads.hpp), which start at
// once, 128 KiB (Emerald Rapids, a [1,9,1,64] call against 540 keys of 3 kv heads, caches
// flushed, 2 threads: 170 → 120 µs spinning; passive 202 → 324 µs: each wake-up ~100+ µs).
inline constexpr double kDecodeMinFlopsPerThread = 4e6;
inline constexpr double kDecodeMinBytesPerThread = 1 << 20;
inline constexpr double kDecodeMinBytesPerSpinningThread = 1 << 17;

// execution.fixed_key_split (qkv/options.hpp): keys are split on a grid fixed by the key
// index alone — chunks of kFixedChunkKeys from key 0, blocks as for a full 16-query tile
// — so a row's bits depend on the row and the keys it sees, never on the other rows of
// its tile or call (a decode step reproduces the same row of a prefill chunk).
inline constexpr int64_t kFixedChunkKeys = 1024;

// A call with fewer tasks than this splits each chunk by kv heads (DecodePlan::
// split_by_heads), so that a single short sequence (a small model's decode step: one
// chunk or two) can use more than one core. Heads are independent rows: the split
// changes no bits, only gives each part its own pass over the queries.
inline constexpr std::size_t kDecodeMinTasks = 8;

// One chunk of keys of one (sequence, query tile), for kv heads [first_kv_head,
// end_kv_head): the unit a thread runs.
struct DecodeTask {
  int64_t batch = 0;
  int64_t first_query = 0;
  int64_t queries = 0;
  int64_t first_key = 0;
  int64_t end_key = 0;
  std::size_t block_keys = 0;    // keys per block of this sequence
  std::size_t index = 0;         // position in DecodePlan::tasks
  std::size_t state_offset = 0;  // where its chunk's partial state starts (floats)
  int64_t first_kv_head = 0;
  int64_t end_kv_head = 0;
};

// One (sequence, query tile) and its chunks: chunk c is tasks first_task + c·head_parts
// onwards, one per part of the kv heads (sharing the chunk's state, each writing its own
// heads' rows).
struct DecodeUnit {
  int64_t batch = 0;
  int64_t first_query = 0;
  int64_t queries = 0;
  std::size_t first_task = 0;
  int64_t chunks = 0;
  int64_t head_parts = 1;
};

// Partial softmax state of a chunk: per row (h, i) of the tile, row index h·tile + i:
// acc[row·dv_pad + c], m[row], l[row].
struct ChunkState {
  float* acc;
  float* m;
  float* l;
};

// How a call's blocks are sized for the latent step: the calls LatentDots
// (decode_latent-inl.h) sends there — one kv head of bfloat16 or float8 keys, query heads
// in whole 16s, no softcap or score modifier, precision fast on a bf16 unit — and keys not
// on execution.fixed_key_split's grid. `dots`: latent_block_keys per block (vdpbf16ps, and
// the AMX tiles below kLatentSpanRows rows); `spans`: on the AMX tiles from there, blocks
// of amx::kSpanKeys keys, each one span of the row-layout step (LatentSpan; the forward's
// row kernel switch, amx_row_forward(), off keeps the column step's blocks). Decided from the
// problem alone, so qkv::decode, mla_decode and qkv::BatchPlan (which plans ahead) size a
// sequence's blocks alike. (A partly visible block of such a call, which takes the float
// step, has as many keys: the scratch is sized by the plan.)
enum class LatentBlocks { none, dots, spans };
inline constexpr int64_t kLatentSpanRows = 128;  // query rows of a tile from which spans pay

// Whether a tile of `rows` query rows on `unit` takes the spans: on the AMX tiles, from
// kLatentSpanRows rows, unless the row kernel's switch is off. (Also FP8 records' rule,
// mla_records.cpp, whose rows are the heads.)
inline bool latent_spans_pay(Bf16Unit unit, int64_t rows) {
  return unit == Bf16Unit::amx && rows >= kLatentSpanRows && amx_row_forward();
}

inline LatentBlocks latent_blocks(const detail::ForwardProblem<float>& p, StorageType storage) {
  const bool storage_ok = storage == StorageType::bfloat16 || storage == StorageType::float8_e4m3fn ||
                          storage == StorageType::float8_e5m2;
  if (!storage_ok || p.extents.kv_heads != 1 || p.extents.q_heads % 16 != 0 || p.modifiers.softcap != 0.0f ||
      p.modifiers.has_score_mod() || p.fixed_key_split)
    return LatentBlocks::none;
  const Bf16Unit unit = bf16_unit(p.precision);
  // Spans pack each key into the tiles' order once for all the tile's rows: at 128 rows
  // a query (128 heads × 1, or 64 × 2) that pays (Emerald Rapids, dc 512 + 64, 1 thread,
  // 4k keys × batch 8: 128 heads 36.0 → 24.7–28.8 ms); at 64 rows the two steps were
  // even, at 16 the column step, which reads the keys as they are, was 15% faster.
  const int64_t rows = p.extents.q_heads * std::min<int64_t>(p.extents.q_len, kDecodeQueries);
  if (latent_spans_pay(unit, rows)) return LatentBlocks::spans;
  return unit == Bf16Unit::fp32_fma ? LatentBlocks::none : LatentBlocks::dots;
}

struct DecodePlan {
  std::size_t lanes = 0;       // the vector length it was planned for
  bool latent_spans = false;    // blocks of amx::kSpanKeys for LatentSpan (latent_blocks)
  std::size_t latent_keys = 0;  // keys per block for the latent step (0: the budget's)
  std::size_t d_pad = 0;       // head_dim rounded up to whole vectors
  std::size_t dv_pad = 0;      // v_dim rounded up to whole vectors
  std::size_t block_keys = 0;  // the most keys per block of any sequence (a multiple of lanes)
  // Head sizes that are not whole vectors: K/V rows are widened into zero-padded float
  // rows per block; otherwise the kernels read the cache in place.
  bool packed = false;
  std::size_t q_heads = 0;
  std::size_t group = 0;       // query heads per kv head
  std::size_t max_tile = 0;    // queries in the largest tile
  std::size_t state_floats = 0;  // of every task together
  std::vector<DecodeTask> tasks;
  std::vector<DecodeUnit> units;
  std::vector<std::size_t> order;  // task indices, costliest first
  std::vector<double> cost;        // per task: max(flops, 8 · bytes)
  std::vector<bool> skipped;       // the constructor's `skip` (empty: none)
  double flops = 0.0;
  double bytes = 0.0;

  // `p`'s batch entries are its sequences (dense, or varlen queries: mask.q_len(b) each);
  // `storage` is its key/value source's element type.
  DecodePlan(const detail::ForwardProblem<float>& problem, StorageType storage, std::size_t vector_lanes)
      : DecodePlan(problem.extents, problem.mask, storage, vector_lanes, problem.fixed_key_split, nullptr,
                   latent_blocks(problem, storage)) {}

  // `skip` (optional, one flag per sequence): sequences another schedule computes
  // (qkv::BatchPlan's prefill chunks), left out of the plan. `latent`: the latent step's
  // blocks (latent_blocks above says which). Spans need the accumulator's rows in whole
  // tiles (dv_pad a multiple of 16); else the latent_block_keys blocks.
  DecodePlan(const detail::Extents& p, const detail::MaskRule& mask, StorageType storage,
             std::size_t vector_lanes, bool fixed_key_split = false, const std::vector<bool>* skip = nullptr,
             LatentBlocks latent = LatentBlocks::none)
      : lanes(vector_lanes),
        latent_spans(latent == LatentBlocks::spans &&
                     round_up(static_cast<std::size_t>(p.v_dim), vector_lanes) % amx::kTileRows == 0),
        latent_keys(latent_spans                  ? round_up(amx::kSpanKeys, vector_lanes)
                    : latent != LatentBlocks::none ? round_up(latent_block_keys(static_cast<std::size_t>(p.q_heads)), vector_lanes)
                                                   : 0),
        d_pad(round_up(static_cast<std::size_t>(p.head_dim), lanes)),
        dv_pad(round_up(static_cast<std::size_t>(p.v_dim), lanes)),
        packed(d_pad != static_cast<std::size_t>(p.head_dim) || dv_pad != static_cast<std::size_t>(p.v_dim)),
        q_heads(static_cast<std::size_t>(p.q_heads)),
        group(static_cast<std::size_t>(p.group())),
        skipped(skip != nullptr ? *skip : std::vector<bool>{}) {
    const double element_bytes = storage_bits(storage) / 8.0;
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t q_len = mask.q_len(b);
      if (q_len == 0 || (skip != nullptr && (*skip)[static_cast<std::size_t>(b)])) continue;
      // Each sequence's blocks follow from its own tile size (or, fixed, a full tile's),
      // never from the other sequences: a sequence's bits do not depend on its batch.
      const auto tile_queries = static_cast<std::size_t>(fixed_key_split ? kDecodeQueries : std::min(q_len, kDecodeQueries));
      const std::size_t block = keys_per_block(tile_queries);
      block_keys = std::max(block_keys, block);
      // The latent spans' chunks: the rows' partial state (128 heads × 512 + 2 floats is 257
      // KiB a query) at most a quarter of the latent rows a chunk reads, since every chunk
      // zeroes, writes and merges it (at 512 keys, 128 heads, the state was 45% of the
      // cache's bytes; bench/RESULTS.md §13g).
      int64_t min_chunk = kMinChunkKeys;
      if (latent_spans)
        min_chunk = std::max<int64_t>(
            min_chunk, static_cast<int64_t>(4.0 * static_cast<double>(q_heads * tile_queries * (dv_pad + 2) * sizeof(float)) /
                                            (static_cast<double>(p.head_dim) * element_bytes)));
      for (int64_t first = 0; first < q_len; first += kDecodeQueries) {
        DecodeUnit unit{b, first, std::min(kDecodeQueries, q_len - first), tasks.size(), 0};
        max_tile = std::max(max_tile, static_cast<std::size_t>(unit.queries));
        // Key ranges only move right with the query index: the tile's first query starts
        // earliest, its last one ends latest. Keys before `begin` (a sliding window's
        // past) are never read.
        int64_t begin = mask.key_begin(b, first);
        const int64_t end = mask.key_end(b, first + unit.queries - 1);
        int64_t chunk = kFixedChunkKeys;
        if (fixed_key_split) {
          begin = begin / kFixedChunkKeys * kFixedChunkKeys;  // chunks on the fixed grid
        } else {
          chunk = static_cast<int64_t>(round_up(
              static_cast<std::size_t>(std::max(min_chunk, (end - begin + kMaxChunks - 1) / kMaxChunks)), block));
        }
        for (int64_t key = begin; key < end; key += chunk) {
          const int64_t chunk_end = std::min(key + chunk, end);
          tasks.push_back({b, first, unit.queries, key, chunk_end, block, tasks.size(), state_floats, 0, p.kv_heads});
          state_floats += q_heads * static_cast<std::size_t>(unit.queries) * (dv_pad + 2);
          ++unit.chunks;
          const auto keys = static_cast<double>(chunk_end - key);
          const double task_flops = 2.0 * keys * static_cast<double>(p.q_heads * unit.queries) *
                                    static_cast<double>(p.head_dim + p.v_dim);
          const double task_bytes = keys * static_cast<double>(p.kv_heads * (p.head_dim + p.v_dim)) * element_bytes;
          flops += task_flops;
          bytes += task_bytes;
          // Time of a task, roughly: its streaming or its arithmetic, whichever binds
          // (~8 flops per byte is where the two meet on one core).
          cost.push_back(std::max(task_flops, 8.0 * task_bytes));
        }
        units.push_back(unit);
      }
    }
    if (!tasks.empty() && tasks.size() < kDecodeMinTasks && p.kv_heads > 1) split_by_heads(p.kv_heads);
    order.resize(tasks.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) { return cost[x] > cost[y]; });
  }

  // Each chunk's task as `parts` tasks over consecutive kv heads (as even as they divide),
  // costed by their share of the heads.
  void split_by_heads(int64_t kv_heads) {
    const auto wanted = static_cast<int64_t>((kDecodeMinTasks + tasks.size() - 1) / tasks.size());
    const int64_t parts = std::min(kv_heads, wanted);
    std::vector<DecodeTask> split;
    std::vector<double> split_cost;
    for (DecodeUnit& unit : units) {
      const std::size_t first = unit.first_task;
      unit.first_task = split.size();
      unit.head_parts = parts;
      for (int64_t c = 0; c < unit.chunks; ++c) {
        const std::size_t t = first + static_cast<std::size_t>(c);
        for (int64_t part = 0; part < parts; ++part) {
          DecodeTask task = tasks[t];
          task.first_kv_head = part * kv_heads / parts;
          task.end_kv_head = (part + 1) * kv_heads / parts;
          task.index = split.size();
          split.push_back(task);
          split_cost.push_back(cost[t] * static_cast<double>(task.end_kv_head - task.first_kv_head) /
                               static_cast<double>(kv_heads));
        }
      }
    }
    tasks = std::move(split);
    cost = std::move(split_cost);
  }

  // The first task of chunk c of `unit` (its state is the chunk's).
  const DecodeTask& chunk_task(const DecodeUnit& unit, int64_t c) const {
    return tasks[unit.first_task + static_cast<std::size_t>(c * unit.head_parts)];
  }

  // Keys per block for tiles of `tile_queries`: the score tile (group rows × block) within
  // kDecodeScoreFloats, at most kDecodeMaxBlockKeys, whole vectors.
  std::size_t keys_per_block(std::size_t tile_queries) const {
    if (latent_keys != 0) return latent_keys;
    return std::clamp<std::size_t>(kDecodeScoreFloats / (group * tile_queries) / lanes * lanes, lanes,
                                   round_up(kDecodeMaxBlockKeys, lanes));
  }

  std::size_t tile_rows() const { return q_heads * max_tile; }
  std::size_t group_rows() const { return group * max_tile; }

  ChunkState chunk_state(float* states, const DecodeTask& task) const {
    const std::size_t rows = q_heads * static_cast<std::size_t>(task.queries);
    float* state = states + task.state_offset;
    return {state, state + rows * dv_pad, state + rows * dv_pad + rows};
  }

  // Threads worth starting: no more than asked, than tasks, or than the work pays for.
  // Changes speed only, never results.
  int threads(int requested) const {
    const double min_bytes = idle_workers_spin() ? kDecodeMinBytesPerSpinningThread : kDecodeMinBytesPerThread;
    const double by_work = std::max({1.0, flops / kDecodeMinFlopsPerThread, bytes / min_bytes});
    return static_cast<int>(std::min({static_cast<double>(requested),
                                      static_cast<double>(tasks.size()), by_work}));
  }
};

}  // namespace qkv::cpu
