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
// bfloat16 groups of 16+ heads take the call's bf16 unit (vdpbf16ps or the AMX tiles):
// S, dP and dQ's product there, in both passes (sparse_dot_unit, sparse.hpp).
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

// Keys per unit of pass D: a key range (sparse_gather-inl.h; its K, V, dK and dV rows stay
// in L2 while every row that lists one of them passes, each row's scale·q and dO read
// once for up to 256 keys, not 64 — the rows, streamed from the workspace, were what pass
// D waited on), and units enough that even one (batch, kv head) spreads over the threads.
constexpr int64_t kKeyBlock = kRangeKeys;

// The call's workspace, shared by the passes.
struct Workspace {
  int64_t lists = 1, q_len = 0, q_heads = 0, topk = 0, k_len = 0;
  size_t d_pad = 0, dv_pad = 0;
  std::vector<int32_t> sets;        // [B, lists, Nq, topk]: A of each row
  std::vector<int32_t> set_sizes;   // [B, lists, Nq]
  hwy::AlignedFreeUniquePtr<float[]> scaled_q;  // [B, Nq, Hq, d_pad]: scale·q
  hwy::AlignedFreeUniquePtr<float[]> dout;      // [B, Nq, Hq, dv_pad]: dO in float
  std::vector<float> delta;                     // [B, Nq, Hq]: D = ⟨dO, O⟩
  // On a bf16 unit (sparse_dot_unit, sparse.hpp): each (b, i, kv head)'s query and dO rows paired
  // for ScoresTransposed, once for both passes (pair_ld(group) words a pair row).
  Bf16Unit unit = Bf16Unit::fp32_fma;
  size_t pair_ld = 0, q_words = 0, dout_words = 0;
  std::vector<std::uint32_t> q_pairs, dout_pairs;

  int64_t row(int64_t b, int64_t list, int64_t i) const { return (b * lists + list) * q_len + i; }
  int64_t head_row(int64_t b, int64_t i, int64_t h) const { return (b * q_len + i) * q_heads + h; }
  const float* q_row(int64_t b, int64_t i, int64_t h) const { return scaled_q.get() + head_row(b, i, h) * d_pad; }
  const float* dout_row(int64_t b, int64_t i, int64_t h) const { return dout.get() + head_row(b, i, h) * dv_pad; }
  int64_t unit_of(int64_t b, int64_t i, int64_t g, int64_t kv_heads) const { return (b * q_len + i) * kv_heads + g; }
};

// One thread's scratch for passes C and D.
template <class T>
struct Scratch {
  Scratch(const detail::Extents& e, const detail::KeySelection& selection, Bf16Unit unit)
      : marks(selection.marks_for(e.k_len)),
        block(static_cast<size_t>(e.head_dim), static_cast<size_t>(e.v_dim)),
        rows(std::max<size_t>(static_cast<size_t>(e.group()), 1)),
        scores(AllocateFloats(rows * kGatherKeys)),
        d_scores(AllocateFloats(rows * kGatherKeys)),
        slope(AllocateFloats(rows * kGatherKeys)),
        weights_t(AllocateFloats(kGatherKeys * rows)),
        d_weights_t(AllocateFloats(kGatherKeys * rows)),
        acc(AllocateFloats(kTileRows * rows * block.d_pad())),
        dk(AllocateFloats(static_cast<size_t>(kKeyBlock) * block.d_pad())),
        dv(AllocateFloats(static_cast<size_t>(kKeyBlock) * block.dv_pad())),
        lse(kGatherKeys),
        delta(kGatherKeys),
        ones(std::max(rows, kGatherKeys), 1.0f),
        head_q(rows),
        head_dout(rows),
        dk_rows(kGatherKeys),
        dv_rows(kGatherKeys),
        dots(unit == Bf16Unit::fp32_fma
                 ? SparseDotScratch()
                 : SparseDotScratch(rows, static_cast<size_t>(e.head_dim), static_cast<size_t>(e.v_dim))),
        range(unit == Bf16Unit::fp32_fma, static_cast<size_t>(e.head_dim),
              static_cast<size_t>(e.v_dim)) {}

  std::vector<uint64_t> marks;  // attended_keys's bit set
  GatheredBlock<T> block;
  size_t rows;  // the group's query heads
  hwy::AlignedFreeUniquePtr<float[]> scores, d_scores, slope;  // rows × kGatherKeys: S → P, dP → dS
  hwy::AlignedFreeUniquePtr<float[]> weights_t, d_weights_t;   // kGatherKeys × rows: P, dS transposed
  hwy::AlignedFreeUniquePtr<float[]> acc;     // pass C: dQ of the group, for each row of a tile
  hwy::AlignedFreeUniquePtr<float[]> dk, dv;  // pass D: the key block's sums
  std::vector<float> lse, delta, ones;
  std::vector<const float*> head_q, head_dout;  // pass D: the group's scale·q and dO rows
  std::vector<float*> dk_rows, dv_rows;         // pass D: the listed keys' rows of dk, dv
  SparseDotScratch dots;  // on a bf16 unit (sparse_dot_unit, sparse.hpp)
  // The float step: a range's K and V rows copied (widened) once — pass C's
  // for the tile's rows (SweepTile's on_range), pass D's for its key block's rows.
  WidenedRange range;
};

