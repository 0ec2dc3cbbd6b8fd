// qkv::dist — exact ring attention over the ranks of an MPI communicator.
//
// The sequence is sharded over the W ranks (qkv/dist/ring_plan.hpp: zigzag by default,
// which balances causal work). Every rank passes its K/V shard around the ring with
// non-blocking point-to-point messages while it computes on the shard it holds, so the
// transfer of step s+1's block overlaps step s's compute, and merges the partial results
// by their log-sum-exp (qkv/merge.hpp). The result equals single-process attention on
// the unsharded sequence up to fp32 rounding: nothing is approximated.
//
// Backward: with the forward's global out and lse, attention_backward on (local Q,
// visiting K/V) gives exact partial dQ, dK, dV. dQ accumulates locally; dK/dV travel
// with their K/V and reach their owner after a full turn.
//
// Every function here is collective: call it on every rank of `comm`, with views of
// that rank's shards (local rows in shard order). Arguments are checked on every rank
// and across ranks before anything is sent or written; if any rank's arguments are bad,
// every rank throws the same qkv::Error, naming the first bad rank.
//
// Options: scale, causal (top_left, bottom_right: positions are global), key_lengths
// (global key positions, the same on every rank), GQA, dv ≠ d, execution (backend,
// threads, check_finite) as for attention_forward. Masks are not supported (a mask over
// the global sequence would have to be sharded too) and throw. float only.
//
// Link qkv::dist (built when CMake finds MPI).
#pragma once

#include <mpi.h>

#include "qkv/attention.hpp"
#include "qkv/dist/ring_plan.hpp"
#include "qkv/merge.hpp"
#include "qkv/options.hpp"
#include "qkv/tensor.hpp"

namespace qkv::dist {

struct RingOptions {
  Sharding sharding = Sharding::zigzag;
  // Query rows per block call: each step's calls are cut into pieces this tall, with a
  // chance for MPI to move the step's messages between pieces (implementations without
  // a progress thread advance transfers only inside MPI calls). 256 rows are four of
  // the kernels' 64-row query blocks, enough to keep a node's threads busy per piece;
  // lower it when a piece takes much longer than a message. Must be ≥ 1.
  int64_t progress_rows = 256;
};

// out (and lse, if given: it is what ring_attention_backward needs) for this rank's
// query rows. Shapes as for attention_forward, with local sequence lengths:
//   q [B, nq_r, Hq, d]   k [B, nk_r, Hkv, d]   v [B, nk_r, Hkv, dv]
//   out [B, nq_r, Hq, dv]   lse [B, Hq, nq_r]
// where nq_r = shard_length(Nq, W, r, sharding) and Nq is the sum over ranks (likewise
// for keys). weights are not supported.
void ring_attention_forward(const ForwardArgs<float>& local, const AttentionOptions& options,
                            MPI_Comm comm, const RingOptions& ring = {});

// dq, dk, dv for this rank's rows, given this rank's rows of the forward's out and lse
// and of dout. Same options as the forward.
void ring_attention_backward(const BackwardArgs<float>& local, const AttentionOptions& options,
                             MPI_Comm comm, const RingOptions& ring = {});

// The global [B, N, H, D] tensor whose shards the ranks hold (N = Σ local.shape[1]),
// on every rank: the inverse of shard_into. Collective.
Tensor<float, 4> gather_sequence(View4<const float> local, MPI_Comm comm,
                                 Sharding sharding = Sharding::zigzag);

}  // namespace qkv::dist
