// qkv::decode: validate every argument (nothing is written on a bad call) into the same
// problem every entry point produces (core/problem.hpp) — the cache as its key/value
// source — and run it through the same backend dispatch (core/dispatch.hpp).
#include "qkv/decode.hpp"

#include <string>
#include <tuple>
#include <vector>

#include "cache/cache_scales.hpp"
#include "core/checker.hpp"
#include "core/dispatch.hpp"
#include "core/validate.hpp"
#include "qkv/error.hpp"

namespace qkv {
namespace {

using detail::Checker;
using detail::Described;
using detail::describe;

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
  int64_t capacity = 0;
  std::vector<Described> inputs{q, k, v};
  const bool paged = !a.block_table.empty();
  if (paged) {
    const Described table = describe("block_table", a.block_table);
    check.expect_well_formed(table);
    check.expect_extent(table, 0, "batch", batch, "as q.shape[0]");
    check.expect_at_least_one(k, 1, "block_size");
    capacity = a.block_table.shape[1] * a.k_cache.shape[1];
    inputs.push_back(table);
  } else {
    check.expect_extent(k, 0, "batch", batch, "as q.shape[0]");
    capacity = a.k_cache.shape[1];
  }

  if (static_cast<int64_t>(a.cache_lengths.size()) != batch) {
    check.fail("cache_lengths: expected one length per sequence (" + std::to_string(batch) +
               "), got " + std::to_string(a.cache_lengths.size()));
  }
  for (std::size_t b = 0; b < a.cache_lengths.size(); ++b) {
    const int64_t length = a.cache_lengths[b];
    if (length < 0 || length > capacity) {
      check.fail("cache_lengths[" + std::to_string(b) + "]: expected 0.." +
                 std::to_string(capacity) +
                 (paged ? " (block_table.shape[1] · block_size)" : " (k_cache.shape[1], the capacity)") +
                 ", got " + std::to_string(length));
    }
    if (!paged) continue;
    const int64_t block_size = a.k_cache.shape[1], blocks = a.k_cache.shape[0];
    for (int64_t j = 0; j * block_size < length; ++j) {
      const int32_t block = a.block_table(static_cast<int64_t>(b), j);
      if (block < 0 || block >= blocks) {
        check.fail("block_table[" + std::to_string(b) + ", " + std::to_string(j) +
                   "]: expected a pool block 0.." + std::to_string(blocks - 1) +
                   " (k_cache.shape[0] - 1) for the " + std::to_string(length) +
                   " cached keys, got " + std::to_string(block));
      }
    }
  }

  check.expect_extent(out, 0, "batch", batch, "as q.shape[0]");
  check.expect_extent(out, 1, "seq", q_len, "as q.shape[1]");
  check.expect_extent(out, 2, "heads", q_heads, "as q.shape[2]");
  check.expect_extent(out, 3, "head_dim", v_dim, "as v_cache.shape[3]");
  std::vector<Described> outputs{out};
  if (!a.lse.empty()) {
    const Described lse = describe("lse", a.lse);
    check.expect_well_formed(lse);
    check.expect_extent(lse, 0, "batch", batch, "as q.shape[0]");
    check.expect_extent(lse, 1, "heads", q_heads, "as q.shape[2]");
    check.expect_extent(lse, 2, "seq", q_len, "as q.shape[1]");
    outputs.push_back(lse);
  }
  const detail::CacheScales scales{a.k_scale, a.v_scale, a.k_channel_scale, a.k_channel_zero, a.key_group};
  detail::check_cache_scales(check, storage_type_of<T>, scales, a.k_cache.shape, a.v_cache.shape, paged,
                             paged ? "blocks" : "batch", inputs);
  check.expect_outputs_apart(outputs, inputs);

  detail::refuse_for_caches(check, options);

  // The call as a dense problem: B sequences of Nq queries against a capacity of keys,
  // each cut to its cache length (the mask rule's key lengths).
  detail::ForwardProblem<float> p;
  detail::Extents& e = p.extents;
  e.batch = batch;
  e.q_len = q_len;
  e.k_len = capacity;
  e.q_heads = q_heads;
  e.kv_heads = a.k_cache.shape[2];
  e.head_dim = a.q.shape[3];
  e.v_dim = v_dim;
  detail::MaskRule& mask = p.mask;
  mask.causal = detail::checked_causal(check, options);
  mask.sequences.count = batch;
  mask.sequences.dense_q_len = q_len;
  mask.sequences.dense_k_len = capacity;
  mask.key_lengths = a.cache_lengths;
  detail::check_variants(check, options, e, mask, p.modifiers);
  detail::resolve_execution(check, options, /*wants_weights=*/false, p);
  p.args.q = a.q;
  p.args.out = a.out;
  p.args.lse = a.lse;

  detail::KvSource& kv = p.kv;
  kv = detail::KvSource::of_cache(storage_type_of<T>, a.k_cache, a.v_cache, a.k_scale, a.v_scale, a.k_channel_scale,
                                  a.k_channel_zero, a.key_group);
  if (paged) {
    kv.block_table = a.block_table.data;
    kv.table_stride = a.block_table.strides[0];
    kv.page_size = a.k_cache.shape[1];
    if (a.block_table.shape[1] > 1 && a.block_table.strides[1] != 1) {
      check.fail("block_table.strides[1]: expected 1 (rows of the table contiguous), got " +
                 std::to_string(a.block_table.strides[1]));
    }
  }
  return p;
}

template <class T>
void run(const DecodeArgs<T>& args, const AttentionOptions& options) {
  const detail::ForwardProblem<float> problem = validate(args, options);
  if (problem.extents.batch == 0 || problem.extents.q_len == 0) return;
  detail::run_forward(problem, resolve_backend(options, false, false));
}

}  // namespace

AttentionOptions DecodeOptions::attention() const {
  AttentionOptions options;
  options.scale = scale;
  options.causal = causal;
  options.window = window;
  options.softcap = softcap;
  options.alibi_slopes = alibi_slopes;
  options.sinks = sinks;
  options.execution.threads = threads;
  options.precision = precision;
  return options;
}

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

#define QKV_DEFINE_DECODE(T)                                                              \
  void decode(const DecodeArgs<T>& args, const AttentionOptions& options) { run(args, options); } \
  void decode(const DecodeArgs<T>& args, const DecodeOptions& options) { run(args, options.attention()); }
QKV_DEFINE_DECODE(float)
QKV_DEFINE_DECODE(bfloat16)
QKV_DEFINE_DECODE(float16)
QKV_DEFINE_DECODE(std::int8_t)
#undef QKV_DEFINE_DECODE

}  // namespace qkv