// Over `padded` entries of one row of scores s (already through the soft-cap) and dP:
//   P = e^(s − lse_e),  dS = P·(dP − D_e)·slope_e      (slope null: no soft-cap)
// in place (s becomes P, dP becomes dS); entries from n on are the padding: P = dS = 0.
HWY_INLINE void WeightsAndGradients(float* HWY_RESTRICT s, float* HWY_RESTRICT dp, const float* HWY_RESTRICT slope,
                                    const float* HWY_RESTRICT lse, const float* HWY_RESTRICT delta, size_t n,
                                    size_t padded) {
  const FloatTag df;
  const size_t lanes = hn::Lanes(df);
  for (size_t j = 0; j < padded; j += lanes) {
    const FloatVec p = ExpKeepNaN(df, hn::Sub(hn::LoadU(df, s + j), hn::LoadU(df, lse + j)));
    FloatVec ds = hn::Mul(p, hn::Sub(hn::LoadU(df, dp + j), hn::LoadU(df, delta + j)));
    if (slope != nullptr) ds = hn::Mul(ds, hn::LoadU(df, slope + j));
    hn::StoreU(p, df, s + j);
    hn::StoreU(ds, df, dp + j);
  }
  for (size_t j = n; j < padded; ++j) s[j] = dp[j] = 0.0f;
}

// P and dS of the group's heads for row i over one gathered block (n keys, padded), from
// its scores and dP in s.scores / s.d_scores (group × kGatherKeys), in place.
template <class T>
void GroupWeightsAndGradients(const detail::SparseBackwardProblem<T>& problem, const Workspace& w, int64_t b, int64_t i,
                              int64_t g, size_t n, size_t padded, Scratch<T>& s) {
  const auto& dense = problem.dense;
  const auto rows = dense.rows();
  const int64_t group = dense.extents.group();
  const float cap = dense.modifiers.softcap;
  for (int64_t r = 0; r < group; ++r) {
    const int64_t h = g * group + r;
    float* row = s.scores.get() + static_cast<size_t>(r) * kGatherKeys;
    float* slope = cap > 0.0f ? s.slope.get() + static_cast<size_t>(r) * kGatherKeys : nullptr;
    if (slope != nullptr) SoftcapTile(row, 1, padded, cap, slope);
    std::fill(s.lse.begin(), s.lse.begin() + static_cast<std::ptrdiff_t>(padded), static_cast<float>(rows.lse(b, h, i)));
    std::fill(s.delta.begin(), s.delta.begin() + static_cast<std::ptrdiff_t>(padded),
              w.delta[static_cast<size_t>(w.head_row(b, i, h))]);
    WeightsAndGradients(row, s.d_scores.get() + static_cast<size_t>(r) * kGatherKeys, slope, s.lse.data(),
                        s.delta.data(), n, padded);
  }
}

// dst[x] += Σ_r w[x·group + r]·src[r] over columns [col, col + C·lanes) of R rows x: R
// listed keys' dK or dV sums (rows of the key block's accumulators) plus one query row's
// terms, kept in registers over the group's heads (each sum gains its terms in head order).
template <size_t R, size_t C>
HWY_INLINE void AddWeightedTile(const float* HWY_RESTRICT w, size_t group, const float* const* src, size_t col,
                                float* const* dst) {
  const FloatTag df;
  const size_t lanes = hn::Lanes(df);
  VecArray2<FloatTag, R, C> sum;
  for (size_t r = 0; r < R; ++r)
    for (size_t c = 0; c < C; ++c) sum[r][c] = hn::LoadU(df, dst[r] + col + c * lanes);
  for (size_t h = 0; h < group; ++h) {
    VecArray<FloatTag, C> x;
    for (size_t c = 0; c < C; ++c) x[c] = hn::LoadU(df, src[h] + col + c * lanes);
    for (size_t r = 0; r < R; ++r) {
      const FloatVec weight = hn::Set(df, w[r * group + h]);
      for (size_t c = 0; c < C; ++c) sum[r][c] = hn::MulAdd(weight, x[c], sum[r][c]);
    }
  }
  for (size_t r = 0; r < R; ++r)
    for (size_t c = 0; c < C; ++c) hn::StoreU(sum[r][c], df, dst[r] + col + c * lanes);
}

