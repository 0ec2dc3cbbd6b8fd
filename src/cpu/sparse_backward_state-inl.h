// The sparse backward's state (sparse_backward.cpp): the call's workspace, a thread's
// scratch, and the float step's pieces both passes share: P and dS of a gathered block,
// and the weighted row sums that add a row's terms to its keys' dK and dV.
//
// Per-target include guard (Highway's toggle idiom).
#if defined(QKV_CPU_SPARSE_BACKWARD_STATE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_SPARSE_BACKWARD_STATE_INL_H_
#undef QKV_CPU_SPARSE_BACKWARD_STATE_INL_H_
#else
#define QKV_CPU_SPARSE_BACKWARD_STATE_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "core/key_selection.hpp"
#include "cpu/bf16_group_block.hpp"
#include "cpu/block_ops-inl.h"
#include "cpu/decode_tiles-inl.h"
#include "cpu/dot_products.hpp"
#include "cpu/sparse_backward_dots-inl.h"
#include "cpu/sparse_gather-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {

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
  // The pair step (sparse_pair_step, sparse.hpp): S, dP and dQ's product on vdpbf16ps from
  // each row's stored q and dO ([B, Nq, Hq, d] and [.., dv], a group's heads consecutive).
  // Where a row's heads are consecutive in q (dO) already (bshd), the group's rows are read
  // in place and not copied (GQA 32/8 d 128 at N 32768: 512 MiB less workspace).
  bool pairs = false, q_in_place = false, dout_in_place = false;
  size_t d = 0, dv = 0;
  std::vector<bfloat16> q16, dout16;

  int64_t row(int64_t b, int64_t list, int64_t i) const { return (b * lists + list) * q_len + i; }
  int64_t head_row(int64_t b, int64_t i, int64_t h) const { return (b * q_len + i) * q_heads + h; }
  const float* q_row(int64_t b, int64_t i, int64_t h) const { return scaled_q.get() + head_row(b, i, h) * d_pad; }
  const float* dout_row(int64_t b, int64_t i, int64_t h) const { return dout.get() + head_row(b, i, h) * dv_pad; }
  int64_t unit_of(int64_t b, int64_t i, int64_t g, int64_t kv_heads) const { return (b * q_len + i) * kv_heads + g; }
  const bfloat16* q16_row(int64_t b, int64_t i, int64_t h) const { return q16.data() + head_row(b, i, h) * d; }
  const bfloat16* dout16_row(int64_t b, int64_t i, int64_t h) const { return dout16.data() + head_row(b, i, h) * dv; }
};

// One thread's scratch for passes C and D.
template <class T>
struct Scratch {
  Scratch(const detail::Extents& e, const detail::KeySelection& selection, Bf16Unit unit, bool pairs)
      : marks(selection.marks_for(e.k_len)),
        block(static_cast<size_t>(e.head_dim), static_cast<size_t>(e.v_dim)),
        rows(std::max<size_t>(static_cast<size_t>(e.group()), 1)),
        scores(AllocateFloats(rows * kGatherKeys)),
        d_scores(AllocateFloats(rows * kGatherKeys)),
        slope(AllocateFloats(rows * kGatherKeys)),
        weights_t(AllocateFloats(kGatherKeys * rows)),
        d_weights_t(AllocateFloats(kGatherKeys * rows)),
        acc(AllocateFloats(SweepTileRows(e, selection.topk) * rows * block.d_pad())),
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
        range(unit == Bf16Unit::fp32_fma && !pairs, static_cast<size_t>(e.head_dim),
              static_cast<size_t>(e.v_dim)),
        stored(pairs, static_cast<size_t>(e.head_dim), static_cast<size_t>(e.v_dim), kRangeKeys),
        value_words(pairs ? bf16dot::group_value_words(rows, kGatherKeys) : 0) {}

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
  // The pair step: the range's rows copied as stored, and dQ's weights in bf16 pairs.
  StoredRange<T> stored;
  std::vector<std::uint32_t> value_words;
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

// Keys sums of one (batch, kv head) that a row's terms are added to: dK and dV rows of
// keys [first, …), d_pad and dv_pad floats apart (pass D's key block, or every key of
// the head in the fused schedule).
struct KeySums {
  float* dk = nullptr;
  float* dv = nullptr;
  int64_t first = 0;
  bool active() const { return dk != nullptr; }
};

// The float step's P and dS (group × kGatherKeys in s.scores / s.d_scores, after
// GroupWeightsAndGradients) transposed to n × group into s.weights_t / s.d_weights_t.
template <class T>
HWY_INLINE void TransposeWeights(size_t n, size_t group, Scratch<T>& s) {
  for (size_t x = 0; x < n; ++x)
    for (size_t r = 0; r < group; ++r) {
      s.weights_t[x * group + r] = s.scores[r * kGatherKeys + x];
      s.d_weights_t[x * group + r] = s.d_scores[r * kGatherKeys + x];
    }
}

// Row i's terms for its listed keys keys[0, n), from Pᵀ and dSᵀ (n × group) and the
// group's dO and scale·q rows (head_dout, head_q: group rows, dv_pad / d_pad apart):
//   dV_key += Σ_h P_h,key·dO_h;  dK_key += Σ_h dS_h,key·(scale·q_h)
// Each key's sums gain the terms in head order: called for the rows in ascending order,
// a key's sum is the same sequence of FMAs whichever schedule calls it.
template <class T>
HWY_INLINE void AddRowToKeys(const Workspace& w, const float* head_q, const float* head_dout, const int32_t* keys,
                             size_t n, size_t group, const float* weights_t, const float* d_weights_t,
                             const KeySums& sums, Scratch<T>& s) {
  for (size_t r = 0; r < group; ++r) {
    s.head_q[r] = head_q + r * w.d_pad;
    s.head_dout[r] = head_dout + r * w.dv_pad;
  }
  for (size_t x = 0; x < n; ++x) {
    s.dv_rows[x] = sums.dv + static_cast<size_t>(keys[x] - sums.first) * w.dv_pad;
    s.dk_rows[x] = sums.dk + static_cast<size_t>(keys[x] - sums.first) * w.d_pad;
  }
  AddWeightedRows(n, weights_t, group, s.head_dout.data(), w.dv_pad, s.dv_rows.data());
  AddWeightedRows(n, d_weights_t, group, s.head_q.data(), w.d_pad, s.dk_rows.data());
}

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
