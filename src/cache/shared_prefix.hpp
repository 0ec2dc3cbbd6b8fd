// qkv::BatchPlan's shared prefixes (qkv/batch_plan.hpp, "Shared prefixes"): the groups
// found in the block table at plan time, each member's table and length trimmed to its
// own keys, and the prefix passes — one problem of G virtual sequences (a group's stacked
// query rows over its shared keys, every key visible, no sinks) planned on the split-K
// schedule — run into scratch and merged into the step's rows by LSE.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "core/problem.hpp"
#include "cpu/decode_plan.hpp"
#include "qkv/batch_plan.hpp"
#include "qkv/options.hpp"

namespace qkv::detail {

class Checker;

struct SharedPrefixes {
  std::vector<PrefixGroup> groups;
  // The packed query row of each stacked row of the passes, group after group.
  std::vector<int64_t> stacked_rows;
  // [groups, table_stride]: each group's shared blocks (its first member's table row).
  std::vector<int32_t> table;
  int64_t table_stride = 0;
  // The passes as one problem (views unset) and its split-K plan.
  ForwardProblem<float> problem;
  std::optional<cpu::DecodePlan> schedule;

  bool active() const { return !groups.empty(); }
};

// Plan time, before the step's problem is built: with layout.share_prefixes, refuses what
// does not combine (by name), finds the groups, and trims each member's `lengths` entry
// and row of `table` (the plan's copy, [B, table_stride]) to the keys after its prefix.
// Without it, returns an inactive SharedPrefixes and changes nothing.
SharedPrefixes find_shared_prefixes(const Checker& check, const BatchLayout& layout, const AttentionOptions& options,
                                    const std::vector<int64_t>& cu_q, std::vector<int64_t>& lengths,
                                    std::vector<int32_t>& table, int64_t table_stride, int64_t block_size);

// Plan time, after: the passes' problem (the step's extents, scale, softcap, threads and
// precision) and its split-K plan.
void plan_prefix_passes(SharedPrefixes& shared, const ForwardProblem<float>& step, StorageType storage);

// Run time. Everything the passes need, had before anything is written (a qkv::Error
// otherwise), with the stacked query rows copied in; `step` gains an lse view (scratch)
// when the caller asked for none, since the merge needs the step's.
struct PrefixRun {
  std::vector<float> q, out, lse, step_lse;
};
PrefixRun prepare_prefix_run(const SharedPrefixes& shared, ForwardProblem<float>& step);
// The passes into the scratch (reading the pool through the groups' table), then, after
// the step has run, their merge into the step's out and lse rows.
void run_prefix_passes(const SharedPrefixes& shared, const ForwardProblem<float>& step, PrefixRun& run);
void merge_prefix_passes(const SharedPrefixes& shared, const ForwardProblem<float>& step, PrefixRun& run);

// What a run cannot combine with groups, refused before anything is written: key lists
// (they name keys along the whole sequence) and a float window (a KVCache's, at positions
// the trimmed tables do not keep).
void refuse_with_shared_prefixes(const Checker& check, const SharedPrefixes& shared, const KeyIndices& indices,
                                 const KvSource& kv);

}  // namespace qkv::detail