// The same over dim (a whole number of vectors) for n rows: tiles of 4 rows, then single rows.
HWY_INLINE void AddWeightedRows(size_t n, const float* HWY_RESTRICT w, size_t group, const float* const* src, size_t dim,
                                float* const* dst) {
  const size_t lanes = VectorLanes();
  constexpr size_t kC = kValueTileVectors / 4 >= 4 ? 4 : 2;  // 4·kC accumulators + kC loads
  size_t x = 0;
  for (; x + 4 <= n; x += 4) {
    size_t col = 0;
    for (; col + kC * lanes <= dim; col += kC * lanes) AddWeightedTile<4, kC>(w + x * group, group, src, col, dst + x);
    for (; col < dim; col += lanes) AddWeightedTile<4, 1>(w + x * group, group, src, col, dst + x);
  }
  for (; x < n; ++x) {
    size_t col = 0;
    for (; col + kC * lanes <= dim; col += kC * lanes) AddWeightedTile<1, kC>(w + x * group, group, src, col, dst + x);
    for (; col < dim; col += lanes) AddWeightedTile<1, 1>(w + x * group, group, src, col, dst + x);
  }
}

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
                const int32_t* keys, size_t n, const int32_t* next, size_t ahead, float* acc, Scratch<T>& s) {
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
}

// Pass C, rows [i0, i0 + tile) of (b, kv head g): dQ of each row's group over the blocks
// of its set, the tile's rows sweeping the keys together (SweepTile, as the forward).
template <class T>
void QueryTileGradients(const detail::SparseBackwardProblem<T>& problem, const Workspace& w, int64_t b, int64_t i0,
                        size_t tile, int64_t g, Scratch<T>& s) {
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
        QueryBlock(problem, w, b, i0 + static_cast<int64_t>(t), g, keys, n, next, ahead, s.acc.get() + t * sums, s);
      },
      [&](int64_t begin, int64_t end) {
        if (!s.range.active()) return;
        const auto rows = problem.dense.rows();
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
        for (size_t x = 0; x < n; ++x)
          for (size_t r = 0; r < group; ++r) {
            s.weights_t[x * group + r] = s.scores[r * kGatherKeys + x];
            s.d_weights_t[x * group + r] = s.d_scores[r * kGatherKeys + x];
          }
      }
      for (size_t r = 0; r < group; ++r) {
        s.head_q[r] = q + r * w.d_pad;
        s.head_dout[r] = dout + r * w.dv_pad;
      }
      // dV_key += Σ_h P_h,key·dO_h;  dK_key += Σ_h dS_h,key·(scale·q_h)
      for (size_t x = 0; x < n; ++x) {
        s.dv_rows[x] = s.dv.get() + static_cast<size_t>(keys[x] - first) * w.dv_pad;
        s.dk_rows[x] = s.dk.get() + static_cast<size_t>(keys[x] - first) * w.d_pad;
      }
      AddWeightedRows(n, weights_t, group, s.head_dout.data(), w.dv_pad, s.dv_rows.data());
      AddWeightedRows(n, d_weights_t, group, s.head_q.data(), w.d_pad, s.dk_rows.data());
    }
  }
  for (int64_t j = first; j < last; ++j) {
    const float* dk_sum = s.dk.get() + static_cast<size_t>(j - first) * w.d_pad;
    const float* dv_sum = s.dv.get() + static_cast<size_t>(j - first) * w.dv_pad;
    T* dk = rows.dk(b, j, g);
    T* dv = rows.dv(b, j, g);
    for (int64_t c = 0; c < e.head_dim; ++c) dk[c] = StoreAs<T>(dk_sum[c]);
    for (int64_t c = 0; c < e.v_dim; ++c) dv[c] = StoreAs<T>(dv_sum[c]);
  }
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
  w.unit = sparse_dot_unit<T>(e, dense.modifiers, dense.precision);
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
  for (int t = 0; t < threads; ++t) scratch.emplace_back(e, problem.keys, w.unit);

  const int64_t query_rows = e.batch * e.q_len;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 16)
  for (int64_t u = 0; u < query_rows; ++u)
    PrepareRow(problem, w, u / e.q_len, u % e.q_len, scratch[static_cast<size_t>(omp_get_thread_num())].marks);
  // The bf16 unit's rows keep their own blocks, one row a unit, as in the forward.
  const int64_t kTile = w.unit != Bf16Unit::fp32_fma ? 1 : static_cast<int64_t>(kTileRows);
  const int64_t tiles = (e.q_len + kTile - 1) / kTile;
  const int64_t query_units = e.batch * tiles * e.kv_heads;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t u = 0; u < query_units; ++u) {
    const int64_t i0 = (u % tiles) * kTile, g = (u / tiles) % e.kv_heads, b = u / (tiles * e.kv_heads);
    QueryTileGradients(problem, w, b, i0, static_cast<size_t>(std::min(kTile, e.q_len - i0)), g,
                       scratch[static_cast<size_t>(omp_get_thread_num())]);
  }
  const int64_t key_blocks = (e.k_len + kKeyBlock - 1) / kKeyBlock;
  const int64_t key_units = e.batch * e.kv_heads * key_blocks;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t u = 0; u < key_units; ++u) {
    const int64_t b = u / (e.kv_heads * key_blocks), g = (u / key_blocks) % e.kv_heads;
    KeyBlockGradients(problem, w, b, (u % key_blocks) * kKeyBlock, g, scratch[static_cast<size_t>(omp_get_thread_num())]);
  }

  // dsink_h = −Σ_(b,i) e^(sink_h − lse)·D, summed in a fixed order.
  if (!dense.args.dsinks.empty()) {
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
