// qkv::BatchPlan's shared prefixes (cache/shared_prefix.hpp; the contract is in
// qkv/batch_plan.hpp, "Shared prefixes").
#include "cache/shared_prefix.hpp"

#include <algorithm>
#include <span>
#include <string>

#include "check/checker.hpp"
#include "core/checked_size.hpp"
#include "core/dispatch.hpp"
#include "core/lse_merge.hpp"
#include "core/validate.hpp"
#include "cpu/decode.hpp"

namespace qkv::detail {

namespace {

// Grouping over a prefix tree of the block tables. `order` holds the sequences that may
// take part, sorted by their tables (each cut to the blocks it may share, `shareable`),
// so sequences that agree on their first blocks are neighbours. A range of them that
// agrees on its first `depth` blocks either forms one group over its longest common run
// of blocks, or splits by the next block into ranges that share more; the choice saving
// the most block reads — (members − 1) · shared blocks, summed — wins (one group on a tie:
// fewer passes).
class GroupFinder {
 public:
  GroupFinder(const std::vector<int32_t>& table, int64_t stride, const std::vector<int64_t>& shareable)
      : table_(table), stride_(stride), shareable_(shareable) {}

  struct Choice {
    int64_t saved = 0;
    std::vector<std::pair<std::vector<int64_t>, int64_t>> groups;  // members, shared blocks
  };

  Choice best(std::span<const int64_t> range, int64_t depth) const {
    Choice choice;
    if (range.size() < 2) return choice;
    int64_t common = depth;  // extend the run every member shares
    while (std::all_of(range.begin(), range.end(), [&](int64_t b) {
      return shareable_[b] > common && block(b, common) == block(range.front(), common);
    }))
      ++common;
    if (common >= 1) {
      choice.saved = static_cast<int64_t>(range.size() - 1) * common;
      choice.groups.push_back({std::vector<int64_t>(range.begin(), range.end()), common});
    }
    Choice split;  // by block `common`: members without one stay alone
    for (std::size_t first = 0; first < range.size();) {
      const int64_t b = range[first];
      std::size_t last = first + 1;
      if (shareable_[b] > common)
        while (last < range.size() && shareable_[range[last]] > common && block(range[last], common) == block(b, common))
          ++last;
      if (shareable_[b] > common) {
        Choice part = best(range.subspan(first, last - first), common + 1);
        split.saved += part.saved;
        for (auto& group : part.groups) split.groups.push_back(std::move(group));
      }
      first = last;
    }
    return split.saved > choice.saved ? split : choice;
  }

 private:
  int32_t block(int64_t b, int64_t j) const { return table_[static_cast<std::size_t>(b * stride_ + j)]; }

