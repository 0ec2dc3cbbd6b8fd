#include "core/validate.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "core/attention_rules.hpp"
#include "core/validate_stats.hpp"
#include "qkv/error.hpp"

namespace qkv::detail {
namespace {
// Checks q, k, v against each other and the options shared by forward and backward;
// fills the problem's extents, the mask rule (broadcast axes given stride 0) and the
// score modifiers.
template <class T, class Problem>
void check_common(const Checker& check, const View4<const T>& q, const View4<const T>& k,
                  const View4<const T>& v, const AttentionOptions& options, Problem& problem) {
  Extents& extents = problem.extents;
  MaskRule& mask = problem.mask;
  const Described dq = describe("q", q), dk = describe("k", k), dv = describe("v", v);
  for (const Described* view : {&dq, &dk, &dv}) check.expect_well_formed(*view);

  check.expect_at_least_one(dq, 2, "heads");
  check.expect_at_least_one(dq, 3, "head_dim");
  check.expect_extent(dk, 0, "batch", q.shape[0], "as q.shape[0]");
  check.expect_extent(dk, 3, "head_dim", q.shape[3], "as q.shape[3]");
  check.expect_at_least_one(dk, 2, "heads");
  check.expect_extent(dv, 0, "batch", q.shape[0], "as q.shape[0]");
  check.expect_extent(dv, 1, "seq", k.shape[1], "as k.shape[1]");
  check.expect_extent(dv, 2, "heads", k.shape[2], "as k.shape[2]");
  check.expect_at_least_one(dv, 3, "head_dim");
  check_head_groups(check, dq, dk, 2);

  for (const Described* view : {&dq, &dk}) {
    if (view->shape[1] > kMaxRows) {
      check.fail(view->name + ".shape[1] (seq): expected at most " + std::to_string(kMaxRows) +
                 " rows (qkv indexes keys with 32-bit integers), got " +
                 std::to_string(view->shape[1]));
    }
  }
  extents.batch = q.shape[0];
  extents.q_len = q.shape[1];
  extents.q_heads = q.shape[2];
  extents.head_dim = q.shape[3];
  extents.k_len = k.shape[1];
  extents.kv_heads = k.shape[2];
  extents.v_dim = v.shape[3];

  mask.causal = checked_causal(check, options);
  mask.sequences.count = extents.batch;
  mask.sequences.dense_q_len = extents.q_len;
  mask.sequences.dense_k_len = extents.k_len;

  check_key_lengths(check, options.key_lengths, extents.batch, extents.k_len);
  mask.key_lengths = options.key_lengths;

  auto broadcast = [&](auto view, const char* name) {
    const Described desc = describe(name, view);
    check.expect_well_formed(desc);
    check.expect_extent_or_one(desc, 0, "batch", extents.batch, "q.shape[0]");
    check.expect_extent_or_one(desc, 1, "heads", extents.q_heads, "q.shape[2]");
    check.expect_extent_or_one(desc, 2, "queries", extents.q_len, "q.shape[1]");
    check.expect_extent(desc, 3, "keys", extents.k_len, "k.shape[1]");
    const int64_t full[4] = {extents.batch, extents.q_heads, extents.q_len, extents.k_len};
    for (int axis = 0; axis < 4; ++axis) {
      if (view.shape[axis] == 1 && full[axis] != 1) view.strides[axis] = 0;
      view.shape[axis] = full[axis];
    }
    return view;
  };
  if (!options.mask.keep.empty()) mask.keep = broadcast(options.mask.keep, "mask.keep");
  if (!options.mask.bias.empty()) mask.bias = broadcast(options.mask.bias, "mask.bias");

  if (options.execution.check_finite) {
    check.expect_finite<T>(dq);
    check.expect_finite<T>(dk);
    check.expect_finite<T>(dv);
    if (!options.mask.bias.empty())
      check.expect_finite<float>(describe("mask.bias", options.mask.bias),
                                 /*allow_minus_inf=*/true);
  }
  check_variants(check, options, extents, mask, problem.modifiers);
}

// The log-sum-exp [B, Hq, Nq] that the forward writes and the backward reads.
template <class L>
Described checked_lse(const Checker& check, const View3<L>& view, const Extents& e) {
  const Described lse = describe("lse", view);
  if (!view.empty()) {
    check.expect_well_formed(lse);
    check.expect_extent(lse, 0, "batch", e.batch, "as q.shape[0]");
    check.expect_extent(lse, 1, "heads", e.q_heads, "as q.shape[2]");
    check.expect_extent(lse, 2, "seq", e.q_len, "as q.shape[1]");
  }
  return lse;
}

}  // namespace

template <class T>
ForwardProblem<T> validate(const ForwardArgs<T>& args, const AttentionOptions& options) {
  return validate_as(args, options, "qkv::attention_forward");
}

template <class T>
ForwardProblem<T> validate_as(const ForwardArgs<T>& args, const AttentionOptions& options,
                              std::string_view function) {
  const Checker check(function);
  ForwardProblem<T> problem;
  check_common<T>(check, args.q, args.k, args.v, options, problem);
  const Extents& e = problem.extents;

  const Described out = describe("out", args.out);
  check.expect_well_formed(out);
  check.expect_extent(out, 0, "batch", e.batch, "as q.shape[0]");
  check.expect_extent(out, 1, "seq", e.q_len, "as q.shape[1]");
  check.expect_extent(out, 2, "heads", e.q_heads, "as q.shape[2]");
  check.expect_extent(out, 3, "head_dim", e.v_dim, "as v.shape[3]");

  // out, lse, weights and up to 7 statistics views.
  DescribedList<10> outputs{out};
  if (!args.lse.empty()) outputs.push_back(checked_lse(check, args.lse, e));
  if (!args.weights.empty()) {
    const Described weights = describe("weights", args.weights);
    check.expect_well_formed(weights);
    check.expect_extent(weights, 0, "batch", e.batch, "as q.shape[0]");
    check.expect_extent(weights, 1, "heads", e.q_heads, "as q.shape[2]");
    check.expect_extent(weights, 2, "queries", e.q_len, "as q.shape[1]");
    check.expect_extent(weights, 3, "keys", e.k_len, "as k.shape[1]");
    outputs.push_back(weights);
  }
  if (args.stats != nullptr) {
    check_stats<LseOf<T>, 3>(
        check, *args.stats,
        {{{e.batch, "batch", "as q.shape[0]"}, {e.q_heads, "heads", "as q.shape[2]"}}},
        {{{e.batch, "batch", "as q.shape[0]"},
          {e.q_heads, "heads", "as q.shape[2]"},
          {e.q_len, "seq", "as q.shape[1]"}}},
        outputs);
  }

  DescribedList<5> inputs{describe("q", args.q), describe("k", args.k), describe("v", args.v)};
  if (!options.mask.keep.empty()) inputs.push_back(describe("mask.keep", options.mask.keep));
  if (!options.mask.bias.empty()) inputs.push_back(describe("mask.bias", options.mask.bias));
  check.expect_outputs_apart(outputs, inputs);

  resolve_execution(check, options, !args.weights.empty(), problem);
  problem.args = args;
  problem.args.stats = nullptr;
  if (args.stats != nullptr) {
    problem.stats = *args.stats;
    problem.collect_stats = true;
  }
  return problem;
}

template <class T>
BackwardProblem<T> validate(const BackwardArgs<T>& args, const AttentionOptions& options) {
  return validate_as(args, options, "qkv::attention_backward");
}

template <class T>
BackwardProblem<T> validate_as(const BackwardArgs<T>& args, const AttentionOptions& options,
                               std::string_view function) {
  const Checker check(function);
  BackwardProblem<T> problem;
  check_common<T>(check, args.q, args.k, args.v, options, problem);
  const Extents& e = problem.extents;
  check_variant_gradients(check, options, args.dsinks, args.dalibi_slopes, e.q_heads);

  auto expect_like = [&](const Described& view, int64_t seq, int64_t heads, int64_t dim,
                         const char* like) {
    check.expect_well_formed(view);
    check.expect_extent(view, 0, "batch", e.batch, std::string("as ") + like + ".shape[0]");
    check.expect_extent(view, 1, "seq", seq, std::string("as ") + like + ".shape[1]");
    check.expect_extent(view, 2, "heads", heads, std::string("as ") + like + ".shape[2]");
    check.expect_extent(view, 3, "head_dim", dim, std::string("as ") + like + ".shape[3]");
  };

  const Described out = describe("out", args.out);
  expect_like(out, e.q_len, e.q_heads, e.v_dim, "the forward's out");
  const Described dout = describe("dout", args.dout);
  expect_like(dout, e.q_len, e.q_heads, e.v_dim, "out");
  if (args.lse.empty() && e.batch * e.q_len > 0) {
    check.fail("lse: required (pass the log-sum-exp that attention_forward returned)");
  }
  const Described lse = checked_lse(check, args.lse, e);
  const Described dq = describe("dq", args.dq), dk = describe("dk", args.dk),
                  dv = describe("dv", args.dv);
  expect_like(dq, e.q_len, e.q_heads, e.head_dim, "q");
  expect_like(dk, e.k_len, e.kv_heads, e.head_dim, "k");
  expect_like(dv, e.k_len, e.kv_heads, e.v_dim, "v");

  DescribedList<8> inputs{describe("q", args.q), describe("k", args.k), describe("v", args.v),
                          out, lse, dout};
  if (!options.mask.keep.empty()) inputs.push_back(describe("mask.keep", options.mask.keep));
  if (!options.mask.bias.empty()) inputs.push_back(describe("mask.bias", options.mask.bias));
  check.expect_outputs_apart(std::array{dq, dk, dv}, inputs);
  if (options.execution.check_finite) {
    check.expect_finite<T>(dout);
    check.expect_finite<T>(out);
  }

  resolve_execution(check, options, /*wants_weights=*/false, problem);
  problem.args = args;
  return problem;
}

QKV_INSTANTIATE_VALIDATE(ForwardArgs, BackwardArgs)

#define QKV_INSTANTIATE_VALIDATE_AS(T)                                                   \
  template ForwardProblem<T> validate_as(const ForwardArgs<T>&, const AttentionOptions&,   \
                                         std::string_view);                                \
  template BackwardProblem<T> validate_as(const BackwardArgs<T>&, const AttentionOptions&, \
                                          std::string_view);
QKV_INSTANTIATE_VALIDATE_AS(float)
QKV_INSTANTIATE_VALIDATE_AS(double)
QKV_INSTANTIATE_VALIDATE_AS(bfloat16)
QKV_INSTANTIATE_VALIDATE_AS(float16)
#undef QKV_INSTANTIATE_VALIDATE_AS

}  // namespace qkv::detail
