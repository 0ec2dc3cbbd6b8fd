// Sparse attention backward on the cpu backend. In the forward pass, for each row i of
// head h with attended set A_i (core/key_selection.hpp),
//   s_ij = cap((scale·q_i)·k_j),  P_ij = e^(s_ij − lse_i),  O_i = Σ_(j∈A_i) P_ij·v_j
// so now, with D_i = ⟨dO_i, O_i⟩ (= Σ_j P_ij·dP_ij, FlashAttention's D):
//   dP_ij = ⟨dO_i, v_j⟩,   dS_ij = P_ij·(dP_ij − D_i)·cap'(·),
//   dQ_i = scale·Σ_(j∈A_i) dS_ij·k_j     (pass C: one writer per row; tiles of rows sweep the keys together)
//   dK_j = Σ_(i: j∈A_i) dS_ij·(scale·q_i),  dV_j = Σ_(i: j∈A_i) P_ij·dO_i   (pass D: per key block)
//   dsink_h = −Σ_i e^(sink_h − lse_i)·D_i                 (the sink: dP = 0, no value)
// A key receives from every query that lists it, so dK and dV are not written by scattering
// (that would need atomics and make the sums depend on the threads): pass D gives each
// block of kKeyBlock consecutive keys one writer. It visits the rows in ascending order,
// takes the part of each row's sorted set that falls in the block (a binary search) and
// computes that row's P and dS for those keys exactly as pass C does (the same tiles, the
// same query rows: the logits are the forward's to the last bit), then adds the tile
// products P^T·dO and dS^T·(scale·q) — keys × heads times heads × d — to the block's
// accumulators. Each loaded q and dO row is used by every listed key of the block and
// every head of the group, and the block's K, V, dK and dV rows stay in L2 across rows:
// the old per-key pass (one key against gathered query rows, one FMA per loaded float,
// the query workspace streamed from DRAM once per key) ran the MLA shape at 14% of the
// FMA peak. Every pass writes its own outputs, the same way on any thread: results are
// bitwise identical for every thread count.
//
// Fused, where the (batch, kv head) pairs keep the threads busy (two a thread, or one
// thread) and the float step computes the blocks: one thread takes a whole head, and
// pass C's tiles, in ascending order, also add each row's dK and dV terms to float sums of
// every key of the head (HeadGradients). S and dP are then computed once, not in both
// passes (five products a block, not seven; GQA 32/8 d 128 at 8k keys, causal top-2048:
// the backward 1.2× faster), with the same bits as the two passes.
//
// bfloat16 on vdpbf16ps takes the forward's pair step (any group; sparse_pair_step,
// sparse.hpp), groups of 16+ heads on the AMX tiles the tiles (sparse_dot_unit): S, dP
// and dQ's product there, in both passes; dK and dV stay float32.
//
// Workspace, per call: the sets (B·lists·Nq·topk int32, the size of the lists), scale·q
// and dO widened to float, D, and on a bf16 unit q and dO paired; nothing Nq × Nk.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/sparse_backward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/highway.h"
#include "cpu/block_ops-inl.h"
#include "cpu/decode_tiles-inl.h"
#include "cpu/sparse_gather-inl.h"
#include "cpu/sparse_backward_dots-inl.h"
#include "cpu/sparse_backward_state-inl.h"
#include "cpu/amx_dot.hpp"
#include "cpu/bf16_dot.hpp"

