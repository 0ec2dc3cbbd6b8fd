// Ring attention backward (qkv/dist.hpp).
//
// With the forward's global out and lse, P_ij = exp(scale·q_i·k_j − lse_i) is exact for
// any block of keys, and so is attention_backward's dS = P ⊙ (dP − ⟨dO, O⟩) on it: a block
// call on (local Q rows, visiting K/V rows) gives exact partial dQ (summed over the
// block's keys) and partial dK, dV (summed over the local queries).
//
// Step s of W, holding the K/V block of rank o = (r − s) mod W:
//   1. post the K/V transfer for step s+1 (as in the forward) and, from step 1 on, the
//      receive of block o's dK/dV accumulated by the ranks it visited before;
//   2. run the block calls: dQ rows += partial dQ; this step's dK/dV (from zero) += partial;
//   3. add the received dK/dV, send the sum on to the next rank.
// After W steps the next rank is the owner: each rank receives its own dK/dV, complete.
// dK/dV make W hops, K/V W−1; each transfer overlaps a step's compute.
#include <algorithm>
#include <array>
#include <vector>

#include "blocks.hpp"
#include "check/checker.hpp"
#include "messages.hpp"
#include "qkv/dist.hpp"
#include "qkv/error.hpp"
#include "ring_setup.hpp"

