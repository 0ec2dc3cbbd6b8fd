// qkv::decode and KVCache::attend with key lists (DeepSeek sparse attention's top-k on a
// cache). Each (sequence, query, list) becomes one batch entry of a gathered problem:
// its keys are the row's attended set A (core/key_selection.hpp: listed, allowed by the
// call's causal rule and cache length, sorted, each once), read in place through the
// key/value source's gathered positions (core/kv_source.hpp) — any storage, contiguous
// or paged, with its scales. The split-K kernel then runs that problem unchanged: a
// row's keys are split into chunks by their count alone, so results are bitwise the
// same for every thread count, and long lists use every thread. Per-kv-head lists run
// one gathered problem per kv head (its group's query heads and sinks).
// Scratch: the lists' positions (B·lists·Nq·topk) and a copy of q and of the outputs in
// the gathered layout — nothing the size of the cache, nothing Nq × Nk.
#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cache/decode_source.hpp"
#include "core/dispatch.hpp"
#include "core/key_selection.hpp"
#include "core/validate.hpp"
#include "qkv/attention.hpp"
#include "qkv/error.hpp"

namespace qkv::detail {
namespace {

// [B, Nq, topk], [B, Hkv, Nq, topk] or packed [total_q, topk], as the caller passed it.
template <class I>
Described described_lists(const TensorView<const I, 4>& view, const KeyIndices& indices) {
  if (indices.packed())
    return describe("indices", TensorView<const I, 2>(view.data, {view.shape[2], view.shape[3]},
                                                      {view.strides[2], view.strides[3]}));
  if (!indices.shared_by_heads()) return describe("indices", view);
  return describe("indices", TensorView<const I, 3>(view.data, {view.shape[0], view.shape[2], view.shape[3]},
                                                    {view.strides[0], view.strides[2], view.strides[3]}));
}

// The lists' batch entry and row of query i of sequence b: packed lists are one batch
// entry of every sequence's rows in turn.
struct ListRow {
  int64_t entry, row;
};
ListRow list_row(const KeyIndices& indices, const Sequences& sequences, int64_t b, int64_t i) {
  if (indices.packed()) return {0, sequences.q_begin(b) + i};
  return {b, i};
}

// Shape, apart from the outputs, and every index in [−1, cache length): the first that
// is not names its batch entry and query row.
template <class I>
KeySelection checked_lists(const Checker& check, const KeyIndices& indices, const TensorView<const I, 4>& view,
                           const ForwardProblem<float>& p) {
  const Extents& e = p.extents;
  const Sequences& seq = p.mask.sequences;
  const Described d = described_lists(view, indices);
  check.expect_well_formed(d, /*inner_contiguous=*/false);
  if (indices.packed()) {
    if (!seq.varlen()) check.fail("indices: expected [B, Nq, topk] or [B, Hkv, Nq, topk], got packed [total_q, topk]");
    check.expect_extent(d, 0, "total_q", seq.cu_q.back(), "as q.shape[0]");
  } else {
    if (seq.varlen()) check.fail("indices: expected packed [total_q, topk] lists");
    check.expect_extent(d, 0, "batch", e.batch, "as q.shape[0]");
    if (indices.shared_by_heads()) {
      check.expect_extent(d, 1, "queries", e.q_len, "as q.shape[1]");
    } else {
      check.expect_extent(d, 1, "heads", e.kv_heads, "as the cache's kv heads");
      check.expect_extent(d, 2, "queries", e.q_len, "as q.shape[1]");
    }
  }
  // The outputs as the caller passed them (varlen: the packed views behind the batched).
  std::vector<Described> outputs;
  const View4<float>& out = p.args.out;
  const View3<float>& lse = p.args.lse;
  if (seq.varlen()) {
    outputs.push_back(describe("out", View3<float>(out.data, {out.shape[1], out.shape[2], out.shape[3]},
                                                   {out.strides[1], out.strides[2], out.strides[3]})));
    if (!lse.empty())
      outputs.push_back(describe("lse", TensorView<float, 2>(lse.data, {lse.shape[1], lse.shape[2]},
                                                             {lse.strides[1], lse.strides[2]})));
  } else {
    outputs.push_back(describe("out", out));
    if (!lse.empty()) outputs.push_back(describe("lse", lse));
  }
  check.expect_outputs_apart(outputs, std::array{d});
  for (int64_t b = 0; b < e.batch; ++b) {
    const int64_t length = p.mask.valid_keys(b);
    for (int64_t list = 0; list < view.shape[1]; ++list)
      for (int64_t i = 0; i < p.mask.q_len(b); ++i) {
        const ListRow at = list_row(indices, seq, b, i);
        for (int64_t t = 0; t < view.shape[3]; ++t) {
          const auto j = static_cast<int64_t>(view(at.entry, list, at.row, t));
          if (j >= -1 && j < length) continue;
          std::string where = indices.packed() ? std::to_string(at.row) + ", " : std::to_string(b) + ", ";
          if (!indices.packed()) where += (indices.shared_by_heads() ? "" : std::to_string(list) + ", ") + std::to_string(i) + ", ";
          check.fail("indices[" + where + std::to_string(t) + "] (batch " + std::to_string(b) + ", query row " +
                     std::to_string(i) + "): expected -1 (no key) or a cached position 0.." +
                     std::to_string(length - 1) + " (cache_lengths[" + std::to_string(b) + "] = " +
                     std::to_string(length) + "), got " + std::to_string(j));
        }
      }
  }
  return KeySelection{indices, view.shape[1], view.shape[3]};
}

}  // namespace

void refuse_for_key_lists(const Checker& check, const AttentionOptions& options) {
  if (options.window.active())
    check.fail("options.window: not supported with indices (list only the window's keys)");
  if (!options.alibi_slopes.empty())
    check.fail("options.alibi_slopes: not supported with indices (use the dense decode)");
}

namespace {

KeySelection checked_key_lists(const Checker& check, const ForwardProblem<float>& dense, const KeyIndices& indices) {
  if (indices.empty()) check.fail("indices: required, [B, Nq, topk] or [B, Hkv, Nq, topk] of int32 or int64");
  if (dense.mask.window.left >= 0 || dense.mask.window.right >= 0)
    check.fail("options.window: not supported with indices (list only the window's keys)");
  if (dense.modifiers.has_alibi()) check.fail("options.alibi_slopes: not supported with indices (use the dense decode)");
  return indices.is_int64() ? checked_lists(check, indices, indices.int64_view(), dense)
                            : checked_lists(check, indices, indices.int32_view(), dense);
}

}  // namespace

void check_key_lists(const Checker& check, const ForwardProblem<float>& dense, const KeyIndices& indices) {
  (void)checked_key_lists(check, dense, indices);
}

void decode_key_lists(const Checker& check, const ForwardProblem<float>& dense, const KeyIndices& indices,
                      Backend backend) {
  const KeySelection keys = checked_key_lists(check, dense, indices);
  const Extents& e = dense.extents;
  const Sequences& seq = dense.mask.sequences;
  // Entries of a gathered problem: every (sequence, query) row, in order.
  int64_t entries = 0;
  for (int64_t b = 0; b < e.batch; ++b) entries += dense.mask.q_len(b);
  if (entries == 0) return;
  const int64_t lists = keys.lists, topk = keys.topk;
  const int64_t heads = lists == 1 ? e.q_heads : e.group();  // query heads of one gathered problem
  const KvSource& kv = dense.kv;

  // Each row's attended set, as cache positions; with a float window, how many of them
  // (a prefix: they ascend) are the quantized storage's.
  std::vector<int64_t> positions(static_cast<std::size_t>(lists * entries * topk));
  std::vector<int64_t> counts(static_cast<std::size_t>(lists * entries));
  std::vector<int64_t> stored(kv.windowed() ? counts.size() : 0);
  std::vector<int64_t> sequence(static_cast<std::size_t>(entries));
  std::vector<int32_t> row(static_cast<std::size_t>(topk));
  // Sorted and each key once (core/key_selection.hpp's set, in its canonical order).
  for (int64_t list = 0; list < lists; ++list) {
    int64_t entry = list * entries;
    for (int64_t b = 0; b < e.batch; ++b)
      for (int64_t i = 0; i < dense.mask.q_len(b); ++i, ++entry) {
        int64_t count = 0;
        const int64_t end = dense.mask.key_end(b, i);
        const ListRow at = list_row(indices, seq, b, i);
        for (int64_t t = 0; t < topk; ++t) {
          const int64_t j = keys.listed(at.entry, list, at.row, t);
          if (j >= 0 && j < end) row[static_cast<std::size_t>(count++)] = static_cast<int32_t>(j);
        }
        std::sort(row.begin(), row.begin() + count);
        count = std::unique(row.begin(), row.begin() + count) - row.begin();
        std::copy(row.begin(), row.begin() + count, positions.begin() + entry * topk);
        counts[static_cast<std::size_t>(entry)] = count;
        sequence[static_cast<std::size_t>(entry - list * entries)] = b;
        if (kv.windowed())
          stored[static_cast<std::size_t>(entry)] =
              std::lower_bound(row.begin(), row.begin() + count, kv.quantized_lengths[b]) - row.begin();
      }
  }

  // The gathered problems: entry n has one query, `heads` query heads and the keys of
  // its list, causal already applied; the rest (scale, soft-cap, sinks, threads, the
  // fixed key split) as the call's.
  std::vector<float> q(static_cast<std::size_t>(entries * heads * e.head_dim));
  std::vector<float> out(static_cast<std::size_t>(lists * entries * heads * e.v_dim));
  const bool want_lse = !dense.args.lse.empty();
  std::vector<float> lse(want_lse ? static_cast<std::size_t>(lists * entries * heads) : 0);
  const auto rows = dense.rows();
  for (int64_t list = 0; list < lists; ++list) {
    const int64_t head0 = lists == 1 ? 0 : list * heads;
    ForwardProblem<float> p = dense;
    p.extents = Extents{.batch = entries, .q_len = 1, .k_len = topk, .q_heads = heads,
                        .kv_heads = lists == 1 ? e.kv_heads : 1, .head_dim = e.head_dim, .v_dim = e.v_dim};
    p.mask = MaskRule{};
    p.mask.sequences.count = entries;
    p.mask.sequences.dense_q_len = 1;
    p.mask.sequences.dense_k_len = topk;
    p.mask.key_lengths = std::span<const int64_t>(counts).subspan(static_cast<std::size_t>(list * entries),
                                                                  static_cast<std::size_t>(entries));
    p.mask.has_sinks = dense.modifiers.has_sinks();
    if (lists > 1 && dense.modifiers.has_sinks())
      p.modifiers.sinks = dense.modifiers.sinks.subspan(static_cast<std::size_t>(head0), static_cast<std::size_t>(heads));
    p.args = {};
    p.args.q = View4<const float>::contiguous(q.data(), {entries, 1, heads, e.head_dim});
    p.args.out = View4<float>::contiguous(out.data() + list * entries * heads * e.v_dim, {entries, 1, heads, e.v_dim});
    if (want_lse) p.args.lse = View3<float>::contiguous(lse.data() + list * entries * heads, {entries, heads, 1});
    p.kv = kv;
    p.kv.key_positions = positions.data() + list * entries * topk;
    p.kv.positions_stride = topk;
    p.kv.key_sequence = sequence.data();
    p.kv.key_head = lists == 1 ? 0 : list;
    if (kv.windowed()) p.kv.gathered_stored = stored.data() + list * entries;
    int64_t entry = 0;
    for (int64_t b = 0; b < e.batch; ++b)
      for (int64_t i = 0; i < dense.mask.q_len(b); ++i, ++entry)
        for (int64_t h = 0; h < heads; ++h)
          std::copy_n(rows.q(b, i, head0 + h), e.head_dim, q.begin() + (entry * heads + h) * e.head_dim);
    run_forward(p, backend);
  }
  // Every run done (none can fail past here): the outputs, in the call's layout.
  for (int64_t list = 0; list < lists; ++list) {
    const int64_t head0 = lists == 1 ? 0 : list * heads;
    int64_t entry = 0;
    for (int64_t b = 0; b < e.batch; ++b)
      for (int64_t i = 0; i < dense.mask.q_len(b); ++i, ++entry)
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t at = (list * entries + entry) * heads + h;
          std::copy_n(out.begin() + at * e.v_dim, e.v_dim, rows.out(b, i, head0 + h));
          if (want_lse) rows.lse(b, head0 + h, i) = lse[static_cast<std::size_t>(at)];
        }
  }
}

}  // namespace qkv::detail
