// qkv::BatchPlan: a serving step's layout, validated and planned once (qkv/batch_plan.hpp);
// each run checks only the views against the plan (O(1)) and runs the planned problem —
// the same ForwardProblem every entry point produces, its sequences the step's packed
// queries and its key/value source the caches — on the split-K schedule.
#include "qkv/batch_plan.hpp"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cache/batch_plan_state.hpp"
#include "cache/cache_reader.hpp"
#include "cache/cache_scales.hpp"
#include "cache/decode_source.hpp"
#include "cache/tree_mask.hpp"
#include "core/checked_size.hpp"
#include "core/attention_rules.hpp"
#include "core/dispatch.hpp"
#include "core/validate.hpp"
#include "cpu/decode.hpp"
#include "cpu/decode_plan.hpp"
#include "qkv/error.hpp"
#include "reference/key_values.hpp"

namespace qkv {


namespace {

using detail::Checker;

// Sequences of at most this many new queries run on the split-K schedule (two of its
// 16-query tiles), longer chunks on the tiled one. The tiled schedule first gathers the
// chunk's keys into float32 rows and computes 64-query blocks, so a short chunk pays the
// gather and a mostly empty block. Measured (Zen 4, 1 thread, bf16 pool, 4k–8k keys;
// tiled time / split-K time): 17 queries 1.4–2.9×, 24: 1.05–2.1×, 32: 0.92–1.9× (the
// 9/3-head d 64 shape the one below 1), 64: 0.79–1.34×, 128: 0.73–0.99×.
constexpr int64_t kSplitKChunkQueries = 2 * cpu::kDecodeQueries;
using detail::Described;
using detail::describe;

std::string at(const char* name, int64_t index) { return std::string(name) + "[" + std::to_string(index) + "]"; }

void check_layout_heads(const Checker& check, const BatchLayout& layout) {
  const auto positive = [&](int64_t value, const char* name) {
    if (value < 1) check.fail(std::string(name) + ": expected >= 1, got " + std::to_string(value));
  };
  positive(layout.num_heads, "layout.num_heads");
  positive(layout.num_kv_heads, "layout.num_kv_heads");
  positive(layout.head_dim, "layout.head_dim");
  if (layout.v_dim < 0) check.fail("layout.v_dim: expected >= 1 (or 0: head_dim), got " + std::to_string(layout.v_dim));
  if (layout.num_heads % layout.num_kv_heads != 0) {
    check.fail("layout.num_heads: expected a multiple of layout.num_kv_heads (" + std::to_string(layout.num_kv_heads) +
               ", grouped-query attention), got " + std::to_string(layout.num_heads));
  }
  switch (layout.storage) {
    case StorageType::float32: case StorageType::bfloat16: case StorageType::float16: case StorageType::int8:
    case StorageType::int4: break;  // int4: run over a KVCache only (no BatchArgs for it)
    case StorageType::float8_e4m3fn: case StorageType::float8_e5m2: break;
    default: check.fail("layout.storage: expected float32, bfloat16, float16, int8, int4, float8_e4m3fn or float8_e5m2");
  }
}

// cu_seqlens_q: starts at 0, never decreases. Returns it as int64.
std::vector<int64_t> checked_query_offsets(const Checker& check, const SeqOffsets& offsets) {
  if (offsets.size() == 0)
    check.fail("cu_seqlens_q: expected the prefix sums of the query counts (sequences + 1 entries, from 0), got none");
  std::vector<int64_t> cu(offsets.size());
  for (std::size_t s = 0; s < offsets.size(); ++s) {
    cu[s] = offsets[s];
    const auto index = static_cast<int64_t>(s);
    if (s == 0 && cu[0] != 0) check.fail("cu_seqlens_q[0]: expected 0, got " + std::to_string(cu[0]));
    if (s > 0 && cu[s] < cu[s - 1]) {
      check.fail(at("cu_seqlens_q", index) + ": expected >= " + at("cu_seqlens_q", index - 1) + " = " +
                 std::to_string(cu[s - 1]) + " (prefix sums never decrease), got " + std::to_string(cu[s]));
    }
  }
  if (cu.back() > detail::kMaxRows) {
    check.fail("cu_seqlens_q[" + std::to_string(cu.size() - 1) + "]: expected at most " +
               std::to_string(detail::kMaxRows) + " queries in a step, got " + std::to_string(cu.back()));
  }
  return cu;
}

// The block table (paged layouts): [B, max_blocks], every block a sequence's keys use
// named (≥ 0; the pool's size is checked per run against the largest).
void copy_block_table(const Checker& check, const BatchLayout& layout, const std::vector<int64_t>& lengths,
                      BatchPlan::State& s) {
  const auto batch = static_cast<int64_t>(lengths.size());
  const Described table = describe("block_table", layout.block_table);
  check.expect_well_formed(table, /*inner_contiguous=*/false);
  check.expect_extent(table, 0, "sequences", batch, "as cache_lengths");
  if (layout.block_size < 1) {
    check.fail("block_size: expected >= 1 (the pool's rows per block) with a block_table, got " +
               std::to_string(layout.block_size));
  }
  s.block_size = layout.block_size;
  s.max_blocks = layout.block_table.shape[1];
  const int64_t capacity = detail::checked_product("qkv::BatchPlan", "block_table capacity",
                                                   {{"block_table.shape[1]", s.max_blocks}, {"block_size", s.block_size}});
  s.block_table.assign(static_cast<std::size_t>(std::max<int64_t>(batch * s.max_blocks, 1)), 0);
  for (int64_t b = 0; b < batch; ++b) {
    if (lengths[b] > capacity) {
      check.fail(at("cache_lengths", b) + ": expected at most " + std::to_string(capacity) +
                 " (block_table.shape[1] · block_size), got " + std::to_string(lengths[b]));
    }
    for (int64_t j = 0; j < s.max_blocks; ++j) {
      const int32_t block = layout.block_table(b, j);
      s.block_table[static_cast<std::size_t>(b * s.max_blocks + j)] = block;
      if (j * s.block_size >= lengths[b]) continue;  // past the sequence's keys: never read
      if (block < 0) {
        check.fail("block_table[" + std::to_string(b) + ", " + std::to_string(j) +
                   "]: expected a pool block >= 0 for the " + std::to_string(lengths[b]) + " cached keys, got " +
                   std::to_string(block));
      }
      if (block > s.largest_block) {
        s.largest_block = block;
        s.largest_block_sequence = b;
        s.largest_block_entry = j;
      }
    }
  }
}

}  // namespace

BatchPlan::BatchPlan(const BatchLayout& layout, const AttentionOptions& options) {
  const Checker check("qkv::BatchPlan");
  auto state = std::make_shared<State>();
  State& s = *state;
  check_layout_heads(check, layout);
  std::vector<int64_t> cu_q = checked_query_offsets(check, layout.cu_seqlens_q);
  const auto batch = static_cast<int64_t>(cu_q.size()) - 1;
  if (static_cast<int64_t>(layout.cache_lengths.size()) != batch) {
    check.fail("cache_lengths: expected one length per sequence (" + std::to_string(batch) + ", as cu_seqlens_q), got " +
               std::to_string(layout.cache_lengths.size()));
  }
  std::vector<int64_t> lengths(static_cast<std::size_t>(batch));
  std::vector<int64_t> cu_k(static_cast<std::size_t>(batch) + 1, 0);
  int64_t longest_q = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t queries = cu_q[b + 1] - cu_q[b];
    lengths[b] = layout.cache_lengths[static_cast<std::size_t>(b)];
    if (lengths[b] < queries || lengths[b] > detail::kMaxRows) {
      check.fail(at("cache_lengths", b) + ": expected " + std::to_string(queries) + ".." +
                 std::to_string(detail::kMaxRows) + " (the sequence's " + std::to_string(queries) +
                 " new queries' keys are in its cache), got " + std::to_string(lengths[b]));
    }
    cu_k[b + 1] = detail::checked_sum("qkv::BatchPlan", "the keys of a step", {"keys before", cu_k[b]},
                                      {at("cache_lengths", b), lengths[b]});
    longest_q = std::max(longest_q, queries);
    if (lengths[b] > s.longest_cache) {
      s.longest_cache = lengths[b];
      s.longest_cache_sequence = b;
    }
  }
  if (!layout.block_table.empty()) {
    copy_block_table(check, layout, lengths, s);
  } else if (layout.block_size != 0) {
    check.fail("block_size: expected 0 without a block_table (contiguous caches), got " + std::to_string(layout.block_size));
  }
  s.cache_lengths = lengths;
  if (layout.share_prefixes) {  // each member's lengths and table row trimmed to its own keys
    std::vector<int32_t> trimmed = s.block_table;
    s.shared = detail::find_shared_prefixes(check, layout, options, cu_q, lengths, trimmed, s.max_blocks, s.block_size);
    if (s.shared.active()) s.step_table = std::move(trimmed);
    for (int64_t b = 0; b < batch; ++b) cu_k[b + 1] = cu_k[b] + lengths[b];
  }
  detail::refuse_for_caches(check, options);
  s.trees = detail::checked_tree_masks(check, layout, cu_q);
  if (!s.trees.offsets.empty()) detail::refuse_with_trees(check, options);

