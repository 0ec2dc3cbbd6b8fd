// Everything a ring pass needs to know before it sends a byte: this rank's place in the
// ring, the global problem, and the verdict on every rank's arguments. Checking is
// collective (see collective.hpp): a bad argument anywhere makes every rank throw.
#pragma once

#include <mpi.h>

#include <functional>
#include <string>
#include <vector>

#include "blocks.hpp"
#include "qkv/dist.hpp"

namespace qkv::detail {
class Checker;  // check/checker.hpp
}  // namespace qkv::detail

namespace qkv::dist::detail {

// This rank's local extents, read from its views.
struct LocalExtents {
  int64_t batch = 0, q_rows = 0, k_rows = 0, q_heads = 0, kv_heads = 0, dim = 0, v_dim = 0;
};

struct RingSetup {
  int world = 1, rank = 0, next = 0, prev = 0;
  RingProblem problem;
  std::vector<int64_t> q_rows, k_rows;  // every rank's shard lengths
  int64_t q_heads = 0;
  PackedBlock block;  // the layout of a travelling K/V (or dK/dV) block
  // Options for each block call: the plan has applied key_lengths and causality, and
  // inputs were scanned up front when check_finite was asked for.
  AttentionOptions call_options;

  int64_t max_k_rows() const;
  int64_t max_block_floats() const { return block.floats(max_k_rows()); }
};

// What a ring pass cannot take (a mask, modifiers) and its own options (ring.*).
void check_ring_options(const qkv::detail::Checker& check, const AttentionOptions& options,
                        const RingOptions& ring);

// Runs `local_checks` (which throws qkv::Error for a bad local argument), agrees across
// the ranks, checks that the ranks' shapes and options match and that their shard
// lengths are those of `ring.sharding`, and returns the setup. Throws the same Error on
// every rank when anything is wrong anywhere. Collective.
RingSetup setup_ring(const char* function, const LocalExtents& local,
                     const AttentionOptions& options, MPI_Comm comm, const RingOptions& ring,
                     const std::function<void()>& local_checks);

}  // namespace qkv::dist::detail