  const std::vector<int32_t>& table_;
  int64_t stride_;
  const std::vector<int64_t>& shareable_;
};

void refuse_options(const Checker& check, const AttentionOptions& options) {
  const std::string with = "not with layout.share_prefixes (";
  if (options.causal == Causal::top_left)
    check.fail("options.causal: expected none or bottom_right with layout.share_prefixes (a shared prefix is "
               "seen whole by every new query), got top_left");
  if (options.window.active())
    check.fail("options.window: " + with + "a window depends on each query's position; the shared pass takes "
               "queries of several sequences at once)");
  if (!options.alibi_slopes.empty())
    check.fail("options.alibi_slopes: " + with + "ALiBi depends on each query's position; the shared pass takes "
               "queries of several sequences at once)");
  if (options.execution.fixed_key_split)
    check.fail("options.execution.fixed_key_split: " + with + "it promises a row's bits depend only on the row and "
               "its keys; a shared pass makes them depend on the group)");
}

}  // namespace

SharedPrefixes find_shared_prefixes(const Checker& check, const BatchLayout& layout, const AttentionOptions& options,
                                    const std::vector<int64_t>& cu_q, std::vector<int64_t>& lengths,
                                    std::vector<int32_t>& table, int64_t table_stride, int64_t block_size) {
  SharedPrefixes shared;
  if (!layout.share_prefixes) return shared;
  if (layout.block_table.empty())
    check.fail("layout.share_prefixes: expected a paged layout (block_table): sequences share a prefix by naming "
               "the same pool blocks, which contiguous caches cannot");
  refuse_options(check, options);
  if (resolve_backend(options, false, false) != Backend::cpu) return shared;  // the reference: the plain step
  const auto batch = static_cast<int64_t>(lengths.size());
  // Whole blocks each sequence may share: those before its first new token.
  std::vector<int64_t> shareable(static_cast<std::size_t>(batch), 0), order;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t queries = cu_q[b + 1] - cu_q[b];
    if (queries == 0) continue;
    shareable[b] = (lengths[b] - queries) / block_size;
    if (shareable[b] > 0) order.push_back(b);
  }
  const auto row = [&](int64_t b) {
    const auto* first = table.data() + b * table_stride;
    return std::span<const int32_t>(first, static_cast<std::size_t>(shareable[b]));
  };
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    const auto a = row(x), c = row(y);
    return std::lexicographical_compare(a.begin(), a.end(), c.begin(), c.end());
  });
  GroupFinder::Choice choice = GroupFinder(table, table_stride, shareable).best(order, 0);
  std::sort(choice.groups.begin(), choice.groups.end(),
            [](const auto& x, const auto& y) { return *std::min_element(x.first.begin(), x.first.end()) <
                                                      *std::min_element(y.first.begin(), y.first.end()); });

  shared.table_stride = table_stride;
  shared.table.assign(choice.groups.size() * static_cast<std::size_t>(table_stride), 0);
  for (std::size_t g = 0; g < choice.groups.size(); ++g) {
    auto& [members, blocks] = choice.groups[g];
    std::sort(members.begin(), members.end());
    // The group's pass reads its shared blocks through its first member's table row.
    std::copy_n(table.begin() + members.front() * table_stride, blocks,
                shared.table.begin() + static_cast<int64_t>(g) * table_stride);
    for (const int64_t b : members) {
      for (int64_t q = cu_q[b]; q < cu_q[b + 1]; ++q) shared.stacked_rows.push_back(q);
      // The member's own keys: its table row and length from the first unshared block on.
      auto first = table.begin() + b * table_stride;
      std::rotate(first, first + blocks, first + table_stride);
      std::fill(first + (table_stride - blocks), first + table_stride, 0);
      lengths[b] -= blocks * block_size;
    }
    shared.groups.push_back({.sequences = members, .keys = blocks * block_size});
  }
  return shared;
}

void plan_prefix_passes(SharedPrefixes& shared, const ForwardProblem<float>& step, StorageType storage) {
  if (!shared.active()) return;
  ForwardProblem<float>& p = shared.problem;
  const auto groups = static_cast<int64_t>(shared.groups.size());
  std::vector<int64_t> cu_q{0}, cu_k{0};
  int64_t longest_q = 0, longest_k = 0;
  for (const PrefixGroup& group : shared.groups) {
    int64_t rows = 0;
    for (const int64_t b : group.sequences) rows += step.mask.q_len(b);
    cu_q.push_back(cu_q.back() + rows);
    cu_k.push_back(cu_k.back() + group.keys);
    longest_q = std::max(longest_q, rows);
    longest_k = std::max(longest_k, group.keys);
  }
  p.extents = step.extents;
  p.extents.batch = groups;
  p.extents.q_len = longest_q;
  p.extents.k_len = longest_k;
  p.scale = step.scale;
  p.mask.causal = Causal::none;  // the prefix precedes every member's new tokens
  p.mask.sequences = {.count = groups, .dense_q_len = 0, .dense_k_len = 0, .cu_q = cu_q, .cu_k = cu_k};
  p.modifiers.softcap = step.modifiers.softcap;  // sinks join the members' own parts, once
  p.threads = step.threads;
  p.precision = step.precision;
  shared.schedule.emplace(p.extents, p.mask, storage, cpu::decode_vector_lanes(), false, nullptr,
                          cpu::latent_blocks(p, storage));
}

