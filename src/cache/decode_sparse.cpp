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

namespace qkv::detail {
namespace {

// [B, Nq, topk] or [B, Hkv, Nq, topk], as the caller passed it.
template <class I>
Described described_lists(const TensorView<const I, 4>& view, bool shared) {
  if (!shared) return describe("indices", view);
  return describe("indices", TensorView<const I, 3>(view.data, {view.shape[0], view.shape[2], view.shape[3]},
                                                    {view.strides[0], view.strides[2], view.strides[3]}));
}

// Shape, apart from the outputs, and every index in [−1, cache_lengths[b]): the first
// that is not names its batch entry and query row.
template <class I>
KeySelection checked_lists(const Checker& check, const KeyIndices& indices, const TensorView<const I, 4>& view,
                           const ForwardProblem<float>& p) {
  const Extents& e = p.extents;
  const bool shared = indices.shared_by_heads();
  const Described d = described_lists(view, shared);
  check.expect_well_formed(d, /*inner_contiguous=*/false);
  check.expect_extent(d, 0, "batch", e.batch, "as q.shape[0]");
  if (shared) {
    check.expect_extent(d, 1, "queries", e.q_len, "as q.shape[1]");
  } else {
    check.expect_extent(d, 1, "heads", e.kv_heads, "as the cache's kv heads");
    check.expect_extent(d, 2, "queries", e.q_len, "as q.shape[1]");
  }
  std::vector<Described> outputs{describe("out", p.args.out)};
  if (!p.args.lse.empty()) outputs.push_back(describe("lse", p.args.lse));
  check.expect_outputs_apart(outputs, std::array{d});
  for (int64_t b = 0; b < view.shape[0]; ++b) {
    const int64_t length = p.mask.key_lengths[static_cast<std::size_t>(b)];
    for (int64_t list = 0; list < view.shape[1]; ++list)
      for (int64_t i = 0; i < view.shape[2]; ++i)
        for (int64_t t = 0; t < view.shape[3]; ++t) {
          const auto j = static_cast<int64_t>(view(b, list, i, t));
          if (j >= -1 && j < length) continue;
          const std::string at = std::to_string(b) + ", " + (shared ? "" : std::to_string(list) + ", ") +
                                 std::to_string(i) + ", " + std::to_string(t);
          check.fail("indices[" + at + "] (batch " + std::to_string(b) + ", query row " + std::to_string(i) +
                     "): expected -1 (no key) or a cached position 0.." + std::to_string(length - 1) +
                     " (cache_lengths[" + std::to_string(b) + "] = " + std::to_string(length) + "), got " +
                     std::to_string(j));
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

void decode_key_lists(const Checker& check, const ForwardProblem<float>& dense, const KeyIndices& indices,
                      const AttentionOptions& options) {
  if (indices.empty()) check.fail("indices: required, [B, Nq, topk] or [B, Hkv, Nq, topk] of int32 or int64");
  const KeySelection keys = indices.is_int64() ? checked_lists(check, indices, indices.int64_view(), dense)
                                               : checked_lists(check, indices, indices.int32_view(), dense);
  const Extents& e = dense.extents;
  if (e.batch == 0 || e.q_len == 0) return;
  const int64_t lists = keys.lists, topk = keys.topk, q_len = e.q_len;
  const int64_t entries = e.batch * q_len;  // per list: (sequence, query)
  const int64_t heads = lists == 1 ? e.q_heads : e.group();  // query heads of one gathered problem
  const KvSource& kv = dense.kv;

  // Each row's attended set, as cache positions; with a float window, how many of them
  // (a prefix: they ascend) are the quantized storage's.
  std::vector<int64_t> positions(static_cast<std::size_t>(lists * entries * topk));
  std::vector<int64_t> counts(static_cast<std::size_t>(lists * entries));
  std::vector<int64_t> stored(kv.windowed() ? counts.size() : 0);
  std::vector<int64_t> sequence(static_cast<std::size_t>(entries));
  int64_t longest = 0;
  for (int64_t b = 0; b < e.batch; ++b) longest = std::max(longest, dense.mask.key_lengths[static_cast<std::size_t>(b)]);
  std::vector<uint64_t> marks(static_cast<std::size_t>((longest + 63) / 64));
  std::vector<int32_t> row(static_cast<std::size_t>(topk));
  for (int64_t list = 0; list < lists; ++list)
    for (int64_t b = 0; b < e.batch; ++b)
      for (int64_t i = 0; i < q_len; ++i) {
        const int64_t entry = list * entries + b * q_len + i;
        const int64_t count = keys.attended_keys(dense.mask, b, list, i, row.data(), marks);
        std::copy(row.begin(), row.begin() + count, positions.begin() + entry * topk);
        counts[static_cast<std::size_t>(entry)] = count;
        sequence[static_cast<std::size_t>(b * q_len + i)] = b;
        if (kv.windowed())
          stored[static_cast<std::size_t>(entry)] =
              std::lower_bound(row.begin(), row.begin() + count, kv.quantized_lengths[b]) - row.begin();
      }

  // The gathered problems: entry (b, i) has one query, `heads` query heads and the
  // keys of its list, causal already applied. Built (and so checked) before any run.
  std::vector<float> q(static_cast<std::size_t>(entries * heads * e.head_dim));
  std::vector<float> out(static_cast<std::size_t>(lists * entries * heads * e.v_dim));
  const bool want_lse = !dense.args.lse.empty();
  std::vector<float> lse(want_lse ? static_cast<std::size_t>(lists * entries * heads) : 0);
  AttentionOptions gathered_options = options;
  gathered_options.causal = Causal::none;
  std::vector<ForwardProblem<float>> problems;
  for (int64_t list = 0; list < lists; ++list) {
    if (lists > 1 && !options.sinks.empty())
      gathered_options.sinks = options.sinks.subspan(static_cast<std::size_t>(list * heads), static_cast<std::size_t>(heads));
    const auto q_view = View4<const float>::contiguous(q.data(), {entries, 1, heads, e.head_dim});
    const auto out_view = View4<float>::contiguous(out.data() + list * entries * heads * e.v_dim, {entries, 1, heads, e.v_dim});
    const View3<float> lse_view =
        want_lse ? View3<float>::contiguous(lse.data() + list * entries * heads, {entries, heads, 1}) : View3<float>{};
    ForwardProblem<float> p = cache_problem(check, gathered_options, q_view, out_view, lse_view,
                                            lists == 1 ? e.kv_heads : 1, topk, e.v_dim,
                                            std::span<const int64_t>(counts).subspan(static_cast<std::size_t>(list * entries),
                                                                                     static_cast<std::size_t>(entries)));
    p.kv = kv;
    p.kv.key_positions = positions.data() + list * entries * topk;
    p.kv.positions_stride = topk;
    p.kv.key_sequence = sequence.data();
    p.kv.key_head = lists == 1 ? 0 : list;
    if (kv.windowed()) p.kv.gathered_stored = stored.data() + list * entries;
    problems.push_back(p);
  }

  const Backend backend = resolve_backend(options, false, false);
  const auto qv = dense.args.q;
  for (int64_t list = 0; list < lists; ++list) {
    const int64_t head0 = lists == 1 ? 0 : list * heads;
    for (int64_t b = 0; b < e.batch; ++b)
      for (int64_t i = 0; i < q_len; ++i)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t c = 0; c < e.head_dim; ++c)
            q[static_cast<std::size_t>(((b * q_len + i) * heads + h) * e.head_dim + c)] = qv(b, i, head0 + h, c);
    run_forward(problems[static_cast<std::size_t>(list)], backend);
  }
  // Every run done (none can fail past here): the outputs, in the call's layout.
  for (int64_t list = 0; list < lists; ++list) {
    const int64_t head0 = lists == 1 ? 0 : list * heads;
    for (int64_t b = 0; b < e.batch; ++b)
      for (int64_t i = 0; i < q_len; ++i)
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t at = (list * entries + b * q_len + i) * heads + h;
          for (int64_t c = 0; c < e.v_dim; ++c)
            dense.args.out(b, i, head0 + h, c) = out[static_cast<std::size_t>(at * e.v_dim + c)];
          if (want_lse) dense.args.lse(b, head0 + h, i) = lse[static_cast<std::size_t>(at)];
        }
  }
}

}  // namespace qkv::detail
