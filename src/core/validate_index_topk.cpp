// Validation of qkv::index_topk: every argument checked, with the library's Checker and
// the attention entry points' wording, before anything is written.
#include <algorithm>
#include <cstdint>
#include <string>

#include "core/attention_rules.hpp"
#include "core/index_topk_problem.hpp"

namespace qkv::detail {
namespace {

// The options index_topk has no use for: refused rather than ignored, so a caller never
// believes a mask or a window took part in the selection.
void refuse_unused_options(const Checker& check, const AttentionOptions& options) {
  auto refuse = [&](bool given, const char* name) {
    if (given) check.fail(std::string(name) + ": not supported by index_topk (it takes scale, causal, "
                                              "key_lengths and execution only)");
  };
  refuse(!options.mask.empty(), "options.mask");
  refuse(options.window.active(), "options.window");
  refuse(!options.alibi_slopes.empty(), "options.alibi_slopes");
  refuse(options.softcap != 0.0f, "options.softcap");
  refuse(!options.sinks.empty(), "options.sinks");
  refuse(options.dropout.p != 0.0f, "options.dropout");
  refuse(options.modifiers.active(), "options.modifiers");
}

}  // namespace

template <class T>
IndexTopkProblem<T> validate_index_topk(const IndexTopkArgs<T>& args, const AttentionOptions& options) {
  const Checker check("qkv::index_topk");
  const Described q = describe("q", args.q), k = describe("k", args.k),
                  weights = describe("weights", args.weights), indices = describe("indices", args.indices);
  for (const Described* view : {&q, &k, &weights, &indices}) check.expect_well_formed(*view);
  check.expect_at_least_one(q, 2, "heads");
  check.expect_at_least_one(q, 3, "head_dim");
  check.expect_extent(k, 0, "batch", q.shape[0], "as q.shape[0]");
  check.expect_extent(k, 2, "head_dim", q.shape[3], "as q.shape[3]");
  check.expect_extent(weights, 0, "batch", q.shape[0], "as q.shape[0]");
  check.expect_extent(weights, 1, "seq", q.shape[1], "as q.shape[1]");
  check.expect_extent(weights, 2, "heads", q.shape[2], "as q.shape[2]");
  check.expect_extent(indices, 0, "batch", q.shape[0], "as q.shape[0]");
  check.expect_extent(indices, 1, "seq", q.shape[1], "as q.shape[1]");
  for (const Described* view : {&q, &k}) {
    if (view->shape[1] > kMaxRows) {
      check.fail(view->name + ".shape[1] (seq): expected at most " + std::to_string(kMaxRows) +
                 " rows (qkv indexes keys with 32-bit integers), got " + std::to_string(view->shape[1]));
    }
  }
  check.expect_outputs_apart(DescribedList<1>{indices}, DescribedList<3>{q, k, weights});

  IndexTopkProblem<T> problem;
  problem.args = args;
  problem.batch = q.shape[0];
  problem.q_len = q.shape[1];
  problem.heads = q.shape[2];
  problem.head_dim = q.shape[3];
  problem.k_len = k.shape[1];
  problem.topk = indices.shape[2];

  refuse_unused_options(check, options);
  problem.mask.causal = checked_causal(check, options);
  problem.mask.sequences.count = problem.batch;
  problem.mask.sequences.dense_q_len = problem.q_len;
  problem.mask.sequences.dense_k_len = problem.k_len;
  check_key_lengths(check, options.key_lengths, problem.batch, problem.k_len);
  problem.mask.key_lengths = options.key_lengths;
  if (options.execution.check_finite) {
    check.expect_finite<T>(q);
    check.expect_finite<T>(k);
    check.expect_finite<IndexWeightOf<T>>(weights);
  }
  check_backend(check, options, std::is_same_v<T, double>, /*wants_weights=*/false);
  problem.scale = resolve_scale(check, options, problem.head_dim);
  problem.threads = resolve_threads(check, options);
  return problem;
}

template <class T>
IndexTopkProblem<T> validate_index_topk_cache(const KvSource& cache, const IndexCacheShape& shape,
                                              const IndexTopkArgs<T>& args, const AttentionOptions& options) {
  const Checker check("qkv::KVCache::index_topk");
  if (shape.kv_heads != 1) {
    check.fail("the cache has config.kv_heads = " + std::to_string(shape.kv_heads) +
               ": the indexer's keys are one key per token (a cache with kv_heads = 1)");
  }
  const Described q = describe("q", args.q), weights = describe("weights", args.weights),
                  indices = describe("indices", args.indices);
  for (const Described* view : {&q, &weights, &indices}) check.expect_well_formed(*view);
  check.expect_extent(q, 0, "batch", shape.batch, "the cache's batch");
  check.expect_at_least_one(q, 2, "heads");
  check.expect_extent(q, 3, "head_dim", shape.head_dim, "the cache's head_dim");
  check.expect_extent(weights, 0, "batch", q.shape[0], "as q.shape[0]");
  check.expect_extent(weights, 1, "seq", q.shape[1], "as q.shape[1]");
  check.expect_extent(weights, 2, "heads", q.shape[2], "as q.shape[2]");
  check.expect_extent(indices, 0, "batch", q.shape[0], "as q.shape[0]");
  check.expect_extent(indices, 1, "seq", q.shape[1], "as q.shape[1]");
  if (q.shape[1] > kMaxRows) {
    check.fail("q.shape[1] (seq): expected at most " + std::to_string(kMaxRows) +
               " rows (qkv indexes keys with 32-bit integers), got " + std::to_string(q.shape[1]));
  }
  check.expect_outputs_apart(DescribedList<1>{indices}, DescribedList<2>{q, weights});
  if (!options.key_lengths.empty()) {
    check.fail("options.key_lengths: not taken (each sequence's cache length is its key length)");
  }
  refuse_unused_options(check, options);

  IndexTopkProblem<T> problem;
  problem.args = args;
  problem.args.k = {};
  problem.cache = &cache;
  problem.batch = q.shape[0];
  problem.q_len = q.shape[1];
  problem.heads = q.shape[2];
  problem.head_dim = q.shape[3];
  problem.topk = indices.shape[2];
  // The longest sequence bounds every row's keys: the work is planned over it, not the capacity.
  for (const int64_t length : shape.lengths) problem.k_len = std::max(problem.k_len, length);
  if (problem.k_len > kMaxRows) {
    check.fail("the cache holds " + std::to_string(problem.k_len) +
               " keys in a sequence; qkv indexes keys with 32-bit integers (at most " + std::to_string(kMaxRows) + ")");
  }
  problem.mask.causal = checked_causal(check, options);
  problem.mask.sequences.count = problem.batch;
  problem.mask.sequences.dense_q_len = problem.q_len;
  problem.mask.sequences.dense_k_len = problem.k_len;
  problem.mask.key_lengths = shape.lengths;
  if (options.execution.check_finite) {
    check.expect_finite<T>(q);
    check.expect_finite<float>(weights);
  }
  check_backend(check, options, /*is_double=*/false, /*wants_weights=*/false);
  problem.scale = resolve_scale(check, options, problem.head_dim);
  problem.threads = resolve_threads(check, options);
  return problem;
}

template IndexTopkProblem<float> validate_index_topk(const IndexTopkArgs<float>&, const AttentionOptions&);
template IndexTopkProblem<double> validate_index_topk(const IndexTopkArgs<double>&, const AttentionOptions&);
template IndexTopkProblem<bfloat16> validate_index_topk(const IndexTopkArgs<bfloat16>&, const AttentionOptions&);
template IndexTopkProblem<float16> validate_index_topk(const IndexTopkArgs<float16>&, const AttentionOptions&);

template IndexTopkProblem<float> validate_index_topk_cache(const KvSource&, const IndexCacheShape&,
                                                           const IndexTopkArgs<float>&, const AttentionOptions&);
template IndexTopkProblem<bfloat16> validate_index_topk_cache(const KvSource&, const IndexCacheShape&,
                                                              const IndexTopkArgs<bfloat16>&,
                                                              const AttentionOptions&);

}  // namespace qkv::detail