  // The step as one problem: its sequences are the packed queries' (cu_q) against their
  // caches (cu_k only sizes each sequence's keys: the key/value source addresses them).
  detail::ForwardProblem<float>& p = s.problem;
  detail::Extents& e = p.extents;
  e.batch = batch;
  e.q_len = longest_q;
  e.k_len = s.longest_cache;
  e.q_heads = layout.num_heads;
  e.kv_heads = layout.num_kv_heads;
  e.head_dim = layout.head_dim;
  e.v_dim = layout.v_dim == 0 ? layout.head_dim : layout.v_dim;
  p.mask.causal = detail::checked_causal(check, options);
  p.mask.sequences.count = batch;
  p.mask.sequences.cu_q = std::move(cu_q);
  p.mask.sequences.cu_k = std::move(cu_k);
  p.mask.tree = {.bits = s.trees.bits, .offsets = s.trees.offsets};
  detail::check_variants(check, options, e, p.mask, p.modifiers);
  detail::resolve_execution(check, options, /*wants_weights=*/false, p);
  s.alibi_slopes.assign(p.modifiers.alibi_slopes.begin(), p.modifiers.alibi_slopes.end());
  s.sinks.assign(p.modifiers.sinks.begin(), p.modifiers.sinks.end());
  p.modifiers.alibi_slopes = s.alibi_slopes;
  p.modifiers.sinks = s.sinks;
  s.storage = layout.storage;
  s.total_q = p.mask.sequences.cu_q.back();
  s.backend = resolve_backend(options, false, false);
  if (s.backend == Backend::cpu) {
    std::vector<bool> tiled(static_cast<std::size_t>(batch), false);
    for (int64_t b = 0; b < batch && !p.fixed_key_split; ++b) {
      // A tree's rows each see their own keys: the split-K schedule masks per row (its
      // query tiles of 16 cover a tree of any size), the tiled one has no such mask.
      if (p.mask.q_len(b) <= kSplitKChunkQueries || p.mask.tree.has(b)) continue;
      tiled[static_cast<std::size_t>(b)] = true;
      s.chunks.push_back(b);
    }
    s.schedule.emplace(p.extents, p.mask, s.storage, cpu::decode_vector_lanes(), p.fixed_key_split, &tiled,
                       cpu::latent_blocks(p, s.storage));
    detail::plan_prefix_passes(s.shared, p, s.storage);
  }
  state_ = std::move(state);
}

