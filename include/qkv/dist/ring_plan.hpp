// The schedule of ring attention, without any communication: which rows of a sequence
// each rank holds (sharding) and, at each ring step, which attention calls a rank makes
// on the key/value shard visiting it. qkv::dist (MPI) and qkv.dist (torch.distributed)
// both run exactly this plan; it needs no MPI, so it is its own library, qkv::ring_plan.
//
// Sharding. A sequence of N rows is cut into chunks; rank r of W holds
//   zigzag:      chunks r and 2W−1−r of 2W (in that order), so that under a causal mask
//                every rank holds one early and one late chunk and does the same work;
//   contiguous:  chunk r of W (no balance under causality; fine without it).
// Chunk c of C has ⌊N/C⌋ rows, plus one for the first N mod C chunks. Queries and keys
// are sharded the same way, each by its own length. A rank may hold no rows.
//
// Steps. At step s = 0 … W−1, rank r holds the K/V shard of rank (r − s) mod W. For each
// (local query chunk, visiting key chunk) pair the plan decides, per batch entry group:
//   empty     no key of the chunk is visible to any query of the chunk: no call;
//   full      every key visible to every query: one call without a causal mask;
//   diagonal  the causal boundary crosses the pair: the query rows that see some but
//             not all keys go into one call with a bottom_right causal mask (its offset
//             chosen by the key range), the rows that see every key into a full call,
//             the rows that see none into no call.
// key_lengths (global key positions) cut each key chunk first; with key_lengths the
// calls are planned per batch entry, since each entry sees a different key range.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "qkv/options.hpp"
#include "qkv/tensor.hpp"

namespace qkv::dist {

enum class Sharding { zigzag, contiguous };

// Rows [global_begin, global_begin + length) of the sequence, stored at local rows
// [local_begin, local_begin + length) of a rank's shard.
struct Segment {
  int64_t global_begin = 0;
  int64_t length = 0;
  int64_t local_begin = 0;
};

// The segments of rank `rank` (in local order) and their total length. Throws qkv::Error
// for length < 0, world < 1 or rank outside [0, world).
std::vector<Segment> shard_segments(int64_t length, int world, int rank, Sharding sharding);
int64_t shard_length(int64_t length, int world, int rank, Sharding sharding);

// The rank whose K/V shard rank `rank` holds at ring step `step`.
int ring_kv_owner(int world, int rank, int step);

// The whole sequence problem the ranks share.
struct RingProblem {
  int world = 1;
  Sharding sharding = Sharding::zigzag;
  int64_t batch = 1;
  int64_t q_len = 0;  // global query rows
  int64_t k_len = 0;  // global key rows
  Causal causal = Causal::none;
  // Per batch entry, only global keys [0, key_lengths[b]) take part; empty: all keys.
  // With bottom_right, the last query aligns with the last valid key (as in the core).
  std::span<const int64_t> key_lengths;
};

// One attention call: this rank's local query rows [q_begin, q_end) against rows
// [k_begin, k_end) of the visiting K/V shard, for batch entries [batch_begin, batch_end).
// causal is none (every key visible) or bottom_right (local key j visible to local query
// i iff j − k_begin ≤ i − q_begin + (k_end − k_begin) − (q_end − q_begin)). Each call
// has at least one query and one key; every query row it holds sees at least one key.
struct BlockCall {
  int64_t batch_begin = 0, batch_end = 0;
  int64_t q_begin = 0, q_end = 0;
  int64_t k_begin = 0, k_end = 0;
  Causal causal = Causal::none;
};

// Checks the problem (throws qkv::Error naming the field) and returns the calls rank
// `rank` makes on the shard of rank `kv_owner`. Over all owners, every visible (batch,
// query, key) triple is covered by exactly one call and no invisible one by any.
std::vector<BlockCall> ring_block_calls(const RingProblem& problem, int rank, int kv_owner);

// `call` cut into calls of at most `max_rows` query rows (max_rows ≥ 1), covering
// exactly the same (query, key) pairs: a bottom_right piece keeps the keys up to its
// last row's, so its own bottom_right alignment is the original's. The MPI ring runs
// pieces so that it can let MPI progress its messages between them.
std::vector<BlockCall> split_queries(const BlockCall& call, int64_t max_rows);

// Copies this rank's rows of a global [B, N, H, D] tensor (N = global.shape[1]) into
// `local` [B, shard_length, H, D], or this rank's shard back into its rows of `global`.
// Throws qkv::Error (before writing) when shapes disagree.
void shard_into(View4<const float> global, View4<float> local, int world, int rank,
                Sharding sharding);
void unshard_into(View4<const float> local, View4<float> global, int world, int rank,
                  Sharding sharding);

}  // namespace qkv::dist
