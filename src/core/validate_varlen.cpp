// Argument checking for the varlen (packed) entry points. The packed [total, heads, dim]
// tensors and their cu_seqlens are checked here; the call then becomes an ordinary
// problem whose batch entries are the sequences, so every backend runs it unchanged.
#include <array>
#include <string>
#include <type_traits>
#include <vector>

#include "core/attention_rules.hpp"
#include "core/validate_stats.hpp"
#include "core/validate.hpp"

namespace qkv::detail {
namespace {

// Reads and checks one cu_seqlens array: starts at 0, never decreases, ends at total.
std::vector<int64_t> checked_offsets(const Checker& check, const SeqOffsets& offsets,
                                     const char* name, int64_t total, int64_t max_seqlen,
                                     int64_t& longest) {
  const std::string n(name);
  if (offsets.size() == 0) {
    check.fail(n + ": expected the prefix sums of the sequence lengths (number of sequences "
                   "+ 1 entries, starting at 0), got an empty array");
  }
  std::vector<int64_t> cu(offsets.size());
  longest = 0;
  for (std::size_t s = 0; s < offsets.size(); ++s) {
    cu[s] = offsets[s];
    if (s == 0 && cu[0] != 0) {
      check.fail(n + "[0]: expected 0 (the first sequence starts at row 0), got " +
                 std::to_string(cu[0]));
    }
    if (s > 0 && cu[s] < cu[s - 1]) {
      check.fail(n + "[" + std::to_string(s) + "]: expected >= " + n + "[" +
                 std::to_string(s - 1) + "] = " + std::to_string(cu[s - 1]) +
                 " (prefix sums never decrease), got " + std::to_string(cu[s]));
    }
    if (cu[s] > total) {
      check.fail(n + "[" + std::to_string(s) + "]: expected <= " + std::to_string(total) +
                 " (the packed tensor's rows), got " + std::to_string(cu[s]));
    }
    if (s > 0) longest = std::max(longest, cu[s] - cu[s - 1]);
  }
  if (cu.back() != total) {
    check.fail(n + "[" + std::to_string(cu.size() - 1) + "]: expected " + std::to_string(total) +
               " (the last entry is the packed tensor's row count), got " +
               std::to_string(cu.back()));
  }
  if (max_seqlen < 0 || (max_seqlen > 0 && max_seqlen < longest)) {
    check.fail(std::string(name == std::string("cu_seqlens_q") ? "max_seqlen_q" : "max_seqlen_k") +
               ": expected 0 (not given) or >= the longest sequence (" + std::to_string(longest) +
               "), got " + std::to_string(max_seqlen));
  }
  return cu;
}

// Checks shared by forward and backward: q, k, v, the options, cu_seqlens; fills the
// problem's extents, mask rule (causal, variants and the sequences) and score modifiers.
template <class T, class Args, class Problem>
void check_varlen_common(const Checker& check, const Args& args, const AttentionOptions& options,
                         Problem& problem) {
  Extents& e = problem.extents;
  MaskRule& mask = problem.mask;
  const Described q = describe("q", args.q), k = describe("k", args.k), v = describe("v", args.v);
  for (const Described* view : {&q, &k, &v}) check.expect_well_formed(*view);
  check.expect_at_least_one(q, 1, "heads");
  check.expect_at_least_one(q, 2, "head_dim");
  check.expect_at_least_one(k, 1, "heads");
  check.expect_extent(k, 2, "head_dim", args.q.shape[2], "as q.shape[2]");
  check.expect_extent(v, 0, "total_k", args.k.shape[0], "as k.shape[0]");
  check.expect_extent(v, 1, "heads", args.k.shape[1], "as k.shape[1]");
  check.expect_at_least_one(v, 2, "head_dim");
  check_head_groups(check, q, k, 1);
  for (const Described* view : {&q, &k}) {
    if (view->shape[0] > kMaxRows) {
      check.fail(view->name + ".shape[0] (total): expected at most " + std::to_string(kMaxRows) +
                 " rows (qkv indexes keys with 32-bit integers), got " +
                 std::to_string(view->shape[0]));
    }
  }
  if (!options.mask.empty()) {
    check.fail("options.mask: not supported by varlen attention (sequences are packed without "
               "padding; use cu_seqlens to cut them, or the dense entry point for a mask)");
  }
  if (!options.key_lengths.empty()) {
    check.fail("options.key_lengths: not supported by varlen attention (cu_seqlens_k already "
               "gives every sequence's key length)");
  }
  int64_t longest_q = 0, longest_k = 0;
  std::vector<int64_t> cu_q = checked_offsets(check, args.cu_seqlens_q, "cu_seqlens_q",
                                              args.q.shape[0], args.max_seqlen_q, longest_q);
  std::vector<int64_t> cu_k = checked_offsets(check, args.cu_seqlens_k, "cu_seqlens_k",
                                              args.k.shape[0], args.max_seqlen_k, longest_k);
  if (cu_q.size() != cu_k.size()) {
    check.fail("cu_seqlens_k: expected " + std::to_string(cu_q.size()) +
               " entries (as cu_seqlens_q: one per sequence + 1), got " +
               std::to_string(cu_k.size()));
  }
  e.batch = static_cast<int64_t>(cu_q.size()) - 1;
  e.q_len = longest_q;
  e.k_len = longest_k;
  e.q_heads = args.q.shape[1];
  e.kv_heads = args.k.shape[1];
  e.head_dim = args.q.shape[2];
  e.v_dim = args.v.shape[2];
  mask.causal = checked_causal(check, options);
  mask.sequences.count = e.batch;
  mask.sequences.cu_q = std::move(cu_q);
  mask.sequences.cu_k = std::move(cu_k);

  if (options.execution.check_finite) {
    check.expect_finite<T>(q);
    check.expect_finite<T>(k);
    check.expect_finite<T>(v);
  }
  check_variants(check, options, e, mask, problem.modifiers);
}

// The packed log-sum-exp [Hq, total_q] that the forward writes and the backward reads.
template <class L>
Described checked_lse(const Checker& check, const TensorView<L, 2>& view, const Extents& e,
                      int64_t total_q) {
  const Described lse = describe("lse", view);
  if (!view.empty()) {
    check.expect_well_formed(lse);
    check.expect_extent(lse, 0, "heads", e.q_heads, "as q.shape[1]");
    check.expect_extent(lse, 1, "total_q", total_q, "as q.shape[0]");
  }
  return lse;
}

// The packed views a forward and a backward share, seen as batched ones.
template <class Batched, class Packed>
void batch_views(Batched& to, const Packed& from, int64_t sequences) {
  to.q = as_batched(from.q, sequences);
  to.k = as_batched(from.k, sequences);
  to.v = as_batched(from.v, sequences);
  to.out = as_batched(from.out, sequences);
  if (!from.lse.empty()) to.lse = lse_as_batched(from.lse, sequences);
}

}  // namespace

template <class T>
ForwardProblem<T> validate(const VarlenForwardArgs<T>& args, const AttentionOptions& options) {
  const Checker check("qkv::varlen_attention_forward");
  ForwardProblem<T> problem;
  check_varlen_common<T>(check, args, options, problem);
  const Extents& e = problem.extents;
  const int64_t total_q = args.q.shape[0];

  const Described out = describe("out", args.out);
  check.expect_well_formed(out);
  check.expect_extent(out, 0, "total_q", total_q, "as q.shape[0]");
  check.expect_extent(out, 1, "heads", e.q_heads, "as q.shape[1]");
  check.expect_extent(out, 2, "head_dim", e.v_dim, "as v.shape[2]");
  std::vector<Described> outputs{out};
  if (!args.lse.empty()) outputs.push_back(checked_lse(check, args.lse, e, total_q));
  if (args.stats != nullptr) {
    check_stats<LseOf<T>, 2>(check, *args.stats,
                             {{{e.batch, "sequences", "as cu_seqlens_q.size() - 1"},
                               {e.q_heads, "heads", "as q.shape[1]"}}},
                             {{{e.q_heads, "heads", "as q.shape[1]"},
                               {total_q, "total_q", "as q.shape[0]"}}},
                             outputs);
  }
  check.expect_outputs_apart(
      outputs, std::array{describe("q", args.q), describe("k", args.k), describe("v", args.v)});
  resolve_execution(check, options, /*wants_weights=*/false, problem);
  batch_views(problem.args, args, e.batch);
  if (args.stats != nullptr) {
    const VarlenAttentionStats<LseOf<T>>& stats = *args.stats;
    problem.stats.max_weight_mean = stats.max_weight_mean;
    problem.stats.max_weight_max = stats.max_weight_max;
    problem.stats.entropy_mean = stats.entropy_mean;
    problem.stats.saturated_share = stats.saturated_share;
    problem.stats.rows = stats.rows;
    // Per-row views are laid out like the lse: [Hq, total_q] seen as [sequences, Hq, total_q].
    if (!stats.row_max_weight.empty())
      problem.stats.row_max_weight = lse_as_batched(stats.row_max_weight, e.batch);
    if (!stats.row_entropy.empty())
      problem.stats.row_entropy = lse_as_batched(stats.row_entropy, e.batch);
    problem.stats.saturation_threshold = stats.saturation_threshold;
    problem.collect_stats = true;
  }
  return problem;
}

template <class T>
BackwardProblem<T> validate(const VarlenBackwardArgs<T>& args, const AttentionOptions& options) {
  const Checker check("qkv::varlen_attention_backward");
  BackwardProblem<T> problem;
  check_varlen_common<T>(check, args, options, problem);
  const Extents& e = problem.extents;
  check_variant_gradients(check, options, args.dsinks, args.dalibi_slopes, e.q_heads);
  const int64_t total_q = args.q.shape[0], total_k = args.k.shape[0];

  auto expect_like = [&](const Described& view, int64_t rows, int64_t heads, int64_t dim,
                         const char* like) {
    check.expect_well_formed(view);
    check.expect_extent(view, 0, "total", rows, std::string("as ") + like + ".shape[0]");
    check.expect_extent(view, 1, "heads", heads, std::string("as ") + like + ".shape[1]");
    check.expect_extent(view, 2, "head_dim", dim, std::string("as ") + like + ".shape[2]");
  };
  const Described out = describe("out", args.out), dout = describe("dout", args.dout);
  expect_like(out, total_q, e.q_heads, e.v_dim, "the forward's out");
  expect_like(dout, total_q, e.q_heads, e.v_dim, "out");
  if (args.lse.empty() && total_q > 0) {
    check.fail("lse: required (pass the log-sum-exp that varlen_attention_forward returned)");
  }
  const Described lse = checked_lse(check, args.lse, e, total_q);
  const Described dq = describe("dq", args.dq), dk = describe("dk", args.dk),
                  dv = describe("dv", args.dv);
  expect_like(dq, total_q, e.q_heads, e.head_dim, "q");
  expect_like(dk, total_k, e.kv_heads, e.head_dim, "k");
  expect_like(dv, total_k, e.kv_heads, e.v_dim, "v");
  check.expect_outputs_apart(std::array{dq, dk, dv},
                             std::array{describe("q", args.q), describe("k", args.k),
                                        describe("v", args.v), out, lse, dout});
  if (options.execution.check_finite) {
    check.expect_finite<T>(dout);
    check.expect_finite<T>(out);
  }
  resolve_execution(check, options, /*wants_weights=*/false, problem);
  batch_views(problem.args, args, e.batch);
  problem.args.dout = as_batched(args.dout, e.batch);
  problem.args.dq = as_batched(args.dq, e.batch);
  problem.args.dk = as_batched(args.dk, e.batch);
  problem.args.dv = as_batched(args.dv, e.batch);
  problem.args.dsinks = args.dsinks;
  problem.args.dalibi_slopes = args.dalibi_slopes;
  return problem;
}

QKV_INSTANTIATE_VALIDATE(VarlenForwardArgs, VarlenBackwardArgs)

}  // namespace qkv::detail