BatchPlan::~BatchPlan() = default;
BatchPlan::BatchPlan(const BatchPlan&) = default;
BatchPlan& BatchPlan::operator=(const BatchPlan&) = default;
BatchPlan::BatchPlan(BatchPlan&&) noexcept = default;
BatchPlan& BatchPlan::operator=(BatchPlan&&) noexcept = default;

int64_t BatchPlan::sequences() const { return state_->problem.extents.batch; }
int64_t BatchPlan::total_queries() const { return state_->total_q; }
int64_t BatchPlan::tasks() const { return static_cast<int64_t>(task_costs().size()); }
std::vector<double> BatchPlan::task_costs() const {
  std::vector<double> costs;
  for (const auto* schedule : {&state_->shared.schedule, &state_->schedule}) {  // in the order they run
    if (!*schedule) continue;
    for (const std::size_t t : (*schedule)->order) costs.push_back((*schedule)->cost[t]);
  }
  return costs;
}
std::vector<PrefixGroup> BatchPlan::prefix_groups() const { return state_->shared.groups; }

// out [total_q, Hq, dv] and lse [Hq, total_q] (optional) against the plan, appended to `outputs`.
void detail::check_outputs(const Checker& check, const BatchPlan::State& s, const Described& out, TensorView<float, 2> lse_view,
                   std::vector<Described>& outputs) {
  const detail::Extents& e = s.problem.extents;
  check.expect_extent(out, 0, "total_q", s.total_q, "as cu_seqlens_q[-1]");
  check.expect_extent(out, 1, "heads", e.q_heads, "as layout.num_heads");
  check.expect_extent(out, 2, "head_dim", e.v_dim, "as layout.v_dim");
  outputs.push_back(out);
  if (!lse_view.empty()) {
    const Described lse = describe("lse", lse_view);
    check.expect_well_formed(lse, /*inner_contiguous=*/false);
    check.expect_extent(lse, 0, "heads", e.q_heads, "as layout.num_heads");
    check.expect_extent(lse, 1, "total_q", s.total_q, "as cu_seqlens_q[-1]");
    outputs.push_back(lse);
  }
}

