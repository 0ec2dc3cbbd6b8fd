// qkv::BatchPlan's state (src/cache/batch_plan.cpp), shared with the run that appends new
// tokens first (src/cache/batch_plan_append.cpp): what a plan holds, the checks of one
// run's views against it, and the step itself.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "cache/shared_prefix.hpp"
#include "cache/tree_mask.hpp"
#include "check/checker.hpp"
#include "core/validate.hpp"
#include "cpu/decode_plan.hpp"
#include "qkv/batch_plan.hpp"

namespace qkv {

struct BatchPlan::State {
  // Owned copies of the layout and the per-head options: the caller's arrays may change
  // or go away once the plan is made.
  std::vector<int32_t> block_table;
  int64_t max_blocks = 0, block_size = 0;
  std::vector<float> alibi_slopes, sinks;
  detail::TreeMaskCopy trees;  // MaskRule::tree points into it
  StorageType storage = StorageType::float32;
  int64_t total_q = 0;
  // What the run's views must hold: the longest cache (contiguous capacity) and the
  // largest pool block the table names, with where they come from (for the error).
  int64_t longest_cache = 0, longest_cache_sequence = 0;
  int64_t largest_block = -1, largest_block_sequence = 0, largest_block_entry = 0;
  Backend backend = Backend::cpu;
  // The problem without its views, and the split-K schedule's plan of it.
  detail::ForwardProblem<float> problem;
  std::optional<cpu::DecodePlan> schedule;
  // Prefill chunks (> 16 queries; not with fixed_key_split): each runs the tiled schedule
  // over its keys gathered into float32 rows, and the split-K plan leaves them out.
  std::vector<int64_t> chunks;
  // The layout's cache lengths. With shared prefixes the problem's are each member's own
  // keys, read through step_table (block_table with each member's row trimmed alike);
  // appending and a KVCache's check use these and block_table.
  std::vector<int64_t> cache_lengths;
  std::vector<int32_t> step_table;  // empty: block_table
  detail::SharedPrefixes shared;

  bool paged() const { return !block_table.empty(); }
  const int32_t* read_table() const { return step_table.empty() ? block_table.data() : step_table.data(); }
};

namespace detail {

// out [total_q, Hq, dv] and lse [Hq, total_q] (optional) against the plan, appended to
// `outputs`.
void check_outputs(const Checker& check, const BatchPlan::State& s, const Described& out, TensorView<float, 2> lse,
                   std::vector<Described>& outputs);
// q [total_q, Hq, head_dim] and a cache's first two axes (pool blocks and block size, or
// sequences and capacity) against the plan.
void check_step_views(const Checker& check, const BatchPlan::State& s, const Described& q, const Described& cache);
// The planned problem with this run's queries and outputs (its key/value source is the
// caller's to set), over caches of `capacity` keys a sequence.
ForwardProblem<float> step_problem(const BatchPlan::State& s, View3<const float> q, View3<float> out,
                                   TensorView<float, 2> lse, int64_t capacity);

// The run's views against the plan (O(1) checks; a qkv::Error naming the argument) and
// the planned problem over them.
template <class T>
ForwardProblem<float> planned_problem(const BatchPlan::State& s, const BatchArgs<T>& a);

// A prefill chunk's keys and values gathered into float32 rows (cache/batch_plan.cpp).
struct GatheredChunk {
  int64_t sequence = 0;
  std::vector<float> keys, values;
};

// Its buffer (allocated before anything is written), its rows gathered (after
// run_appending's writes), and the chunk run on the tiled schedule over them
// (cache/batch_plan_chunks.cpp).
GatheredChunk allocate_chunk(const ForwardProblem<float>& step, int64_t b);
void fill_chunk(const ForwardProblem<float>& step, GatheredChunk& gathered);
void run_chunk(const ForwardProblem<float>& step, const GatheredChunk& gathered);

// What a step needs besides the caller's views, had before anything is written: the
// problem (with a scratch lse when shared prefixes need one), the shared prefixes'
// scratch and the chunks' buffers (filled when the step runs, after run_appending's
// writes, which they read).
struct StepWork {
  ForwardProblem<float> step;
  std::optional<PrefixRun> prefixes;
  std::vector<GatheredChunk> chunks;
};
StepWork prepare_step(const BatchPlan::State& s, const ForwardProblem<float>& problem, const KeyIndices& indices = {});
void finish_step(const BatchPlan::State& s, StepWork& work, const KeyIndices& indices = {});

// The step itself, over `problem`'s views (key lists: every row over its own):
// prepare_step, then finish_step.
void run_step(const BatchPlan::State& s, const ForwardProblem<float>& problem, const KeyIndices& indices = {});

}  // namespace detail
}  // namespace qkv
