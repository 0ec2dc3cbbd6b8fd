// qkv::decode: validate every argument (nothing is written on a bad call) into the same
// problem every entry point produces (core/problem.hpp) — the cache as its key/value
// source — and run it through the same backend dispatch (core/dispatch.hpp).
#include "qkv/decode.hpp"

#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "cache/cache_scales.hpp"
#include "cache/decode_source.hpp"
#include "core/attention_rules.hpp"
#include "core/dispatch.hpp"
#include "core/validate.hpp"
#include "qkv/error.hpp"

namespace qkv {

using detail::Checker;
using detail::Described;
using detail::describe;

namespace detail {
// out [B, Nq, Hq, dv] and lse [B, Hq, Nq] (optional), appended to `outputs`.
void check_decode_outputs(const Checker& check, const Described& out, View3<float> lse_view, int64_t batch,
                          int64_t q_len, int64_t q_heads, int64_t v_dim, const char* v_dim_from,
                          std::vector<Described>& outputs) {
  check.expect_extent(out, 0, "batch", batch, "as q.shape[0]");
  check.expect_extent(out, 1, "seq", q_len, "as q.shape[1]");
  check.expect_extent(out, 2, "heads", q_heads, "as q.shape[2]");
  check.expect_extent(out, 3, "head_dim", v_dim, v_dim_from);
  outputs.push_back(out);
  if (!lse_view.empty()) {
    const Described lse = describe("lse", lse_view);
    check.expect_well_formed(lse);
    check.expect_extent(lse, 0, "batch", batch, "as q.shape[0]");
    check.expect_extent(lse, 1, "heads", q_heads, "as q.shape[2]");
    check.expect_extent(lse, 2, "seq", q_len, "as q.shape[1]");
    outputs.push_back(lse);
  }
}

int64_t check_cache_layout(const Checker& check, const Described& pool, TensorView<const int32_t, 2> block_table,
                           std::span<const int64_t> cache_lengths, int64_t batch, const char* batch_from,
                           std::vector<Described>& inputs) {
  int64_t capacity = 0;
  if (!block_table.empty()) {
    const Described table = describe("block_table", block_table);
    check.expect_well_formed(table);
    check.expect_extent(table, 0, "batch", batch, batch_from);
    check.expect_at_least_one(pool, 1, "block_size");
    if (block_table.shape[1] > 1 && block_table.strides[1] != 1) {
      check.fail("block_table.strides[1]: expected 1 (rows of the table contiguous), got " +
                 std::to_string(block_table.strides[1]));
    }
    capacity = block_table.shape[1] * pool.shape[1];
    inputs.push_back(table);
  } else {
    check.expect_extent(pool, 0, "batch", batch, batch_from);
    capacity = pool.shape[1];
  }
  check_cache_lengths(check, cache_lengths, batch, capacity, block_table, pool.shape[0], pool.shape[1],
                      pool.name.c_str());
  return capacity;
}

void check_cache_lengths(const Checker& check, std::span<const int64_t> cache_lengths, int64_t batch, int64_t capacity,
                         TensorView<const int32_t, 2> block_table, int64_t blocks, int64_t block_size,
                         const char* pool) {
  const bool paged = !block_table.empty();
  if (static_cast<int64_t>(cache_lengths.size()) != batch) {
    check.fail("cache_lengths: expected one length per sequence (" + std::to_string(batch) + "), got " +
               std::to_string(cache_lengths.size()));
  }
  for (std::size_t b = 0; b < cache_lengths.size(); ++b) {
    const int64_t length = cache_lengths[b];
    if (length < 0 || length > capacity) {
      check.fail("cache_lengths[" + std::to_string(b) + "]: expected 0.." + std::to_string(capacity) +
                 (paged ? " (block_table.shape[1] · block_size)" : " (" + std::string(pool) + ".shape[1], the capacity)") +
                 ", got " + std::to_string(length));
    }
    if (!paged) continue;
    for (int64_t j = 0; j * block_size < length; ++j) {
      const int32_t block = block_table(static_cast<int64_t>(b), j);
      if (block < 0 || block >= blocks) {
        check.fail("block_table[" + std::to_string(b) + ", " + std::to_string(j) + "]: expected a pool block 0.." +
                   std::to_string(blocks - 1) + " (" + pool + ".shape[0] - 1) for the " + std::to_string(length) +
                   " cached keys, got " + std::to_string(block));
      }
    }
  }
}

// The call as a dense problem: B sequences of Nq queries against a capacity of keys,
// each cut to its cache length (the mask rule's key lengths); its key/value source is
// the caller's to set.
detail::ForwardProblem<float> cache_problem(const Checker& check, const AttentionOptions& options, View4<const float> q,
                                            View4<float> out, View3<float> lse, int64_t kv_heads, int64_t capacity,
                                            int64_t v_dim, std::span<const int64_t> cache_lengths) {
  detail::refuse_for_caches(check, options);
  detail::ForwardProblem<float> p;
  detail::Extents& e = p.extents;
  e.batch = q.shape[0];
  e.q_len = q.shape[1];
  e.k_len = capacity;
  e.q_heads = q.shape[2];
  e.kv_heads = kv_heads;
  e.head_dim = q.shape[3];
  e.v_dim = v_dim;
  detail::MaskRule& mask = p.mask;
  mask.causal = detail::checked_causal(check, options);
  mask.sequences.count = e.batch;
  mask.sequences.dense_q_len = e.q_len;
  mask.sequences.dense_k_len = capacity;
  mask.key_lengths = cache_lengths;
  detail::check_variants(check, options, e, mask, p.modifiers);
  detail::resolve_execution(check, options, /*wants_weights=*/false, p);
  p.args.q = q;
  p.args.out = out;
  p.args.lse = lse;
  return p;
}
}  // namespace detail

namespace {
using detail::cache_problem;

template <class T>
detail::ForwardProblem<float> validate(const DecodeArgs<T>& a, const AttentionOptions& options) {
  const Checker check("qkv::decode");
  const Described q = describe("q", a.q), k = describe("k_cache", a.k_cache),
                  v = describe("v_cache", a.v_cache), out = describe("out", a.out);
  for (const Described* view : {&q, &k, &v, &out}) check.expect_well_formed(*view);
  check.expect_at_least_one(q, 2, "heads");
  check.expect_at_least_one(q, 3, "head_dim");
  check.expect_at_least_one(k, 2, "kv heads");
  check.expect_extent(k, 3, "head_dim", a.q.shape[3], "as q.shape[3]");
  check.expect_extent(v, 0, a.block_table.empty() ? "batch" : "blocks", a.k_cache.shape[0],
                      "as k_cache.shape[0]");
  check.expect_extent(v, 1, a.block_table.empty() ? "capacity" : "block_size",
                      a.k_cache.shape[1], "as k_cache.shape[1]");
  check.expect_extent(v, 2, "kv heads", a.k_cache.shape[2], "as k_cache.shape[2]");
  check.expect_at_least_one(v, 3, "head_dim");
  detail::check_head_groups(check, q, k, 2);
  const int64_t batch = a.q.shape[0], q_len = a.q.shape[1], q_heads = a.q.shape[2];
  const int64_t v_dim = a.v_cache.shape[3];

  // Where keys live: capacity per sequence, and for a paged cache its table.
  std::vector<Described> inputs{q, k, v};
  const bool paged = !a.block_table.empty();
  const int64_t capacity = detail::check_cache_layout(check, k, a.block_table, a.cache_lengths, batch,
                                                      "as q.shape[0]", inputs);

  std::vector<Described> outputs;
  detail::check_decode_outputs(check, out, a.lse, batch, q_len, q_heads, v_dim, "as v_cache.shape[3]", outputs);
  const detail::CacheScales scales{a.k_scale, a.v_scale, a.k_channel_scale, a.k_channel_zero, a.key_group};
  detail::check_cache_scales(check, storage_type_of<T>, scales, a.k_cache.shape, a.v_cache.shape, paged,
                             paged ? "blocks" : "batch", inputs);
  check.expect_outputs_apart(outputs, inputs);

  detail::ForwardProblem<float> p =
      cache_problem(check, options, a.q, a.out, a.lse, a.k_cache.shape[2], capacity, v_dim, a.cache_lengths);
  detail::KvSource& kv = p.kv;
  kv = detail::KvSource::of_cache(storage_type_of<T>, a.k_cache, a.v_cache, a.k_scale, a.v_scale, a.k_channel_scale,
                                  a.k_channel_zero, a.key_group);
  if (paged) {
    kv.block_table = a.block_table.data;
    kv.table_stride = a.block_table.strides[0];
    kv.page_size = a.k_cache.shape[1];
  }
  return p;
}

template <class T>
void run(const DecodeArgs<T>& args, const AttentionOptions& options) {
  const Checker check("qkv::decode");
  if (!args.indices.empty()) detail::refuse_for_key_lists(check, options);
  const detail::ForwardProblem<float> problem = validate(args, options);
  if (!args.indices.empty()) return detail::decode_key_lists(check, problem, args.indices, resolve_backend(options, false, false));
  if (problem.extents.batch == 0 || problem.extents.q_len == 0) return;
  detail::run_forward(problem, resolve_backend(options, false, false));
}

}  // namespace

namespace detail {
void decode_cache_source(const KvSource& kv, int64_t capacity, std::span<const int64_t> cache_lengths,
                         View4<const float> q_view, View4<float> out_view, View3<float> lse,
                         const AttentionOptions& options, const KeyIndices& indices) {
  const Checker check("qkv::decode");
  if (!indices.empty()) refuse_for_key_lists(check, options);
  const Described q = describe("q", q_view), out = describe("out", out_view);
  check.expect_well_formed(q);
  check.expect_well_formed(out);
  check.expect_at_least_one(q, 2, "heads");
  check.expect_at_least_one(q, 3, "head_dim");
  const auto batch = static_cast<int64_t>(cache_lengths.size());
  check.expect_extent(q, 0, "batch", batch, "the cache's batch");
  check.expect_extent(q, 3, "head_dim", kv.head_dim, "the cache's head_dim");
  if (q_view.shape[2] % kv.kv_heads != 0)
    check.fail("q.shape[2] (heads): expected a multiple of the cache's kv_heads = " + std::to_string(kv.kv_heads) +
               " for grouped-query attention, got " + std::to_string(q_view.shape[2]));
  std::vector<Described> outputs;
  detail::check_decode_outputs(check, out, lse, batch, q_view.shape[1], q_view.shape[2], kv.v_dim, "the cache's v_dim",
                               outputs);
  const std::vector<Described> inputs{q};
  check.expect_outputs_apart(outputs, inputs);  // the cache's storage is its own memory
  ForwardProblem<float> p = cache_problem(check, options, q_view, out_view, lse, kv.kv_heads, capacity, kv.v_dim,
                                          cache_lengths);
  p.kv = kv;
  if (!indices.empty()) return decode_key_lists(check, p, indices, resolve_backend(options, false, false));
  if (p.extents.batch == 0 || p.extents.q_len == 0) return;
  run_forward(p, resolve_backend(options, false, false));
}
}  // namespace detail

namespace detail {
void refuse_for_caches(const Checker& check, const AttentionOptions& options) {
  const auto refuse = [&](bool present, const char* name, const char* why) {
    if (present) check.fail(std::string(name) + ": not supported for caches (" + why + ")");
  };
  refuse(!options.mask.empty(), "options.mask", "a cache's keys are cut by cache_lengths, causal and window");
  refuse(!options.key_lengths.empty(), "options.key_lengths", "use cache_lengths");
  refuse(options.dropout.p != 0.0f, "options.dropout", "a training feature; use attention_forward");
  refuse(options.modifiers.active(), "options.modifiers",
         "use attention_forward");
  refuse(options.execution.check_finite, "options.execution.check_finite",
         "a cache's unused rows may hold anything");
}

}  // namespace detail

namespace {
AttentionOptions decode_step() {
  AttentionOptions options;
  options.causal = Causal::bottom_right;
  return options;
}
}  // namespace

#define QKV_DEFINE_DECODE(T)                                                              \
  void decode(const DecodeArgs<T>& args, const AttentionOptions& options) { run(args, options); } \
  void decode(const DecodeArgs<T>& args) { run(args, decode_step()); }
QKV_DEFINE_DECODE(float)
QKV_DEFINE_DECODE(bfloat16)
QKV_DEFINE_DECODE(float16)
QKV_DEFINE_DECODE(std::int8_t)
QKV_DEFINE_DECODE(float8_e4m3fn)
QKV_DEFINE_DECODE(float8_e5m2)
#undef QKV_DEFINE_DECODE

}  // namespace qkv
