// Ring attention forward (qkv/dist.hpp).
//
// Step s of W: this rank holds the K/V block of rank (r − s) mod W. It first posts the
// block's send to the next rank and the receive of the following block from the
// previous one, then runs the plan's block calls on the block it holds, merging each
// call's (out, lse) into its accumulators by LSE, then waits: the transfer overlaps the
// compute. W−1 transfers in all; the last block is not passed on.
#include <algorithm>
#include <array>
#include <limits>
#include <vector>

#include "blocks.hpp"
#include "check/checker.hpp"
#include "messages.hpp"
#include "qkv/dist.hpp"
#include "qkv/error.hpp"
#include "ring_setup.hpp"

namespace qkv::dist {
namespace {

constexpr const char* kFunction = "qkv::dist::ring_attention_forward";

void check_local(const ForwardArgs<float>& a, const AttentionOptions& options, const RingOptions& ring) {
  const qkv::detail::Checker check(kFunction);
  detail::check_ring_options(check, options, ring);
  if (!a.weights.empty()) check.fail("weights: not supported by ring attention");
  using qkv::detail::describe;
  const std::array inputs{describe("q", a.q), describe("k", a.k), describe("v", a.v)};
  const std::array outputs{describe("out", a.out), describe("lse", a.lse)};
  for (const auto& view : inputs) check.expect_well_formed(view);
  for (const auto& view : outputs) check.expect_well_formed(view);
  // Heads, head dims, batch, GQA and options: the library's own checks, on no rows.
  AttentionOptions probe = options;
  probe.key_lengths = {};
  probe.execution.check_finite = false;
  const int64_t batch = a.q.shape[0];
  attention_forward({.q = detail::rows(a.q, 0, batch, 0, 0), .k = detail::rows(a.k, 0, a.k.shape[0], 0, 0),
                     .v = detail::rows(a.v, 0, a.v.shape[0], 0, 0),
                     .out = detail::rows(a.out, 0, a.out.shape[0], 0, 0),
                     .lse = a.lse.empty() ? View3<float>{} : detail::lse_rows(a.lse, 0, a.lse.shape[0], 0, 0)},
                    probe);
  // Sequence lengths, which the probe cannot see.
  check.expect_extent(inputs[2], 1, "seq", a.k.shape[1], "as k.shape[1]");
  check.expect_extent(outputs[0], 1, "seq", a.q.shape[1], "as q.shape[1]");
  if (!a.lse.empty()) check.expect_extent(outputs[1], 2, "seq", a.q.shape[1], "as q.shape[1]");
  check.expect_outputs_apart(outputs, inputs);
  if (options.execution.check_finite) {
    for (const auto& view : inputs) check.expect_finite<float>(view, false, "local index");
  }
}

}  // namespace

void ring_attention_forward(const ForwardArgs<float>& a, const AttentionOptions& options,
                            MPI_Comm comm, const RingOptions& ring) {
  const detail::LocalExtents local{.batch = a.q.shape[0], .q_rows = a.q.shape[1], .k_rows = a.k.shape[1],
                                   .q_heads = a.q.shape[2], .kv_heads = a.k.shape[2],
                                   .dim = a.q.shape[3], .v_dim = a.v.shape[3]};
  const detail::RingSetup s =
      detail::setup_ring(kFunction, local, options, comm, ring, [&] { check_local(a, options, ring); });
  const int64_t batch = local.batch, q_rows = local.q_rows;

  // Accumulators: the caller's out, and its lse or ours. Rows no key reaches stay 0, −inf.
  Tensor<float, 3> own_lse;
  View3<float> lse = a.lse;
  if (lse.empty()) {
    own_lse = Tensor<float, 3>({batch, s.q_heads, q_rows});
    lse = own_lse.view();
  }
  detail::fill(a.out, 0.0f);
  detail::fill(lse, -std::numeric_limits<float>::infinity());

  // Two block buffers: the one computed on and the one being received.
  std::vector<float> blocks[2] = {std::vector<float>(s.max_block_floats()),
                                  std::vector<float>(s.max_block_floats())};
  detail::copy_into(a.k, s.block.keys(blocks[0].data(), local.k_rows));
  detail::copy_into(a.v, s.block.values(blocks[0].data(), local.k_rows));
  // One call's partial result, sized for the largest call.
  std::vector<float> part_out(static_cast<std::size_t>(batch * q_rows * s.q_heads * local.v_dim));
  std::vector<float> part_lse(static_cast<std::size_t>(batch * s.q_heads * q_rows));

  std::vector<MPI_Request> requests;
  int current = 0;
  for (int step = 0; step < s.world; ++step) {
    const int owner = ring_kv_owner(s.world, s.rank, step);
    const int64_t k_rows = s.k_rows[owner];
    if (step + 1 < s.world) {
      const int64_t next_rows = s.k_rows[ring_kv_owner(s.world, s.rank, step + 1)];
      detail::post_recv(blocks[1 - current].data(), s.block.floats(next_rows), s.prev,
                        detail::kTagKeysValues, comm, requests);
      detail::post_send(blocks[current].data(), s.block.floats(k_rows), s.next,
                        detail::kTagKeysValues, comm, requests);
    }
    const View4<const float> keys = s.block.keys(blocks[current].data(), k_rows);
    const View4<const float> values = s.block.values(blocks[current].data(), k_rows);
    std::vector<BlockCall> pieces;
    for (const BlockCall& call : ring_block_calls(s.problem, s.rank, owner))
      for (const BlockCall& piece : split_queries(call, ring.progress_rows)) pieces.push_back(piece);
    for (const BlockCall& call : pieces) {
      const int64_t b = call.batch_end - call.batch_begin, n = call.q_end - call.q_begin;
      const auto out_view = View4<float>::contiguous(part_out.data(), {b, n, s.q_heads, local.v_dim});
      const auto lse_view = View3<float>::contiguous(part_lse.data(), {b, s.q_heads, n});
      AttentionOptions call_options = s.call_options;
      call_options.causal = call.causal;
      attention_forward({.q = detail::rows(a.q, call.batch_begin, call.batch_end, call.q_begin, call.q_end),
                         .k = detail::rows(keys, call.batch_begin, call.batch_end, call.k_begin, call.k_end),
                         .v = detail::rows(values, call.batch_begin, call.batch_end, call.k_begin, call.k_end),
                         .out = out_view, .lse = lse_view},
                        call_options);
      merge_partials(detail::rows(a.out, call.batch_begin, call.batch_end, call.q_begin, call.q_end),
                     detail::lse_rows(lse, call.batch_begin, call.batch_end, call.q_begin, call.q_end),
                     out_view, lse_view);
      detail::poke_progress(requests);
    }
    detail::wait_all(requests);
    current = 1 - current;
  }
}

}  // namespace qkv::dist