// The planned problem with this run's queries and outputs (its key/value source is the
// caller's to set), over caches of `capacity` keys a sequence.
detail::ForwardProblem<float> detail::step_problem(const BatchPlan::State& s, View3<const float> q, View3<float> out,
                                                   TensorView<float, 2> lse, int64_t capacity) {
  const detail::Extents& e = s.problem.extents;
  detail::ForwardProblem<float> p = s.problem;
  p.extents.k_len = capacity;
  p.args.q = detail::as_batched(q, e.batch);
  p.args.out = detail::as_batched(out, e.batch);
  if (!lse.empty()) p.args.lse = detail::lse_as_batched(lse, e.batch);
  return p;
}

// q [total_q, Hq, head_dim] and a cache's first two axes against the plan (its pool blocks
// and block size, or its sequences and capacity).
void detail::check_step_views(const Checker& check, const BatchPlan::State& s, const Described& q,
                              const Described& cache) {
  const detail::Extents& e = s.problem.extents;
  check.expect_extent(q, 0, "total_q", s.total_q, "as cu_seqlens_q[-1]");
  check.expect_extent(q, 1, "heads", e.q_heads, "as layout.num_heads");
  check.expect_extent(q, 2, "head_dim", e.head_dim, "as layout.head_dim");
  if (s.paged()) {
    if (cache.shape[0] <= s.largest_block) {
      check.fail("block_table[" + std::to_string(s.largest_block_sequence) + ", " +
                 std::to_string(s.largest_block_entry) + "]: expected a pool block 0.." +
                 std::to_string(cache.shape[0] - 1) + " (" + cache.name + ".shape[0] - 1), got " +
                 std::to_string(s.largest_block));
    }
    check.expect_extent(cache, 1, "block_size", s.block_size, "as the plan's block_size");
  } else {
    check.expect_extent(cache, 0, "sequences", e.batch, "as cache_lengths");
    if (cache.shape[1] < s.longest_cache) {
      check.fail(cache.name + ".shape[1] (capacity): expected at least cache_lengths[" +
                 std::to_string(s.longest_cache_sequence) + "] = " + std::to_string(s.longest_cache) + ", got " +
                 std::to_string(cache.shape[1]));
    }
  }
}

