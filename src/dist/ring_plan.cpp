// The ring schedule (see qkv/dist/ring_plan.hpp): sharding into chunks and the per-pair
// decision empty / full / diagonal. Pure index arithmetic, shared by C++ and Python.
#include "qkv/dist/ring_plan.hpp"

#include <algorithm>
#include <string>

#include "qkv/error.hpp"

namespace qkv::dist {
namespace {

[[noreturn]] void fail(const std::string& what) { throw Error("qkv::dist: " + what); }

void check_world_rank(const char* rank_name, int world, int rank) {
  if (world < 1) fail("world size: expected >= 1, got " + std::to_string(world));
  if (rank < 0 || rank >= world) {
    fail(std::string(rank_name) + ": expected 0.." + std::to_string(world - 1) + ", got " +
         std::to_string(rank));
  }
}

// Rows [begin, begin + size) of chunk `chunk` of `count`: the first length mod count
// chunks have one row more.
Segment chunk_rows(int64_t length, int64_t count, int64_t chunk) {
  const int64_t base = length / count, extra = length % count;
  const int64_t begin = chunk * base + std::min(chunk, extra);
  return {.global_begin = begin, .length = base + (chunk < extra ? 1 : 0), .local_begin = 0};
}

// Global position of the last valid key + 1 for batch entry b.
int64_t key_limit(const RingProblem& p, int64_t b) {
  return p.key_lengths.empty() ? p.k_len : p.key_lengths[static_cast<std::size_t>(b)];
}

void check_problem(const RingProblem& p) {
  if (p.world < 1) fail("RingProblem.world: expected >= 1, got " + std::to_string(p.world));
  if (p.batch < 0) fail("RingProblem.batch: expected >= 0, got " + std::to_string(p.batch));
  if (p.q_len < 0) fail("RingProblem.q_len: expected >= 0, got " + std::to_string(p.q_len));
  if (p.k_len < 0) fail("RingProblem.k_len: expected >= 0, got " + std::to_string(p.k_len));
  if (p.key_lengths.empty()) return;
  if (static_cast<int64_t>(p.key_lengths.size()) != p.batch) {
    fail("RingProblem.key_lengths: expected one length per batch entry (" +
         std::to_string(p.batch) + "), got " + std::to_string(p.key_lengths.size()));
  }
  for (std::size_t b = 0; b < p.key_lengths.size(); ++b) {
    if (p.key_lengths[b] < 0 || p.key_lengths[b] > p.k_len) {
      fail("RingProblem.key_lengths[" + std::to_string(b) + "]: expected 0.." +
           std::to_string(p.k_len) + ", got " + std::to_string(p.key_lengths[b]));
    }
  }
}

// The calls for one (query segment, key segment) pair of batch entries [b0, b1), all of
// which share the key limit `limit`. Query i sees key j (global) iff j < limit and, with
// a causal mask, j ≤ i + offset.
void plan_pair(const Segment& qs, const Segment& ks, int64_t b0, int64_t b1, Causal causal,
               int64_t offset, int64_t limit, std::vector<BlockCall>& calls) {
  const int64_t nq = qs.length;
  const int64_t nk = std::clamp<int64_t>(limit - ks.global_begin, 0, ks.length);
  if (nq == 0 || nk == 0) return;  // empty: no valid key in this chunk
  auto add = [&](int64_t i_begin, int64_t i_end, int64_t k_count, Causal mode) {
    calls.push_back({.batch_begin = b0, .batch_end = b1,
                     .q_begin = qs.local_begin + i_begin, .q_end = qs.local_begin + i_end,
                     .k_begin = ks.local_begin, .k_end = ks.local_begin + k_count,
                     .causal = mode});
  };
  if (causal == Causal::none) return add(0, nq, nk, Causal::none);  // full
  // Local query i' sees local key j' iff j' ≤ i' + c.
  const int64_t c = qs.global_begin + offset - ks.global_begin;
  const int64_t first_seeing = std::max<int64_t>(0, -c);  // rows before it see no key
  if (first_seeing >= nq) return;                         // empty: all keys in the future
  // Rows [first_seeing, first_full) see keys [0, i' + c] ⊂ [0, nk); later rows see all nk.
  const int64_t first_full = std::clamp<int64_t>(nk - c, first_seeing, nq);
  if (first_full > first_seeing) {
    // A bottom_right call over keys [0, first_full + c) aligns its last query with its
    // last key: offset (first_full + c) − (first_full − first_seeing) = c + first_seeing,
    // which is exactly the pair's offset c shifted to the call's first row.
    add(first_seeing, first_full, first_full + c, Causal::bottom_right);
  }
  if (first_full < nq) add(first_full, nq, nk, Causal::none);
}

template <class Src, class Dst>
void copy_rows(const Src& src, int64_t src_row, const Dst& dst, int64_t dst_row, int64_t rows) {
  for (int64_t b = 0; b < src.shape[0]; ++b)
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t h = 0; h < src.shape[2]; ++h)
        for (int64_t x = 0; x < src.shape[3]; ++x) dst(b, dst_row + n, h, x) = src(b, src_row + n, h, x);
}

void check_shard_shapes(const char* function, const View4<const float>& global,
                        const View4<const float>& local, int world, int rank, Sharding sharding) {
  check_world_rank("rank", world, rank);
  const int64_t expected = shard_length(global.shape[1], world, rank, sharding);
  const char* names[] = {"batch", "seq", "heads", "dim"};
  for (int axis = 0; axis < 4; ++axis) {
    const int64_t want = axis == 1 ? expected : global.shape[axis];
    if (local.shape[axis] != want) {
      throw Error(std::string("qkv::dist::") + function + ": local.shape[" + std::to_string(axis) +
                  "] (" + names[axis] + "): expected " + std::to_string(want) + ", got " +
                  std::to_string(local.shape[axis]));
    }
  }
  if ((global.numel() > 0 && global.empty()) || (local.numel() > 0 && local.empty())) {
    throw Error(std::string("qkv::dist::") + function + ": a view with elements has no data");
  }
}

}  // namespace