#ifndef QKV_CPU_SPARSE_BACKWARD_ONCE_
#define QKV_CPU_SPARSE_BACKWARD_ONCE_
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu/sparse.hpp"
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {
namespace {

// Keys keys[0, n) of (b, kv head g) against row i's group on the call's bf16 unit: their
// K and V rows gathered, then Pᵀ and dSᵀ (n × group) into s.dots.st and s.dots.dpt. The
// group's lse and D must be in s.dots.lse / s.dots.delta.
inline void BlockOnDots(const detail::SparseBackwardProblem<bfloat16>& problem, const Workspace& w, int64_t b,
                        int64_t i, int64_t g, const int32_t* keys, size_t n, Scratch<bfloat16>& s) {
  const auto& dense = problem.dense;
  const auto rows = dense.rows();
  const size_t group = static_cast<size_t>(dense.extents.group());
  const size_t d = static_cast<size_t>(dense.extents.head_dim), dv = static_cast<size_t>(dense.extents.v_dim);
  SparseDotScratch& x = s.dots;
  // Latent attention's values are its keys' first dv channels (v a view of k, as
  // DeepSeek's MLA cache is read): then they are gathered once, with the keys.
  bool values_in_keys = dv <= d;
  for (size_t j = 0; j < n; ++j) {
    const bfloat16* key = rows.k(b, keys[j], g);
    std::copy_n(key, d, x.keys.data() + j * d);
    values_in_keys = values_in_keys && rows.v(b, keys[j], g) == key;
  }
  if (!values_in_keys)
    for (size_t j = 0; j < n; ++j) std::copy_n(rows.v(b, keys[j], g), dv, x.values.data() + j * dv);
  const auto unit = static_cast<size_t>(w.unit_of(b, i, g, dense.extents.kv_heads));
  const auto scores = w.unit == Bf16Unit::amx ? amx::ScoresTransposed : bf16dot::ScoresTransposed;
  scores(x.keys.data(), static_cast<std::int64_t>(d), n, d, w.q_pairs.data() + unit * w.q_words, w.pair_ld, group,
         static_cast<float>(dense.scale), x.st.get(), x.ld);
  scores(values_in_keys ? x.keys.data() : x.values.data(), static_cast<std::int64_t>(values_in_keys ? d : dv), n, dv,
         w.dout_pairs.data() + unit * w.dout_words, w.pair_ld, group, 1.0f, x.dpt.get(), x.ld);
  WeightsAndGradientsTransposed(n, group, x.ld, x.lse.data(), x.delta.data(), x.st.get(), x.dpt.get());
}

// The pair step (sparse_pair_step): P and dS of row i over keys[0, n) of kv head g into
// s.scores / s.d_scores, S and dP on vdpbf16ps from the row's stored q and dO and the
// range's stored rows (s.stored) — S bit for bit the forward's pair step's.
inline void PairWeights(const detail::SparseBackwardProblem<bfloat16>& problem, const Workspace& w, int64_t b,
                        int64_t i, int64_t g, const int32_t* keys, size_t n, Scratch<bfloat16>& s) {
  const detail::Extents& e = problem.dense.extents;
  const size_t group = static_cast<size_t>(e.group()), padded = round_up(n, size_t{16});  // the kernel's 16 keys
  const auto rows = problem.dense.rows();
  const int64_t h = g * e.group();
  s.stored.Point(keys, n, padded);
  bf16dot::GroupScores(w.q_in_place ? rows.q(b, i, h) : w.q16_row(b, i, h), group, s.stored.k_rows(), padded, w.d,
                       static_cast<float>(problem.dense.scale), s.scores.get(), kGatherKeys);
  bf16dot::GroupScores(w.dout_in_place ? rows.dout(b, i, h) : w.dout16_row(b, i, h), group, s.stored.v_rows(),
                       padded, w.dv, 1.0f, s.d_scores.get(), kGatherKeys);
  GroupWeightsAndGradients(problem, w, b, i, g, n, padded, s);
}

// The group's lse and D of row i into s.dots.
template <class T>
void GroupRowStatistics(const detail::SparseBackwardProblem<T>& problem, const Workspace& w, int64_t b, int64_t i,
                        int64_t g, Scratch<T>& s) {
  const auto rows = problem.dense.rows();
  const int64_t group = problem.dense.extents.group();
  for (int64_t r = 0; r < group; ++r) {
    s.dots.lse[static_cast<size_t>(r)] = static_cast<float>(rows.lse(b, g * group + r, i));
    s.dots.delta[static_cast<size_t>(r)] = w.delta[static_cast<size_t>(w.head_row(b, i, g * group + r))];
  }
}

// Pass A, row (b, i): the sets of every list, scale·q and dO in float, D = ⟨dO, O⟩.
template <class T>
void PrepareRow(const detail::SparseBackwardProblem<T>& problem, Workspace& w, int64_t b, int64_t i,
                std::vector<uint64_t>& marks) {
  const auto& dense = problem.dense;
  const detail::Extents& e = dense.extents;
  const auto rows = dense.rows();
  for (int64_t list = 0; list < w.lists; ++list) {
    const int64_t at = w.row(b, list, i);
    w.set_sizes[at] = static_cast<int32_t>(problem.keys.attended_keys(dense.mask, b, list, i, w.sets.data() + at * w.topk, marks));
  }
  const float scale = static_cast<float>(dense.scale);
  for (int64_t h = 0; h < e.q_heads; ++h) {
    float* q = w.scaled_q.get() + w.head_row(b, i, h) * w.d_pad;
    float* dout = w.dout.get() + w.head_row(b, i, h) * w.dv_pad;
    ScaledRow(rows.q(b, i, h), static_cast<size_t>(e.head_dim), w.d_pad, scale, q);
    WidenRows(rows.dout(b, i, h), 0, 1, static_cast<size_t>(e.v_dim), dout, w.dv_pad);
    const T* out = rows.out(b, i, h);
    double delta = 0.0;
    for (int64_t c = 0; c < e.v_dim; ++c) delta += static_cast<double>(dout[c]) * static_cast<double>(Widen(out[c]));
    w.delta[static_cast<size_t>(w.head_row(b, i, h))] = static_cast<float>(delta);
  }
  if constexpr (std::is_same_v<T, bfloat16>) {
    if (w.pairs)
      for (int64_t h = 0; h < e.q_heads; ++h) {
        if (!w.q_in_place) std::copy_n(rows.q(b, i, h), w.d, w.q16.data() + w.head_row(b, i, h) * w.d);
        if (!w.dout_in_place) std::copy_n(rows.dout(b, i, h), w.dv, w.dout16.data() + w.head_row(b, i, h) * w.dv);
      }
    if (w.unit == Bf16Unit::fp32_fma) return;
    const auto group = static_cast<size_t>(e.group());
    for (int64_t g = 0; g < e.kv_heads; ++g) {
      const int64_t unit = w.unit_of(b, i, g, e.kv_heads);
      bf16dot::PackQueryPairs(rows.q(b, i, g * e.group()), dense.args.q.strides[2], group,
                              static_cast<size_t>(e.head_dim), w.q_pairs.data() + static_cast<size_t>(unit) * w.q_words, w.pair_ld);
      bf16dot::PackQueryPairs(rows.dout(b, i, g * e.group()), dense.args.dout.strides[2], group,
                              static_cast<size_t>(e.v_dim), w.dout_pairs.data() + static_cast<size_t>(unit) * w.dout_words, w.pair_ld);
    }
  }
}

// dQ of the group's heads from the accumulated Σ_j dS_rj·k_j: scale times it, stored.
template <class T>
void StoreQueryGradients(const detail::SparseBackwardProblem<T>& problem, const Workspace& w, int64_t b, int64_t i,
                         int64_t g, const float* sums) {
  const auto& dense = problem.dense;
  const auto rows = dense.rows();
  const int64_t group = dense.extents.group();
  const float scale = static_cast<float>(dense.scale);
  for (int64_t r = 0; r < group; ++r) {
    T* dq = rows.dq(b, i, g * group + r);
    const float* acc = sums + static_cast<size_t>(r) * w.d_pad;
    for (int64_t c = 0; c < dense.extents.head_dim; ++c) dq[c] = StoreAs<T>(scale * acc[c]);
  }
}

// Pass C, one block of row i's attended keys (keys[0, n); next[0, ahead) the row's
// following block, prefetched) of kv head g: dQ of the group's heads += Σ_j dS_rj·k_j
// into acc (group × d_pad).
template <class T>
void QueryBlock(const detail::SparseBackwardProblem<T>& problem, const Workspace& w, int64_t b, int64_t i, int64_t g,
                const int32_t* keys, size_t n, const int32_t* next, size_t ahead, float* acc, const KeySums& key_sums,
                Scratch<T>& s) {
  const auto& dense = problem.dense;
  const detail::Extents& e = dense.extents;
  const auto rows = dense.rows();
  const size_t group = static_cast<size_t>(e.group()), lanes = VectorLanes();
  if constexpr (std::is_same_v<T, bfloat16>) {
    if (w.unit != Bf16Unit::fp32_fma) {
      GroupRowStatistics(problem, w, b, i, g, s);
      BlockOnDots(problem, w, b, i, g, keys, n, s);
      // dQ_r += Σ_j dS_rj·k_j, dS rounded to bfloat16 once (alpha 1: the running sum is kept).
      const size_t d = static_cast<size_t>(e.head_dim);
      (w.unit == Bf16Unit::amx ? amx::RescaleAddWeighted : bf16dot::RescaleAddWeighted)(
          s.dots.dpt.get(), s.dots.ld, group, n, s.dots.keys.data(), static_cast<std::int64_t>(d), d,
          {s.dots.p_pairs.data(), s.dots.k_pairs.data()}, acc, w.d_pad, s.ones.data());
      return;
    }
    if (w.pairs) {
      PairWeights(problem, w, b, i, g, keys, n, s);
      // dQ_r += Σ_j dS_rj·k_j, dS rounded to bfloat16 once (as on the unit above).
      bf16dot::GroupValues(s.d_scores.get(), kGatherKeys, group, n, s.stored.k_rows(), w.d, s.value_words.data(), acc,
                           w.d_pad, nullptr);
      if (key_sums.active()) {  // the fused schedule, as below
        TransposeWeights(n, group, s);
        AddRowToKeys(w, w.q_row(b, i, g * e.group()), w.dout_row(b, i, g * e.group()), keys, n, group,
                     s.weights_t.get(), s.d_weights_t.get(), key_sums, s);
      }
      return;
    }
  }
  const float* q = w.q_row(b, i, g * e.group());
  const float* dout = w.dout_row(b, i, g * e.group());
  const size_t padded = round_up(n, lanes);
  // The block's rows: widened once for the tile's range (QueryTileGradients), or gathered.
  const auto visit = [&](auto&& f) {
    if (s.range.active()) return s.range.Visit(f);
    s.block.Visit(f);
  };
  if (s.range.active()) {
    s.range.Point(keys, n, padded);
  } else {
    s.block.Gather(n, padded, [&](size_t j) { return rows.k(b, keys[j], g); },
                   [&](size_t j) { return rows.v(b, keys[j], g); });
    s.block.GatherNext(ahead, [&](size_t j) { return rows.k(b, next[j], g); },
                       [&](size_t j) { return rows.v(b, next[j], g); });
  }
  visit([&](auto k_rows, auto v_rows, size_t k_dim, size_t v_dim, auto k_ahead, auto v_ahead) {
    for (size_t j = 0; j < padded; j += lanes) {
      ScoreKeys(group, q, w.d_pad, k_rows + j, k_dim, k_ahead.offset(j), s.scores.get() + j, kGatherKeys);
      ScoreKeys(group, dout, w.dv_pad, v_rows + j, v_dim, v_ahead.offset(j), s.d_scores.get() + j, kGatherKeys);
    }
  });
  GroupWeightsAndGradients(problem, w, b, i, g, n, padded, s);
  visit([&](auto k_rows, auto, size_t k_dim, size_t, auto, auto) {
    using S = std::remove_cv_t<std::remove_pointer_t<std::remove_pointer_t<decltype(k_rows)>>>;
    // dQ_r += Σ_j dS_rj·k_j (alpha 1: the running sum is kept).
    ValueBlock(group, s.d_scores.get(), kGatherKeys, n, k_rows, k_dim, Ahead<S>{}, s.ones.data(), acc, w.d_pad);
  });
  if (key_sums.active()) {  // the fused schedule: the row's dK and dV terms from the same P and dS
    TransposeWeights(n, group, s);
    AddRowToKeys(w, q, dout, keys, n, group, s.weights_t.get(), s.d_weights_t.get(), key_sums, s);
  }
}

// Pass C, rows [i0, i0 + tile) of (b, kv head g): dQ of each row's group over the blocks
// of its set, the tile's rows sweeping the keys together (SweepTile, as the forward).
template <class T>
void QueryTileGradients(const detail::SparseBackwardProblem<T>& problem, const Workspace& w, int64_t b, int64_t i0,
                        size_t tile, int64_t g, const KeySums& key_sums, Scratch<T>& s) {
  const size_t sums = static_cast<size_t>(problem.dense.extents.group()) * w.d_pad;
  std::fill(s.acc.get(), s.acc.get() + tile * sums, 0.0f);
  const int64_t list = problem.keys.list_of(g);
  const amx::TileScope tile_scope(w.unit == Bf16Unit::amx);  // one configuration for the unit's blocks
  SweepTile(
      tile, w.unit != Bf16Unit::fp32_fma ? kWholeRange : kRangeKeys,
      [&](size_t t) {
        const int64_t at = w.row(b, list, i0 + static_cast<int64_t>(t));
        return std::pair{static_cast<const int32_t*>(w.sets.data() + at * w.topk), static_cast<size_t>(w.set_sizes[at])};
      },
      [&](size_t t, const int32_t* keys, size_t n, const int32_t* next, size_t ahead) {
        QueryBlock(problem, w, b, i0 + static_cast<int64_t>(t), g, keys, n, next, ahead, s.acc.get() + t * sums, key_sums, s);
      },
      [&](int64_t begin, int64_t end) {
        const auto rows = problem.dense.rows();
        if (s.stored.active())
          s.stored.Copy(begin, end, [&](int64_t j) { return rows.k(b, j, g); }, [&](int64_t j) { return rows.v(b, j, g); });
        if (!s.range.active()) return;
        s.range.Widen(begin, end, [&](int64_t j) { return rows.k(b, j, g); }, [&](int64_t j) { return rows.v(b, j, g); });
      });
  for (size_t t = 0; t < tile; ++t)
    StoreQueryGradients(problem, w, b, i0 + static_cast<int64_t>(t), g, s.acc.get() + t * sums);
}

// Pass D's Pᵀ and dSᵀ of row i's keys[0, n) on the call's bf16 unit, pointed to by
// weights_t / d_weights_t (n × group: the layout AddWeightedRows reads, as the pairs'
// leading dimension is the group itself); false where the float step computes them.
template <class T>
bool DotWeights(const detail::SparseBackwardProblem<T>& problem, const Workspace& w, int64_t b, int64_t i, int64_t g,
                const int32_t* keys, size_t n, Scratch<T>& s, const float*& weights_t, const float*& d_weights_t) {
  if constexpr (std::is_same_v<T, bfloat16>) {
    if (w.pairs) {
      PairWeights(problem, w, b, i, g, keys, n, s);
      TransposeWeights(n, static_cast<size_t>(problem.dense.extents.group()), s);
      weights_t = s.weights_t.get();
      d_weights_t = s.d_weights_t.get();
      return true;
    }
    if (w.unit == Bf16Unit::fp32_fma) return false;
    GroupRowStatistics(problem, w, b, i, g, s);
    BlockOnDots(problem, w, b, i, g, keys, n, s);
    weights_t = s.dots.st.get();
    d_weights_t = s.dots.dpt.get();
    return true;
  } else {
    return false;
  }
}

// dK and dV of keys [first, last) of (b, kv head g) from their float sums, stored.
template <class T>
void StoreKeyGradients(const detail::SparseBackwardProblem<T>& problem, const Workspace& w, int64_t b, int64_t g,
                       int64_t first, int64_t last, const KeySums& sums) {
  const auto rows = problem.dense.rows();
  const detail::Extents& e = problem.dense.extents;
  for (int64_t j = first; j < last; ++j) {
    const float* dk_sum = sums.dk + static_cast<size_t>(j - sums.first) * w.d_pad;
    const float* dv_sum = sums.dv + static_cast<size_t>(j - sums.first) * w.dv_pad;
    T* dk = rows.dk(b, j, g);
    T* dv = rows.dv(b, j, g);
    for (int64_t c = 0; c < e.head_dim; ++c) dk[c] = StoreAs<T>(dk_sum[c]);
    for (int64_t c = 0; c < e.v_dim; ++c) dv[c] = StoreAs<T>(dv_sum[c]);
  }
}

// Pass D, keys [first, first + kKeyBlock) of (b, kv head g): dK and dV over every row
// that lists one of them, rows ascending. Per row, the block's part of its sorted set
// (n keys) gives P and dS (group × n) as in pass C; transposed (n × group), they weigh
// the group's dO and scale·q rows into the block's accumulators of those keys.
template <class T>
void KeyBlockGradients(const detail::SparseBackwardProblem<T>& problem, const Workspace& w, int64_t b, int64_t first,
                       int64_t g, Scratch<T>& s) {
  const auto& dense = problem.dense;
  const detail::Extents& e = dense.extents;
  const auto rows = dense.rows();
  const size_t group = static_cast<size_t>(e.group()), lanes = VectorLanes();
  const int64_t last = std::min(first + kKeyBlock, e.k_len);
  const int64_t list = problem.keys.list_of(g);
  const amx::TileScope tile_scope(w.unit == Bf16Unit::amx);  // one configuration for the unit's rows
  std::fill(s.dk.get(), s.dk.get() + static_cast<size_t>(last - first) * w.d_pad, 0.0f);
  std::fill(s.dv.get(), s.dv.get() + static_cast<size_t>(last - first) * w.dv_pad, 0.0f);
  if (s.range.active())  // the block's rows widened once for every row that lists them
    s.range.Widen(first, last, [&](int64_t j) { return rows.k(b, j, g); }, [&](int64_t j) { return rows.v(b, j, g); });
  if (s.stored.active())  // (the pair step's: copied as stored)
    s.stored.Copy(first, last, [&](int64_t j) { return rows.k(b, j, g); }, [&](int64_t j) { return rows.v(b, j, g); });
  for (int64_t i = 0; i < w.q_len; ++i) {
    const int64_t at = w.row(b, list, i);
    const int32_t* set = w.sets.data() + at * w.topk;
    const int32_t* set_end = set + w.set_sizes[at];
    if (set == set_end || set_end[-1] < first || set[0] >= last) continue;
    const int32_t* in_block = std::lower_bound(set, set_end, static_cast<int32_t>(first));
    const auto listed = static_cast<size_t>(std::lower_bound(in_block, set_end, static_cast<int32_t>(last)) - in_block);
    // The row's listed keys of the block in gathered blocks of ≤ kGatherKeys; each key's
    // sums still gain their rows' terms in ascending row order.
    for (size_t c0 = 0; c0 < listed; c0 += kGatherKeys) {
      const int32_t* keys = in_block + c0;
      const size_t n = std::min(kGatherKeys, listed - c0);
      const float* q = w.q_row(b, i, g * e.group());
      const float* dout = w.dout_row(b, i, g * e.group());
      // Pᵀ and dSᵀ (n × group) of the row's listed keys in the block.
      const float* weights_t = s.weights_t.get();
      const float* d_weights_t = s.d_weights_t.get();
      if (!DotWeights(problem, w, b, i, g, keys, n, s, weights_t, d_weights_t)) {
        const size_t padded = round_up(n, lanes);
        const auto scores = [&](auto k_rows, auto v_rows, size_t k_dim, size_t v_dim, auto k_ahead, auto v_ahead) {
          for (size_t j = 0; j < padded; j += lanes) {
            ScoreKeys(group, q, w.d_pad, k_rows + j, k_dim, k_ahead, s.scores.get() + j, kGatherKeys);
            ScoreKeys(group, dout, w.dv_pad, v_rows + j, v_dim, v_ahead, s.d_scores.get() + j, kGatherKeys);
          }
        };
        if (s.range.active()) {
          s.range.Point(keys, n, padded);
          s.range.Visit(scores);
        } else {
          const auto k_row = [&](size_t j) { return rows.k(b, keys[j], g); };
          const auto v_row = [&](size_t j) { return rows.v(b, keys[j], g); };
          s.block.Gather(n, padded, k_row, v_row);
          s.block.GatherNext(0, k_row, v_row);  // the block's rows are in L2 after the first row
          s.block.Visit(scores);
        }
        GroupWeightsAndGradients(problem, w, b, i, g, n, padded, s);
        TransposeWeights(n, group, s);
      }
      AddRowToKeys(w, q, dout, keys, n, group, weights_t, d_weights_t, KeySums{s.dk.get(), s.dv.get(), first}, s);
    }
  }
  StoreKeyGradients(problem, w, b, g, first, last, KeySums{s.dk.get(), s.dv.get(), first});
}

// dsink_h = −Σ_(b,i) e^(sink_h − lse)·D, summed in a fixed order (the sink: dP = 0, no value).
template <class T>
void SinkGradients(const detail::SparseBackwardProblem<T>& problem, const Workspace& w) {
  const auto& dense = problem.dense;
  const detail::Extents& e = dense.extents;
  if (dense.args.dsinks.empty()) return;
  const auto rows = dense.rows();
  for (int64_t h = 0; h < e.q_heads; ++h) {
    double sum = 0.0;
    for (int64_t b = 0; b < e.batch; ++b)
      for (int64_t i = 0; i < e.q_len; ++i) {
        const double lse = static_cast<double>(rows.lse(b, h, i));
        sum -= std::exp(static_cast<double>(dense.modifiers.sinks[h]) - lse) *
               static_cast<double>(w.delta[static_cast<size_t>(w.head_row(b, i, h))]);
      }
    dense.args.dsinks[static_cast<size_t>(h)] = static_cast<float>(sum);
  }
}

// The fused schedule, all of (b, kv head g) on one thread: pass C's tiles in ascending
// order, each row's P and dS also adding its dK and dV terms to sums of every key of the
// head (k_len rows, float). A key's sums gain their rows' terms in ascending row order as
// in pass D, from the same P and dS (pass D's key blocks are pass C's ranges, so a row's
// gathered blocks are the same keys): the same bits, with S and dP computed once, not
// twice — five products a block where the two passes take seven.
template <class T>
void HeadGradients(const detail::SparseBackwardProblem<T>& problem, const Workspace& w, int64_t b, int64_t g,
                   const KeySums& sums, Scratch<T>& s) {
  const int64_t k_len = problem.dense.extents.k_len, q_len = problem.dense.extents.q_len;
  std::fill(sums.dk, sums.dk + static_cast<size_t>(k_len) * w.d_pad, 0.0f);
  std::fill(sums.dv, sums.dv + static_cast<size_t>(k_len) * w.dv_pad, 0.0f);
  const auto tile_rows = static_cast<int64_t>(SweepTileRows(problem.dense.extents, w.topk));
  for (int64_t i0 = 0; i0 < q_len; i0 += tile_rows)
    QueryTileGradients(problem, w, b, i0, static_cast<size_t>(std::min(tile_rows, q_len - i0)), g, sums, s);
  StoreKeyGradients(problem, w, b, g, 0, k_len, sums);
}

template <class T>
void SparseBackwardImpl(const detail::SparseBackwardProblem<T>& problem) {
  const auto& dense = problem.dense;
  const detail::Extents& e = dense.extents;
  const size_t lanes = VectorLanes();
  Workspace w;
  w.lists = problem.keys.lists;
  w.q_len = e.q_len;
  w.q_heads = e.q_heads;
  w.topk = problem.keys.topk;
  w.k_len = e.k_len;
  w.d_pad = round_up(static_cast<size_t>(e.head_dim), lanes);
  w.dv_pad = round_up(static_cast<size_t>(e.v_dim), lanes);
  const auto set_rows = static_cast<size_t>(e.batch * w.lists * e.q_len);
  const auto head_rows = static_cast<size_t>(e.batch * e.q_len * e.q_heads);
  w.sets.resize(set_rows * static_cast<size_t>(w.topk));
  w.set_sizes.resize(set_rows);
  w.scaled_q = AllocateFloats(head_rows * w.d_pad);
  w.dout = AllocateFloats(head_rows * w.dv_pad);
  w.delta.resize(head_rows);
  // The bf16 unit of the call's products (sparse_dot_unit's rule, the forward's: for
  // bfloat16 storage, groups of whole vectors of heads, the unit the precision picks).
  // Then S and dP of every block are products of bf16 values on that unit, exact, summed in
  // float32 — S bit for bit the forward's latent step's, whose lse P divides by — and dQ =
  // dS·K rounds each dS to bfloat16 once (the fast contract, as the dense backward's tiles
  // do). dK and dV stay float32 products of the float P and dS (keys × group: 16+ heads of
  // one row, too short a sum for the tiles) with the float rows of the workspace. May
  // throw: called before the parallel regions.
  // On vdpbf16ps the pair step instead, as the forward (S bit for bit its logits).
  w.pairs = sparse_pair_step<T>(e, dense.precision);
  w.unit = w.pairs ? Bf16Unit::fp32_fma : sparse_dot_unit<T>(e, dense.modifiers, dense.precision);
  if (w.pairs) {
    w.d = static_cast<size_t>(e.head_dim);
    w.dv = static_cast<size_t>(e.v_dim);
    w.q_in_place = dense.args.q.strides[2] == e.head_dim;
    w.dout_in_place = dense.args.dout.strides[2] == e.v_dim;
    w.q16.resize(w.q_in_place ? 0 : head_rows * w.d);
    w.dout16.resize(w.dout_in_place ? 0 : head_rows * w.dv);
  }
  if (w.unit != Bf16Unit::fp32_fma) {
    const auto units = static_cast<size_t>(e.batch * e.q_len * e.kv_heads);
    w.pair_ld = bf16dot::pair_ld(static_cast<size_t>(e.group()));
    w.q_words = (static_cast<size_t>(e.head_dim) + 1) / 2 * w.pair_ld;
    w.dout_words = (static_cast<size_t>(e.v_dim) + 1) / 2 * w.pair_ld;
    w.q_pairs.resize(units * w.q_words);
    w.dout_pairs.resize(units * w.dout_words);
  }
  const int threads = std::max(dense.threads, 1);
  std::vector<Scratch<T>> scratch;
  scratch.reserve(static_cast<size_t>(threads));
  for (int t = 0; t < threads; ++t) scratch.emplace_back(e, problem.keys, w.unit, w.pairs);

  const int64_t query_rows = e.batch * e.q_len;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 16)
  for (int64_t u = 0; u < query_rows; ++u)
    PrepareRow(problem, w, u / e.q_len, u % e.q_len, scratch[static_cast<size_t>(omp_get_thread_num())].marks);
  // Fused (HeadGradients) where the float step computes the blocks and the (batch, kv
  // head) pairs are enough to keep the threads busy: each thread then holds the float dK
  // and dV sums of a whole head (k_len · (d + dv) floats: 8 MiB at 8k keys, d 128).
  // Otherwise passes C and D, which spread one head over every thread. Both give the
  // same bits, so the choice (threads against heads) keeps results thread-count free.
  const int64_t head_units = e.batch * e.kv_heads;
  if (w.unit == Bf16Unit::fp32_fma && (threads == 1 || head_units >= 2 * threads)) {
    const size_t floats = static_cast<size_t>(e.k_len) * (w.d_pad + w.dv_pad);
    std::vector<hwy::AlignedFreeUniquePtr<float[]>> sums;
    for (int t = 0; t < threads; ++t) sums.push_back(AllocateFloats(floats));
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t u = 0; u < head_units; ++u) {
      const auto t = static_cast<size_t>(omp_get_thread_num());
      float* dk = sums[t].get();
      HeadGradients(problem, w, u / e.kv_heads, u % e.kv_heads,
                    KeySums{dk, dk + static_cast<size_t>(e.k_len) * w.d_pad, 0}, scratch[t]);
    }
    SinkGradients(problem, w);
    return;
  }
  // The bf16 unit's rows keep their own blocks, one row a unit, as in the forward.
  const int64_t kTile = w.unit != Bf16Unit::fp32_fma ? 1 : static_cast<int64_t>(SweepTileRows(e, w.topk));
  const int64_t tiles = (e.q_len + kTile - 1) / kTile;
  const int64_t query_units = e.batch * tiles * e.kv_heads;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t u = 0; u < query_units; ++u) {
    const int64_t i0 = (u % tiles) * kTile, g = (u / tiles) % e.kv_heads, b = u / (tiles * e.kv_heads);
    QueryTileGradients(problem, w, b, i0, static_cast<size_t>(std::min(kTile, e.q_len - i0)), g, KeySums{},
                       scratch[static_cast<size_t>(omp_get_thread_num())]);
  }
  const int64_t key_blocks = (e.k_len + kKeyBlock - 1) / kKeyBlock;
  const int64_t key_units = e.batch * e.kv_heads * key_blocks;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t u = 0; u < key_units; ++u) {
    const int64_t b = u / (e.kv_heads * key_blocks), g = (u / key_blocks) % e.kv_heads;
    KeyBlockGradients(problem, w, b, (u % key_blocks) * kKeyBlock, g, scratch[static_cast<size_t>(omp_get_thread_num())]);
  }

  SinkGradients(problem, w);
}

}  // namespace

void SparseBackwardFloat(const detail::SparseBackwardProblem<float>& p) { SparseBackwardImpl(p); }
void SparseBackwardBf16(const detail::SparseBackwardProblem<bfloat16>& p) { SparseBackwardImpl(p); }
void SparseBackwardF16(const detail::SparseBackwardProblem<float16>& p) { SparseBackwardImpl(p); }

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::cpu {
HWY_EXPORT(SparseBackwardFloat);
HWY_EXPORT(SparseBackwardBf16);
HWY_EXPORT(SparseBackwardF16);

void sparse_backward(const detail::SparseBackwardProblem<float>& problem) {
  apply_simd_target_override();
  HWY_DYNAMIC_DISPATCH(SparseBackwardFloat)(problem);
}
void sparse_backward(const detail::SparseBackwardProblem<bfloat16>& problem) {
  apply_simd_target_override();
  HWY_DYNAMIC_DISPATCH(SparseBackwardBf16)(problem);
}
void sparse_backward(const detail::SparseBackwardProblem<float16>& problem) {
  apply_simd_target_override();
  HWY_DYNAMIC_DISPATCH(SparseBackwardF16)(problem);
}
}  // namespace qkv::cpu
#endif