// The run's views against the plan: O(1) checks (the layout was checked when planned).
template <class T>
detail::ForwardProblem<float> detail::planned_problem(const BatchPlan::State& s, const BatchArgs<T>& a) {
  const Checker check("qkv::BatchPlan::run");
  if (storage_type_of<T> != s.storage) {
    check.fail(std::string("k_cache: expected ") + storage_name(s.storage) + " elements (the plan's layout.storage), got " +
               storage_name(storage_type_of<T>));
  }
  const detail::Extents& e = s.problem.extents;
  const Described q = describe("q", a.q), k = describe("k_cache", a.k_cache), v = describe("v_cache", a.v_cache),
                  out = describe("out", a.out);
  for (const Described* view : {&q, &k, &v, &out}) check.expect_well_formed(*view);
  detail::check_step_views(check, s, q, k);
  const char* first_axis = s.paged() ? "blocks" : "sequences";
  check.expect_extent(k, 2, "kv heads", e.kv_heads, "as layout.num_kv_heads");
  const bool split_keys = !a.k_rope_cache.empty();
  const Described k_rope = describe("k_rope_cache", a.k_rope_cache);
  int64_t rope_dim = 0;
  if (split_keys) {  // keys in two parts: k_cache the first head_dim − dr channels
    if (s.storage == StorageType::int8 || is_float8(s.storage)) {
      check.fail(std::string("k_rope_cache: not with ") + storage_name(s.storage) +
                 " caches (one row scale would have to serve both pools): keep the keys in one combined pool, "
                 "or the two pools in float32, bfloat16 or float16");
    }
    check.expect_well_formed(k_rope);
    rope_dim = a.k_rope_cache.shape[3];
    if (rope_dim < 1 || rope_dim >= e.head_dim) {
      check.fail("k_rope_cache.shape[3] (dr): expected 1.." + std::to_string(e.head_dim - 1) +
                 " (below layout.head_dim, the two parts' sum), got " + std::to_string(rope_dim));
    }
    check.expect_extent(k, 3, "head_dim - dr", e.head_dim - rope_dim,
                        "as layout.head_dim - k_rope_cache.shape[3] (keys in two parts)");
    check.expect_extent(k_rope, 0, first_axis, a.k_cache.shape[0], "as k_cache.shape[0]");
    check.expect_extent(k_rope, 1, s.paged() ? "block_size" : "capacity", a.k_cache.shape[1], "as k_cache.shape[1]");
    check.expect_extent(k_rope, 2, "kv heads", e.kv_heads, "as layout.num_kv_heads");
  } else {
    check.expect_extent(k, 3, "head_dim", e.head_dim, "as layout.head_dim");
  }
  check.expect_extent(v, 0, first_axis, a.k_cache.shape[0], "as k_cache.shape[0]");
  check.expect_extent(v, 1, s.paged() ? "block_size" : "capacity", a.k_cache.shape[1], "as k_cache.shape[1]");
  check.expect_extent(v, 2, "kv heads", e.kv_heads, "as layout.num_kv_heads");
  check.expect_extent(v, 3, "head_dim", e.v_dim, "as layout.v_dim");
  std::vector<Described> inputs{q, k, v};
  if (split_keys) inputs.push_back(k_rope);
  std::vector<Described> outputs;
  detail::check_outputs(check, s, out, a.lse, outputs);
  const detail::CacheScales scales{a.k_scale, a.v_scale, a.k_channel_scale, a.k_channel_zero, a.key_group};
  detail::check_cache_scales(check, s.storage, scales, a.k_cache.shape, a.v_cache.shape, s.paged(), first_axis, inputs);
  check.expect_outputs_apart(outputs, inputs);

  detail::ForwardProblem<float> p = detail::step_problem(s, a.q, a.out, a.lse, s.paged() ? s.max_blocks * s.block_size : a.k_cache.shape[1]);
  detail::KvSource& kv = p.kv;
  kv = detail::KvSource::of_cache(s.storage, a.k_cache, a.v_cache, a.k_scale, a.v_scale, a.k_channel_scale,
                                  a.k_channel_zero, a.key_group);
  if (split_keys) {  // read through the same sequence, table and head as k_cache's rows
    kv.k_rope = a.k_rope_cache.data;
    kv.k_rope_strides = detail::RowStrides::of(a.k_rope_cache);
    kv.rope_from = e.head_dim - rope_dim;
  }
  if (s.paged()) {
    kv.block_table = s.read_table();
    kv.table_stride = s.max_blocks;
    kv.page_size = s.block_size;
  }
  return p;
}