PrefixRun prepare_prefix_run(const SharedPrefixes& shared, ForwardProblem<float>& step) {
  PrefixRun run;
  const Extents& e = step.extents;
  const auto rows = static_cast<int64_t>(shared.stacked_rows.size());
  const int64_t total_q = step.mask.sequences.cu_q.back();
  const auto floats = [&](int64_t count, int64_t dim) {
    return static_cast<std::size_t>(checked_product("qkv::BatchPlan::run", "the shared prefixes' rows",
                                                    {{"rows", count}, {"heads", e.q_heads}, {"dim", dim}}));
  };
  const bool needs_lse = step.args.lse.empty();
  const std::size_t bytes =
      (floats(rows, e.head_dim) + floats(rows, e.v_dim) + floats(rows, 1) + (needs_lse ? floats(total_q, 1) : 0)) *
      sizeof(float);
  allocate_or_throw("qkv::BatchPlan::run", "the shared prefixes' rows", bytes, [&] {
    run.q.resize(floats(rows, e.head_dim));
    run.out.resize(floats(rows, e.v_dim));
    run.lse.resize(floats(rows, 1));
    if (needs_lse) run.step_lse.resize(floats(total_q, 1));
  });
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < e.q_heads; ++h) {
      const float* from = &step.args.q(0, shared.stacked_rows[static_cast<std::size_t>(r)], h, 0);
      std::copy(from, from + e.head_dim, run.q.begin() + (r * e.q_heads + h) * e.head_dim);
    }
  if (needs_lse)
    step.args.lse = View3<float>(run.step_lse.data(), {e.batch, e.q_heads, total_q}, {0, total_q, 1});
  return run;
}

void run_prefix_passes(const SharedPrefixes& shared, const ForwardProblem<float>& step, PrefixRun& run) {
  ForwardProblem<float> p = shared.problem;
  const Extents& e = p.extents;
  const auto rows = static_cast<int64_t>(shared.stacked_rows.size());
  p.extents.k_len = step.extents.k_len;  // the pool's capacity a sequence, as the step's
  p.args.q = View4<const float>(run.q.data(), {e.batch, rows, e.q_heads, e.head_dim},
                                {0, e.q_heads * e.head_dim, e.head_dim, 1});
  p.args.out = View4<float>(run.out.data(), {e.batch, rows, e.q_heads, e.v_dim}, {0, e.q_heads * e.v_dim, e.v_dim, 1});
  p.args.lse = View3<float>(run.lse.data(), {e.batch, e.q_heads, rows}, {0, rows, 1});
  p.kv = step.kv;
  p.kv.block_table = shared.table.data();
  p.kv.table_stride = shared.table_stride;
  run_planned_forward(p, Backend::cpu, &*shared.schedule);
}

void merge_prefix_passes(const SharedPrefixes& shared, const ForwardProblem<float>& step, PrefixRun& run) {
  const Extents& e = step.extents;
  const auto rows = static_cast<int64_t>(shared.stacked_rows.size());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = shared.stacked_rows[static_cast<std::size_t>(r)];
    for (int64_t h = 0; h < e.q_heads; ++h)
      merge_lse_row(&step.args.out(0, n, h, 0), step.args.out.strides[3], step.args.lse(0, h, n),
                    run.out.data() + (r * e.q_heads + h) * e.v_dim, 1, run.lse[static_cast<std::size_t>(h * rows + r)],
                    e.v_dim);
  }
}

void refuse_with_shared_prefixes(const Checker& check, const SharedPrefixes& shared, const KeyIndices& indices,
                                 const KvSource& kv) {
  if (!shared.active()) return;
  if (!indices.empty())
    check.fail("indices: not with a plan whose sequences share prefixes (layout.share_prefixes): a key list names "
               "keys along the whole sequence, which the plan splits");
  if (kv.windowed())
    check.fail("cache: a cache with a float window, not with a plan whose sequences share prefixes "
               "(layout.share_prefixes): its window rows sit at positions the shared pass does not keep");
}

}  // namespace qkv::detail