namespace qkv::dist {
namespace {

constexpr const char* kFunction = "qkv::dist::ring_attention_backward";

void check_local(const BackwardArgs<float>& a, const AttentionOptions& options, const RingOptions& ring) {
  const qkv::detail::Checker check(kFunction);
  detail::check_ring_options(check, options, ring);
  using qkv::detail::describe;
  // The inputs, lse last (its check_finite allows −inf), then the outputs.
  const std::array inputs{describe("q", a.q),     describe("k", a.k),       describe("v", a.v),
                          describe("out", a.out), describe("dout", a.dout), describe("lse", a.lse)};
  const std::array outputs{describe("dq", a.dq), describe("dk", a.dk), describe("dv", a.dv)};
  for (const auto& view : inputs) check.expect_well_formed(view);
  for (const auto& view : outputs) check.expect_well_formed(view);
  if (a.lse.empty() && a.q.numel() > 0) check.fail("lse: required (the forward's log-sum-exp)");
  // Heads, head dims, batch, GQA and options: the library's own checks, on no rows.
  AttentionOptions probe = options;
  probe.key_lengths = {};
  probe.execution.check_finite = false;
  auto none = [](const auto& view) { return detail::rows(view, 0, view.shape[0], 0, 0); };
  attention_backward({.q = none(a.q), .k = none(a.k), .v = none(a.v), .out = none(a.out),
                      .lse = detail::lse_rows(a.lse, 0, a.lse.shape[0], 0, 0), .dout = none(a.dout),
                      .dq = none(a.dq), .dk = none(a.dk), .dv = none(a.dv)},
                     probe);
  // Sequence lengths, which the probe cannot see.
  const int64_t q_rows = a.q.shape[1], k_rows = a.k.shape[1];
  check.expect_extent(inputs[2], 1, "seq", k_rows, "as k.shape[1]");
  check.expect_extent(inputs[3], 1, "seq", q_rows, "as q.shape[1]");
  check.expect_extent(inputs[4], 1, "seq", q_rows, "as q.shape[1]");
  check.expect_extent(inputs[5], 2, "seq", q_rows, "as q.shape[1]");
  check.expect_extent(outputs[0], 1, "seq", q_rows, "as q.shape[1]");
  check.expect_extent(outputs[1], 1, "seq", k_rows, "as k.shape[1]");
  check.expect_extent(outputs[2], 1, "seq", k_rows, "as k.shape[1]");
  check.expect_outputs_apart(outputs, inputs);
  if (options.execution.check_finite) {
    for (const auto& view : inputs)
      check.expect_finite<float>(view, /*allow_minus_inf=*/view.name == "lse", "local index");
  }
}

}  // namespace

void ring_attention_backward(const BackwardArgs<float>& a, const AttentionOptions& options,
                             MPI_Comm comm, const RingOptions& ring) {
  const detail::LocalExtents local{.batch = a.q.shape[0], .q_rows = a.q.shape[1], .k_rows = a.k.shape[1],
                                   .q_heads = a.q.shape[2], .kv_heads = a.k.shape[2],
                                   .dim = a.q.shape[3], .v_dim = a.v.shape[3]};
  const detail::RingSetup s =
      detail::setup_ring(kFunction, local, options, comm, ring, [&] { check_local(a, options, ring); });
  const int64_t batch = local.batch, q_rows = local.q_rows, kv_heads = local.kv_heads;
  const std::size_t block_floats = static_cast<std::size_t>(s.max_block_floats());

  detail::fill(a.dq, 0.0f);
  // K/V: computed on and being received. dK/dV: this step's sum, the one arriving, the
  // one leaving (still in flight while the next step computes).
  std::vector<float> blocks[2] = {std::vector<float>(block_floats), std::vector<float>(block_floats)};
  std::vector<float> grads_mine(block_floats), grads_in(block_floats), grads_out(block_floats);
  detail::copy_into(a.k, s.block.keys(blocks[0].data(), local.k_rows));
  detail::copy_into(a.v, s.block.values(blocks[0].data(), local.k_rows));
  // One call's partial gradients, sized for the largest call.
  std::vector<float> part_dq(static_cast<std::size_t>(batch * q_rows * s.q_heads * local.dim));
  std::vector<float> part_dk(static_cast<std::size_t>(batch * s.max_k_rows() * kv_heads * local.dim));
  std::vector<float> part_dv(static_cast<std::size_t>(batch * s.max_k_rows() * kv_heads * local.v_dim));

  std::vector<MPI_Request> block_requests, grad_in_requests, grad_out_requests;
  int current = 0;
  for (int step = 0; step < s.world; ++step) {
    const int owner = ring_kv_owner(s.world, s.rank, step);
    const int64_t k_rows = s.k_rows[owner];
    if (step + 1 < s.world) {
      const int64_t next_rows = s.k_rows[ring_kv_owner(s.world, s.rank, step + 1)];
      detail::post_recv(blocks[1 - current].data(), s.block.floats(next_rows), s.prev,
                        detail::kTagKeysValues, comm, block_requests);
      detail::post_send(blocks[current].data(), s.block.floats(k_rows), s.next,
                        detail::kTagKeysValues, comm, block_requests);
    }
    if (step >= 1) {
      detail::post_recv(grads_in.data(), s.block.floats(k_rows), s.prev, detail::kTagGradients, comm,
                        grad_in_requests);
    }
    const View4<const float> keys = s.block.keys(blocks[current].data(), k_rows);
    const View4<const float> values = s.block.values(blocks[current].data(), k_rows);
    const View4<float> dkeys = s.block.keys(grads_mine.data(), k_rows);
    const View4<float> dvalues = s.block.values(grads_mine.data(), k_rows);
    std::fill_n(grads_mine.begin(), s.block.floats(k_rows), 0.0f);

    std::vector<BlockCall> pieces;
    for (const BlockCall& call : ring_block_calls(s.problem, s.rank, owner))
      for (const BlockCall& piece : split_queries(call, ring.progress_rows)) pieces.push_back(piece);
    for (const BlockCall& call : pieces) {
      const int64_t b0 = call.batch_begin, b1 = call.batch_end, b = b1 - b0;
      const int64_t q0 = call.q_begin, q1 = call.q_end, k0 = call.k_begin, k1 = call.k_end;
      const auto dq_view = View4<float>::contiguous(part_dq.data(), {b, q1 - q0, s.q_heads, local.dim});
      const auto dk_view = View4<float>::contiguous(part_dk.data(), {b, k1 - k0, kv_heads, local.dim});
      const auto dv_view = View4<float>::contiguous(part_dv.data(), {b, k1 - k0, kv_heads, local.v_dim});
      AttentionOptions call_options = s.call_options;
      call_options.causal = call.causal;
      attention_backward({.q = detail::rows(a.q, b0, b1, q0, q1), .k = detail::rows(keys, b0, b1, k0, k1),
                          .v = detail::rows(values, b0, b1, k0, k1), .out = detail::rows(a.out, b0, b1, q0, q1),
                          .lse = detail::lse_rows(a.lse, b0, b1, q0, q1),
                          .dout = detail::rows(a.dout, b0, b1, q0, q1),
                          .dq = dq_view, .dk = dk_view, .dv = dv_view},
                         call_options);
      detail::add_into(dq_view, detail::rows(a.dq, b0, b1, q0, q1));
      detail::add_into(dk_view, detail::rows(dkeys, b0, b1, k0, k1));
      detail::add_into(dv_view, detail::rows(dvalues, b0, b1, k0, k1));
      detail::poke_progress(block_requests);
      detail::poke_progress(grad_out_requests);
    }

    if (step >= 1) {  // add what the ranks before us accumulated for this block
      detail::wait_all(grad_in_requests);
      const auto n = static_cast<std::size_t>(s.block.floats(k_rows));
      for (std::size_t i = 0; i < n; ++i) grads_mine[i] += grads_in[i];
    }
    detail::wait_all(grad_out_requests);  // the previous step's send has left grads_out
    std::swap(grads_mine, grads_out);
    if (s.world > 1) {
      detail::post_send(grads_out.data(), s.block.floats(k_rows), s.next, detail::kTagGradients, comm,
                        grad_out_requests);
    }
    detail::wait_all(block_requests);
    current = 1 - current;
  }

  // Our own block's dK/dV, complete: from the previous rank after its last step, or, on
  // one rank, the sum we just made.
  std::vector<float>* own = &grads_out;
  if (s.world > 1) {
    detail::post_recv(grads_in.data(), s.block.floats(local.k_rows), s.prev, detail::kTagGradients,
                      comm, grad_in_requests);
    detail::wait_all(grad_in_requests);
    own = &grads_in;
  }
  detail::copy_into(s.block.keys(own->data(), local.k_rows), a.dk);
  detail::copy_into(s.block.values(own->data(), local.k_rows), a.dv);
  detail::wait_all(grad_out_requests);
}

}  // namespace qkv::dist
