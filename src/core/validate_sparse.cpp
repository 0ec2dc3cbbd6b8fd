// Argument checking for sparse attention (qkv/sparse.hpp): the dense call's checks with
// the sparse entry point's name, the options sparse attention does not take refused by
// name, then the key lists — shape, and every index in [−1, Nk) — before anything is
// written.
#include "core/validate_sparse.hpp"

#include <array>
#include <span>
#include <string>

#include "core/attention_rules.hpp"
#include "core/validate.hpp"

namespace qkv::detail {
namespace {

constexpr const char* kForwardName = "qkv::sparse_attention_forward";
constexpr const char* kBackwardName = "qkv::sparse_attention_backward";

// What the key lists replace or what no sparse kernel applies: refused, never ignored.
void refuse_unsupported(const Checker& check, const AttentionOptions& options) {
  const auto refuse = [&](const char* option, const char* instead) {
    check.fail(std::string(option) + ": not supported by sparse attention (" + instead + ")");
  };
  if (!options.mask.empty()) refuse("options.mask", "the key lists select the keys: drop masked keys from them");
  if (!options.key_lengths.empty()) refuse("options.key_lengths", "list only valid keys, or -1");
  if (options.window.active()) refuse("options.window", "list only the window's keys");
  if (!options.alibi_slopes.empty()) refuse("options.alibi_slopes", "use the dense attention");
  if (options.dropout.p != 0.0f) refuse("options.dropout", "use the dense attention");
  if (options.modifiers.score.active()) refuse("options.modifiers.score", "use the dense attention");
  if (options.modifiers.mask.active()) refuse("options.modifiers.mask", "the key lists select the keys");
}

// The lists as the caller passed them: [B, Nq, topk] or [B, Hkv, Nq, topk].
template <class I>
Described described_indices(const TensorView<const I, 4>& view, bool shared) {
  if (!shared) return describe("indices", view);
  return describe("indices", TensorView<const I, 3>(view.data, {view.shape[0], view.shape[2], view.shape[3]},
                                                    {view.strides[0], view.strides[2], view.strides[3]}));
}

// Every index in [−1, Nk); the first one that is not names its batch entry and row.
template <class I>
void expect_indices_in_range(const Checker& check, const TensorView<const I, 4>& view, bool shared,
                             int64_t k_len) {
  for (int64_t b = 0; b < view.shape[0]; ++b)
    for (int64_t list = 0; list < view.shape[1]; ++list)
      for (int64_t i = 0; i < view.shape[2]; ++i)
        for (int64_t t = 0; t < view.shape[3]; ++t) {
          const auto j = static_cast<int64_t>(view(b, list, i, t));
          if (j >= -1 && j < k_len) continue;
          const std::string at = shared ? std::to_string(b) + ", " + std::to_string(i) + ", " + std::to_string(t)
                                        : std::to_string(b) + ", " + std::to_string(list) + ", " +
                                              std::to_string(i) + ", " + std::to_string(t);
          check.fail("indices[" + at + "] (batch " + std::to_string(b) + ", query row " + std::to_string(i) +
                     "): expected -1 (no key) or 0.." + std::to_string(k_len - 1) + " (k.shape[1] = " +
                     std::to_string(k_len) + "), got " + std::to_string(j));
        }
}

template <class I>
KeySelection checked_view(const Checker& check, const KeyIndices& indices, const TensorView<const I, 4>& view,
                          const Extents& e, std::span<const Described> outputs) {
  const bool shared = indices.shared_by_heads();
  const Described d = described_indices(view, shared);
  check.expect_well_formed(d, /*inner_contiguous=*/false);
  check.expect_extent(d, 0, "batch", e.batch, "as q.shape[0]");
  if (shared) {
    check.expect_extent(d, 1, "queries", e.q_len, "as q.shape[1]");
  } else {
    check.expect_extent(d, 1, "heads", e.kv_heads, "as k.shape[2], the key/value heads");
    check.expect_extent(d, 2, "queries", e.q_len, "as q.shape[1]");
  }
  check.expect_outputs_apart(outputs, std::array{d});
  expect_indices_in_range(check, view, shared, e.k_len);
  return KeySelection{indices, view.shape[1], view.shape[3]};
}

// `outputs`: the call's outputs, none of which may overlap the lists.
KeySelection checked_selection(const Checker& check, const KeyIndices& indices, const Extents& e,
                               std::span<const Described> outputs) {
  if (indices.empty()) {
    check.fail("indices: required, [B, Nq, topk] or [B, Hkv, Nq, topk] of int32 or int64");
  }
  if (indices.packed()) {
    check.fail("indices: expected [B, Nq, topk] or [B, Hkv, Nq, topk], got packed [total_q, topk] lists "
               "(qkv::BatchPlan::run's form)");
  }
  return indices.is_int64() ? checked_view(check, indices, indices.int64_view(), e, outputs)
                            : checked_view(check, indices, indices.int32_view(), e, outputs);
}

}  // namespace

template <class T>
SparseForwardProblem<T> validate(const SparseForwardArgs<T>& args, const AttentionOptions& options) {
  const Checker check(kForwardName);
  refuse_unsupported(check, options);
  ForwardArgs<T> dense{.q = args.q, .k = args.k, .v = args.v, .out = args.out, .lse = args.lse};
  SparseForwardProblem<T> problem{validate_as(dense, options, kForwardName), {}};
  DescribedList<2> outputs{describe("out", args.out)};
  if (!args.lse.empty()) outputs.push_back(describe("lse", args.lse));
  problem.keys = checked_selection(check, args.indices, problem.dense.extents, outputs);
  return problem;
}

template <class T>
SparseBackwardProblem<T> validate(const SparseBackwardArgs<T>& args, const AttentionOptions& options) {
  const Checker check(kBackwardName);
  refuse_unsupported(check, options);
  BackwardArgs<T> dense{.q = args.q, .k = args.k, .v = args.v, .out = args.out, .lse = args.lse,
                        .dout = args.dout, .dq = args.dq, .dk = args.dk, .dv = args.dv,
                        .dsinks = args.dsinks, .dalibi_slopes = {}};
  SparseBackwardProblem<T> problem{validate_as(dense, options, kBackwardName), {}};
  const Extents& e = problem.dense.extents;
  const DescribedList<3> gradients{describe("dq", args.dq), describe("dk", args.dk), describe("dv", args.dv)};
  problem.keys = checked_selection(check, args.indices, e, gradients);
  return problem;
}

#define QKV_INSTANTIATE_VALIDATE_SPARSE(T)                                                              \
  template SparseForwardProblem<T> validate(const SparseForwardArgs<T>&, const AttentionOptions&); \
  template SparseBackwardProblem<T> validate(const SparseBackwardArgs<T>&, const AttentionOptions&);
QKV_INSTANTIATE_VALIDATE_SPARSE(float)
QKV_INSTANTIATE_VALIDATE_SPARSE(double)
QKV_INSTANTIATE_VALIDATE_SPARSE(bfloat16)
QKV_INSTANTIATE_VALIDATE_SPARSE(float16)
#undef QKV_INSTANTIATE_VALIDATE_SPARSE

}  // namespace qkv::detail