// The step's workspace, before anything is written (a workspace that cannot be had is a
// qkv::Error with the outputs, and run_appending's caches, untouched).
detail::StepWork detail::prepare_step(const BatchPlan::State& s, const detail::ForwardProblem<float>& problem,
                                      const KeyIndices& indices) {
  detail::refuse_with_shared_prefixes(Checker("qkv::BatchPlan::run"), s.shared, indices, problem.kv);
  if (!indices.empty() && !s.trees.offsets.empty())
    Checker("qkv::BatchPlan::run").fail("indices: not with a plan that has a tree_mask (key lists select "
                                        "keys along the sequence, a tree among its new tokens)");
  detail::StepWork work{.step = problem, .prefixes = {}, .chunks = {}};
  if (!indices.empty() || s.total_q == 0) return work;
  if (s.shared.active()) work.prefixes = detail::prepare_prefix_run(s.shared, work.step);  // step.args.lse set
  for (const int64_t b : s.chunks) work.chunks.push_back(detail::allocate_chunk(work.step, b));
  return work;
}

// The step itself, over the prepared problem's views.
void detail::finish_step(const BatchPlan::State& s, detail::StepWork& work, const KeyIndices& indices) {
  const detail::ForwardProblem<float>& step = work.step;
  if (!indices.empty())  // every row over its own list (cache/decode_sparse.cpp)
    return detail::decode_key_lists(Checker("qkv::BatchPlan::run"), step, indices, s.backend);
  if (s.total_q == 0) return;
  for (detail::GatheredChunk& chunk : work.chunks) detail::fill_chunk(step, chunk);
  if (work.prefixes) detail::run_prefix_passes(s.shared, step, *work.prefixes);
  detail::run_planned_forward(step, s.backend, s.schedule ? &*s.schedule : nullptr);
  for (const detail::GatheredChunk& chunk : work.chunks) detail::run_chunk(step, chunk);
  if (work.prefixes) detail::merge_prefix_passes(s.shared, step, *work.prefixes);
}

void detail::run_step(const BatchPlan::State& s, const detail::ForwardProblem<float>& problem,
                      const KeyIndices& indices) {
  detail::StepWork work = detail::prepare_step(s, problem, indices);
  detail::finish_step(s, work, indices);
}

template detail::ForwardProblem<float> detail::planned_problem(const BatchPlan::State&, const BatchArgs<float>&);
template detail::ForwardProblem<float> detail::planned_problem(const BatchPlan::State&, const BatchArgs<bfloat16>&);
template detail::ForwardProblem<float> detail::planned_problem(const BatchPlan::State&, const BatchArgs<float16>&);
template detail::ForwardProblem<float> detail::planned_problem(const BatchPlan::State&, const BatchArgs<std::int8_t>&);
template detail::ForwardProblem<float> detail::planned_problem(const BatchPlan::State&,
                                                               const BatchArgs<float8_e4m3fn>&);
template detail::ForwardProblem<float> detail::planned_problem(const BatchPlan::State&, const BatchArgs<float8_e5m2>&);

