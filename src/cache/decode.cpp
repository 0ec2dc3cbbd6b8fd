// qkv::decode: validate every argument (nothing is written on a bad call), describe the
// call as a cpu::DecodeProblem, run the decode kernel.
#include "qkv/decode.hpp"

#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "core/checker.hpp"
#include "core/validate.hpp"
#include "cpu/decode.hpp"
#include "qkv/error.hpp"

namespace qkv {
namespace {

using detail::Checker;
using detail::Described;
using detail::describe;

template <class T>
cpu::DecodeProblem validate(const DecodeArgs<T>& a, const DecodeOptions& options) {
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
  if (a.q.shape[2] % a.k_cache.shape[2] != 0) {
    std::ostringstream msg;
    msg << "q.shape[2] (heads): expected a multiple of k_cache.shape[2] (kv heads) = "
        << a.k_cache.shape[2] << " for grouped-query attention, got " << a.q.shape[2];
    check.fail(msg.str());
  }
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
  // int8 caches: a scale per cached row, shaped like the cache without its last axis.
  const bool scaled = storage_type_of<T> == StorageType::int8;
  for (const auto& [name, scale, cache, cache_name] :
       {std::tuple{"k_scale", &a.k_scale, &a.k_cache, "k_cache"}, std::tuple{"v_scale", &a.v_scale, &a.v_cache, "v_cache"}}) {
    if (!scaled) {
      if (!scale->empty())
        check.fail(std::string(name) + ": only int8 caches take scales (this cache is " +
                   storage_name(storage_type_of<T>) + ")");
      continue;
    }
    if (scale->empty())
      check.fail(std::string(name) + ": expected one float32 scale per cached row for an int8 cache, got none");
    const Described d = describe(name, *scale);
    check.expect_well_formed(d, /*inner_contiguous=*/false);  // read one scale per row, any strides
    const char* axis_names[3] = {paged ? "blocks" : "batch", paged ? "block_size" : "capacity", "kv heads"};
    for (int axis = 0; axis < 3; ++axis) {
      const std::string as = "as " + std::string(cache_name) + ".shape[" + std::to_string(axis) + "]";
      check.expect_extent(d, axis, axis_names[axis], cache->shape[axis], as.c_str());
    }
    inputs.push_back(d);
  }
  check.expect_outputs_apart(outputs, inputs);

  cpu::DecodeProblem p;
  p.causal = detail::checked_causal(check, options.causal);
  {  // the variants, by the same checks as attention_forward's
    AttentionOptions variants;
    variants.window = options.window;
    variants.softcap = options.softcap;
    variants.alibi_slopes = options.alibi_slopes;
    variants.sinks = options.sinks;
    detail::Extents extents;
    extents.q_heads = q_heads;
    detail::MaskRule mask;
    detail::ScoreModifiers modifiers;
    detail::check_variants(check, variants, extents, mask, modifiers);
    p.window = mask.window;
    p.softcap = modifiers.softcap;
    p.alibi_slopes = modifiers.has_alibi() ? modifiers.alibi_slopes.data() : nullptr;
    p.sinks = modifiers.has_sinks() ? modifiers.sinks.data() : nullptr;
  }
  p.scale = detail::resolve_scale(check, options.scale, a.q.shape[3]);
  p.threads = detail::resolve_threads(check, options.threads, "options.threads");
  p.batch = batch;
  p.q_len = q_len;
  p.q_heads = q_heads;
  p.kv_heads = a.k_cache.shape[2];
  p.head_dim = a.q.shape[3];
  p.v_dim = v_dim;
  p.q = a.q.data;
  p.q_batch = a.q.strides[0];
  p.q_row = a.q.strides[1];
  p.q_head = a.q.strides[2];
  cpu::KvSource& kv = p.kv;
  kv.type = storage_type_of<T>;
  kv.k = a.k_cache.data;
  kv.v = a.v_cache.data;
  kv.k_strides = cpu::RowStrides::of(a.k_cache);
  kv.v_strides = cpu::RowStrides::of(a.v_cache);
  if (scaled) {
    kv.k_scale = a.k_scale.data;
    kv.v_scale = a.v_scale.data;
    kv.k_scale_strides = cpu::RowStrides::of(a.k_scale);
    kv.v_scale_strides = cpu::RowStrides::of(a.v_scale);
  }
  if (paged) {
    kv.block_table = a.block_table.data;
    kv.table_stride = a.block_table.strides[0];
    kv.page_size = a.k_cache.shape[1];
    if (a.block_table.shape[1] > 1 && a.block_table.strides[1] != 1) {
      check.fail("block_table.strides[1]: expected 1 (rows of the table contiguous), got " +
                 std::to_string(a.block_table.strides[1]));
    }
  }
  p.lengths = a.cache_lengths.data();
  p.key_len = capacity;
  p.out = a.out.data;
  p.out_batch = a.out.strides[0];
  p.out_row = a.out.strides[1];
  p.out_head = a.out.strides[2];
  if (!a.lse.empty()) {
    p.lse = a.lse.data;
    p.lse_batch = a.lse.strides[0];
    p.lse_head = a.lse.strides[1];
    p.lse_row = a.lse.strides[2];
  }
  return p;
}

template <class T>
void run(const DecodeArgs<T>& args, const DecodeOptions& options) {
  const cpu::DecodeProblem problem = validate(args, options);
  if (problem.batch == 0 || problem.q_len == 0) return;
  cpu::decode(problem);
}

}  // namespace

void decode(const DecodeArgs<float>& args, const DecodeOptions& options) { run(args, options); }
void decode(const DecodeArgs<bfloat16>& args, const DecodeOptions& options) { run(args, options); }
void decode(const DecodeArgs<float16>& args, const DecodeOptions& options) { run(args, options); }
void decode(const DecodeArgs<std::int8_t>& args, const DecodeOptions& options) { run(args, options); }

}  // namespace qkv