std::vector<Segment> shard_segments(int64_t length, int world, int rank, Sharding sharding) {
  check_world_rank("rank", world, rank);
  if (length < 0) fail("sequence length: expected >= 0, got " + std::to_string(length));
  std::vector<Segment> segments;
  if (sharding == Sharding::contiguous) {
    segments.push_back(chunk_rows(length, world, rank));
  } else {
    const int64_t chunks = 2 * static_cast<int64_t>(world);
    segments.push_back(chunk_rows(length, chunks, rank));
    segments.push_back(chunk_rows(length, chunks, chunks - 1 - rank));
    segments[1].local_begin = segments[0].length;
  }
  return segments;
}

int64_t shard_length(int64_t length, int world, int rank, Sharding sharding) {
  int64_t total = 0;
  for (const Segment& s : shard_segments(length, world, rank, sharding)) total += s.length;
  return total;
}

int ring_kv_owner(int world, int rank, int step) {
  check_world_rank("rank", world, rank);
  return static_cast<int>(((static_cast<int64_t>(rank) - step) % world + world) % world);
}

std::vector<BlockCall> ring_block_calls(const RingProblem& p, int rank, int kv_owner) {
  check_problem(p);
  check_world_rank("rank", p.world, rank);
  check_world_rank("kv_owner", p.world, kv_owner);
  const auto q_segments = shard_segments(p.q_len, p.world, rank, p.sharding);
  const auto k_segments = shard_segments(p.k_len, p.world, kv_owner, p.sharding);
  std::vector<BlockCall> calls;
  // Batch entries with the same key limit share one plan: group consecutive runs.
  for (int64_t b0 = 0; b0 < p.batch;) {
    const int64_t limit = key_limit(p, b0);
    int64_t b1 = b0 + 1;
    while (b1 < p.batch && key_limit(p, b1) == limit) ++b1;
    const int64_t offset = p.causal == Causal::bottom_right ? limit - p.q_len : 0;
    for (const Segment& qs : q_segments)
      for (const Segment& ks : k_segments) plan_pair(qs, ks, b0, b1, p.causal, offset, limit, calls);
    b0 = b1;
  }
  return calls;
}

std::vector<BlockCall> split_queries(const BlockCall& call, int64_t max_rows) {
  if (max_rows < 1) fail("split_queries: max_rows: expected >= 1, got " + std::to_string(max_rows));
  std::vector<BlockCall> pieces;
  const int64_t rows = call.q_end - call.q_begin, keys = call.k_end - call.k_begin;
  for (int64_t begin = 0; begin < rows; begin += max_rows) {
    BlockCall piece = call;
    piece.q_begin = call.q_begin + begin;
    piece.q_end = call.q_begin + std::min(rows, begin + max_rows);
    if (call.causal == Causal::bottom_right) {
      // Row i of the call sees keys [0, i + keys − rows]: the piece's last row decides.
      piece.k_end = call.k_begin + (piece.q_end - call.q_begin) + keys - rows;
    }
    pieces.push_back(piece);
  }
  return pieces;
}

void shard_into(View4<const float> global, View4<float> local, int world, int rank,
                Sharding sharding) {
  check_shard_shapes("shard_into", global, local, world, rank, sharding);
  for (const Segment& s : shard_segments(global.shape[1], world, rank, sharding))
    copy_rows(global, s.global_begin, local, s.local_begin, s.length);
}

void unshard_into(View4<const float> local, View4<float> global, int world, int rank,
                  Sharding sharding) {
  check_shard_shapes("unshard_into", global, local, world, rank, sharding);
  for (const Segment& s : shard_segments(global.shape[1], world, rank, sharding))
    copy_rows(local, s.local_begin, global, s.global_begin, s.length);
}

}  // namespace qkv::dist