namespace {

template <class T>
void run_plan(const BatchPlan::State& s, const BatchArgs<T>& args) {
  detail::run_step(s, detail::planned_problem(s, args), args.indices);
}

// A cache against the plan: its storage, shape and lengths (and, paged, block table)
// must be what was planned.
void check_cache(const Checker& check, const BatchPlan::State& s, const KVCache& cache) {
  const KVCacheConfig& c = cache.config();
  const detail::Extents& e = s.problem.extents;
  if (c.dtype != s.storage)
    check.fail(std::string("cache: expected a cache of ") + storage_name(s.storage) + " (the plan's layout.storage), got " +
               storage_name(c.dtype));
  const auto expect = [&](const char* what, int64_t got, int64_t want, const char* as) {
    if (got != want)
      check.fail(std::string("cache.config().") + what + ": expected " + std::to_string(want) + " (" + as + "), got " +
                 std::to_string(got));
  };
  expect("batch", c.batch, e.batch, "the plan's sequences");
  expect("kv_heads", c.kv_heads, e.kv_heads, "layout.num_kv_heads");
  expect("head_dim", c.head_dim, e.head_dim, "layout.head_dim");
  expect("v_dim", c.v_dim, e.v_dim, "layout.v_dim");
  if (c.paged != s.paged())
    check.fail(std::string("cache: expected a ") + (s.paged() ? "paged" : "contiguous") + " cache (as the plan's " +
               (s.paged() ? "block_table" : "empty block_table") + "), got a " + (c.paged ? "paged" : "contiguous") + " one");
  if (c.paged) expect("block_size", c.block_size, s.block_size, "layout.block_size");
  for (int64_t b = 0; b < e.batch; ++b) {
    const int64_t length = cache.lengths()[static_cast<std::size_t>(b)];
    if (length != s.cache_lengths[static_cast<std::size_t>(b)])
      check.fail("cache.lengths()[" + std::to_string(b) + "]: expected " + std::to_string(s.cache_lengths[static_cast<std::size_t>(b)]) +
                 " (the plan's cache_lengths), got " + std::to_string(length));
    if (!c.paged) continue;
    for (int64_t j = 0; j * s.block_size < length; ++j) {
      const int32_t planned = s.block_table[static_cast<std::size_t>(b * s.max_blocks + j)];
      const int32_t held = cache.block_table()[static_cast<std::size_t>(b * cache.blocks_per_sequence() + j)];
      if (planned != held)
        check.fail("cache.block_table()[" + std::to_string(b) + ", " + std::to_string(j) + "]: expected " +
                   std::to_string(planned) + " (the plan's block_table), got " + std::to_string(held));
    }
  }
}

}  // namespace

void BatchPlan::run(const BatchArgs<float>& args) const { run_plan(*state_, args); }
void BatchPlan::run(const BatchArgs<bfloat16>& args) const { run_plan(*state_, args); }
void BatchPlan::run(const BatchArgs<float16>& args) const { run_plan(*state_, args); }
void BatchPlan::run(const BatchArgs<std::int8_t>& args) const { run_plan(*state_, args); }
void BatchPlan::run(const BatchArgs<float8_e4m3fn>& args) const { run_plan(*state_, args); }
void BatchPlan::run(const BatchArgs<float8_e5m2>& args) const { run_plan(*state_, args); }

void BatchPlan::run(View3<const float> q_view, const KVCache& cache, View3<float> out_view,
                    TensorView<float, 2> lse) const {
  run(q_view, cache, out_view, lse, KeyIndices{});
}

void BatchPlan::run(View3<const float> q_view, const KVCache& cache, View3<float> out_view,
                    TensorView<float, 2> lse, const KeyIndices& indices) const {
  const State& s = *state_;
  const Checker check("qkv::BatchPlan::run");
  const detail::Extents& e = s.problem.extents;
  const Described q = describe("q", q_view), out = describe("out", out_view);
  check.expect_well_formed(q);
  check.expect_well_formed(out);
  check.expect_extent(q, 0, "total_q", s.total_q, "as cu_seqlens_q[-1]");
  check.expect_extent(q, 1, "heads", e.q_heads, "as layout.num_heads");
  check.expect_extent(q, 2, "head_dim", e.head_dim, "as layout.head_dim");
  std::vector<Described> outputs;
  detail::check_outputs(check, s, out, lse, outputs);
  const std::vector<Described> inputs{q};
  check.expect_outputs_apart(outputs, inputs);  // the cache's storage is its own memory
  const auto held = detail::CacheReader::lock(cache);  // lengths and rows stay as checked
  check_cache(check, s, cache);
  detail::ForwardProblem<float> problem =
      detail::step_problem(s, q_view, out_view, lse, s.paged() ? s.max_blocks * s.block_size : cache.config().capacity);
  problem.kv = detail::CacheReader::source(cache);
  if (s.paged()) {  // the plan's copy of the table (equal to the cache's where it is read)
    problem.kv.block_table = s.read_table();
    problem.kv.table_stride = s.max_blocks;
  }
  detail::run_step(s, problem, indices);
}

}  // namespace qkv
