// Sparse attention backward on the cpu backend. In the forward pass, for each row i of
// head h with attended set A_i (core/key_selection.hpp),
//   s_ij = cap((scale·q_i)·k_j),  P_ij = e^(s_ij − lse_i),  O_i = Σ_(j∈A_i) P_ij·v_j
// so now, with D_i = ⟨dO_i, O_i⟩ (= Σ_j P_ij·dP_ij, FlashAttention's D):
//   dP_ij = ⟨dO_i, v_j⟩,   dS_ij = P_ij·(dP_ij − D_i)·cap'(·),
//   dQ_i = scale·Σ_(j∈A_i) dS_ij·k_j                       (pass C: one writer per row)
//   dK_j = Σ_(i: j∈A_i) dS_ij·(scale·q_i),  dV_j = Σ_(i: j∈A_i) P_ij·dO_i   (pass D: per key)
//   dsink_h = −Σ_i e^(sink_h − lse_i)·D_i                 (the sink: dP = 0, no value)
// A key receives from every query that lists it, so dK and dV are not written by scattering
// (that would need atomics and make the sums depend on the threads): pass B inverts the
// sets into, per (batch, list) and key, the ascending list of query rows that attend it,
// and pass D gives each key row one writer that sums its queries in that fixed order.
// Pass D recomputes s_ij with the same tile (decode_tiles-inl.h's ScoreKeys, key and query
// roles swapped: each lane's product and the tree of lane sums are the same), so P is the
// forward's to the last bit of the logit. Every pass writes its own outputs, the same way
// on any thread: results are bitwise identical for every thread count.
//
// Workspace, per call: the sets (B·lists·Nq·topk int32, the size of the lists) and their
// inverse, scale·q and dO widened to float, D; nothing Nq × Nk.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/sparse_backward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/highway.h"
#include "cpu/block_ops-inl.h"
#include "cpu/decode_tiles-inl.h"
#include "cpu/sparse_gather-inl.h"

#ifndef QKV_CPU_SPARSE_BACKWARD_ONCE_
#define QKV_CPU_SPARSE_BACKWARD_ONCE_
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu/sparse.hpp"
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {
namespace {

// Keys per unit of pass D: small, so that even one (batch, kv head) spreads over threads.
constexpr int64_t kKeysPerUnit = 16;

// The call's workspace, shared by the passes.
struct Workspace {
  int64_t lists = 1, q_len = 0, q_heads = 0, topk = 0, k_len = 0;
  size_t d_pad = 0, dv_pad = 0;
  std::vector<int32_t> sets;        // [B, lists, Nq, topk]: A of each row
  std::vector<int32_t> set_sizes;   // [B, lists, Nq]
  std::vector<int64_t> key_starts;  // [B, lists, Nk + 1]: pass B's inverse, as offsets...
  std::vector<int32_t> key_rows;    // ...into the query rows that attend each key, ascending
  hwy::AlignedFreeUniquePtr<float[]> scaled_q;  // [B, Nq, Hq, d_pad]: scale·q
  hwy::AlignedFreeUniquePtr<float[]> dout;      // [B, Nq, Hq, dv_pad]: dO in float
  std::vector<float> delta;                     // [B, Nq, Hq]: D = ⟨dO, O⟩

  int64_t row(int64_t b, int64_t list, int64_t i) const { return (b * lists + list) * q_len + i; }
  int64_t head_row(int64_t b, int64_t i, int64_t h) const { return (b * q_len + i) * q_heads + h; }
  const float* q_row(int64_t b, int64_t i, int64_t h) const { return scaled_q.get() + head_row(b, i, h) * d_pad; }
  const float* dout_row(int64_t b, int64_t i, int64_t h) const { return dout.get() + head_row(b, i, h) * dv_pad; }
};

// One thread's scratch for passes C and D (rows: the group's heads in C, entries in D).
template <class T>
struct Scratch {
  Scratch(const detail::Extents& e, const detail::KeySelection& selection)
      : marks(selection.marks_for(e.k_len)),
        block(static_cast<size_t>(e.head_dim), static_cast<size_t>(e.v_dim)),
        rows(std::max<size_t>(static_cast<size_t>(e.group()), 1)),
        scores(AllocateFloats(rows * kGatherKeys)),
        d_scores(AllocateFloats(rows * kGatherKeys)),
        slope(AllocateFloats(rows * kGatherKeys)),
        acc(AllocateFloats(rows * std::max(block.d_pad(), block.dv_pad()))),
        dk(AllocateFloats(block.d_pad())),
        dv(AllocateFloats(block.dv_pad())),
        key(AllocateFloats(block.d_pad())),
        value(AllocateFloats(block.dv_pad())),
        lse(kGatherKeys),
        delta(kGatherKeys),
        ones(std::max(rows, kGatherKeys), 1.0f),
        q_rows(kGatherKeys),
        dout_rows(kGatherKeys) {}

  std::vector<uint64_t> marks;  // attended_keys's bit set
  GatheredBlock<T> block;
  size_t rows;
  hwy::AlignedFreeUniquePtr<float[]> scores, d_scores, slope, acc, dk, dv, key, value;
  std::vector<float> lse, delta, ones;
  std::vector<const float*> q_rows, dout_rows;
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
}

// Pass B, (b, list): key j's attending rows, ascending (rows are visited in order).
void InvertSets(Workspace& w, int64_t b, int64_t list) {
  int64_t* starts = w.key_starts.data() + (b * w.lists + list) * (w.k_len + 1);
  std::vector<int64_t> next(static_cast<size_t>(w.k_len) + 1, 0);
  for (int64_t i = 0; i < w.q_len; ++i) {
    const int64_t at = w.row(b, list, i);
    for (int32_t t = 0; t < w.set_sizes[at]; ++t) ++next[static_cast<size_t>(w.sets[at * w.topk + t]) + 1];
  }
  // Offsets within this (b, list)'s region of key_rows, which starts at its first row's slot.
  const int64_t base = w.row(b, list, 0) * w.topk;
  starts[0] = base;
  for (int64_t j = 0; j < w.k_len; ++j) starts[j + 1] = starts[j] + next[static_cast<size_t>(j) + 1];
  for (int64_t j = 0; j < w.k_len; ++j) next[static_cast<size_t>(j)] = starts[j];
  for (int64_t i = 0; i < w.q_len; ++i) {
    const int64_t at = w.row(b, list, i);
    for (int32_t t = 0; t < w.set_sizes[at]; ++t)
      w.key_rows[static_cast<size_t>(next[static_cast<size_t>(w.sets[at * w.topk + t])]++)] = static_cast<int32_t>(i);
  }
}

// Pass C, (b, i, kv head g): dQ of the group's heads over the gathered blocks of A_i.
template <class T>
void QueryGradients(const detail::SparseBackwardProblem<T>& problem, const Workspace& w, int64_t b, int64_t i,
                    int64_t g, Scratch<T>& s) {
  const auto& dense = problem.dense;
  const detail::Extents& e = dense.extents;
  const auto rows = dense.rows();
  const size_t group = static_cast<size_t>(e.group()), lanes = VectorLanes();
  const int64_t at = w.row(b, problem.keys.list_of(g), i);
  const int32_t* set = w.sets.data() + at * w.topk;
  const auto count = static_cast<size_t>(w.set_sizes[at]);
  const float* q = w.q_row(b, i, g * e.group());
  const float* dout = w.dout_row(b, i, g * e.group());
  const float cap = dense.modifiers.softcap;
  std::fill(s.acc.get(), s.acc.get() + group * w.d_pad, 0.0f);
  for (size_t start = 0; start < count; start += kGatherKeys) {
    const size_t n = std::min(kGatherKeys, count - start), padded = round_up(n, lanes);
    const int32_t* keys = set + start;
    s.block.Gather(n, padded, [&](size_t j) { return rows.k(b, keys[j], g); },
                   [&](size_t j) { return rows.v(b, keys[j], g); });
    const int32_t* next = keys + n;  // the next block, prefetched while this one computes
    s.block.GatherNext(std::min(kGatherKeys, count - start - n), [&](size_t j) { return rows.k(b, next[j], g); },
                       [&](size_t j) { return rows.v(b, next[j], g); });
    s.block.Visit([&](auto k_rows, auto v_rows, size_t k_dim, size_t v_dim, auto k_ahead, auto v_ahead) {
      using S = std::remove_cv_t<std::remove_pointer_t<std::remove_pointer_t<decltype(k_rows)>>>;
      for (size_t j = 0; j < padded; j += lanes) {
        ScoreKeys(group, q, w.d_pad, k_rows + j, k_dim, k_ahead.offset(j), s.scores.get() + j, kGatherKeys);
        ScoreKeys(group, dout, w.dv_pad, v_rows + j, v_dim, v_ahead.offset(j), s.d_scores.get() + j, kGatherKeys);
      }
      for (size_t r = 0; r < group; ++r) {
        const int64_t h = g * e.group() + static_cast<int64_t>(r);
        float* row = s.scores.get() + r * kGatherKeys;
        float* slope = cap > 0.0f ? s.slope.get() + r * kGatherKeys : nullptr;
        if (slope != nullptr) SoftcapTile(row, 1, padded, cap, slope);
        std::fill(s.lse.begin(), s.lse.begin() + padded, static_cast<float>(rows.lse(b, h, i)));
        std::fill(s.delta.begin(), s.delta.begin() + padded, w.delta[static_cast<size_t>(w.head_row(b, i, h))]);
        WeightsAndGradients(row, s.d_scores.get() + r * kGatherKeys, slope, s.lse.data(), s.delta.data(), n, padded);
      }
      // dQ_r += Σ_j dS_rj·k_j (alpha 1: the running sum is kept).
      ValueBlock(group, s.d_scores.get(), kGatherKeys, n, k_rows, k_dim, Ahead<S>{}, s.ones.data(), s.acc.get(), w.d_pad);
    });
  }
  const float scale = static_cast<float>(dense.scale);
  for (size_t r = 0; r < group; ++r) {
    T* dq = rows.dq(b, i, g * e.group() + static_cast<int64_t>(r));
    for (int64_t c = 0; c < e.head_dim; ++c) dq[c] = StoreAs<T>(scale * s.acc[r * w.d_pad + static_cast<size_t>(c)]);
  }
}

// Pass D, key j of (b, kv head g): dK_j and dV_j over the entries (query row, head of the
// group) that attend it, in ascending row order, in chunks of kGatherKeys entries: the key
// is the tile's one row and the entries' scale·q (and dO) rows are its "keys".
template <class T>
void KeyGradients(const detail::SparseBackwardProblem<T>& problem, const Workspace& w, int64_t b, int64_t j,
                  int64_t g, Scratch<T>& s) {
  const auto& dense = problem.dense;
  const detail::Extents& e = dense.extents;
  const auto rows = dense.rows();
  const int64_t group = e.group();
  const size_t lanes = VectorLanes();
  const int64_t* starts = w.key_starts.data() + (b * w.lists + problem.keys.list_of(g)) * (w.k_len + 1);
  const int64_t entries = (starts[j + 1] - starts[j]) * group;
  const float cap = dense.modifiers.softcap;
  std::fill(s.dk.get(), s.dk.get() + w.d_pad, 0.0f);
  std::fill(s.dv.get(), s.dv.get() + w.dv_pad, 0.0f);
  if (entries > 0) {
    WidenRows(rows.k(b, j, g), 0, 1, static_cast<size_t>(e.head_dim), s.key.get(), w.d_pad);
    WidenRows(rows.v(b, j, g), 0, 1, static_cast<size_t>(e.v_dim), s.value.get(), w.dv_pad);
  }
  for (int64_t first = 0; first < entries; first += static_cast<int64_t>(kGatherKeys)) {
    const size_t n = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(kGatherKeys), entries - first));
    const size_t padded = round_up(n, lanes);
    for (size_t x = 0; x < padded; ++x) {
      const int64_t entry = first + static_cast<int64_t>(std::min(x, n - 1));
      const int64_t i = w.key_rows[static_cast<size_t>(starts[j] + entry / group)];
      const int64_t h = g * group + entry % group;
      s.q_rows[x] = w.q_row(b, i, h);
      s.dout_rows[x] = w.dout_row(b, i, h);
      s.lse[x] = static_cast<float>(rows.lse(b, h, i));
      s.delta[x] = w.delta[static_cast<size_t>(w.head_row(b, i, h))];
    }
    for (size_t x = 0; x < padded; x += lanes) {
      ScoreKeys(1, s.key.get(), w.d_pad, s.q_rows.data() + x, w.d_pad, Ahead<float>{}, s.scores.get() + x, kGatherKeys);
      ScoreKeys(1, s.value.get(), w.dv_pad, s.dout_rows.data() + x, w.dv_pad, Ahead<float>{}, s.d_scores.get() + x,
                kGatherKeys);
    }
    float* slope = cap > 0.0f ? s.slope.get() : nullptr;
    if (slope != nullptr) SoftcapTile(s.scores.get(), 1, padded, cap, slope);
    WeightsAndGradients(s.scores.get(), s.d_scores.get(), slope, s.lse.data(), s.delta.data(), n, padded);
    // dV_j += Σ_e P_e·dO_e,  dK_j += Σ_e dS_e·(scale·q_e)
    ValueBlock(1, s.scores.get(), kGatherKeys, n, s.dout_rows.data(), w.dv_pad, Ahead<float>{}, s.ones.data(),
               s.dv.get(), w.dv_pad);
    ValueBlock(1, s.d_scores.get(), kGatherKeys, n, s.q_rows.data(), w.d_pad, Ahead<float>{}, s.ones.data(),
               s.dk.get(), w.d_pad);
  }
  T* dk = rows.dk(b, j, g);
  T* dv = rows.dv(b, j, g);
  for (int64_t c = 0; c < e.head_dim; ++c) dk[c] = StoreAs<T>(s.dk[static_cast<size_t>(c)]);
  for (int64_t c = 0; c < e.v_dim; ++c) dv[c] = StoreAs<T>(s.dv[static_cast<size_t>(c)]);
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
  w.key_starts.resize(static_cast<size_t>(e.batch * w.lists * (e.k_len + 1)));
  w.key_rows.resize(w.sets.size());
  w.scaled_q = AllocateFloats(head_rows * w.d_pad);
  w.dout = AllocateFloats(head_rows * w.dv_pad);
  w.delta.resize(head_rows);
  const int threads = std::max(dense.threads, 1);
  std::vector<Scratch<T>> scratch;
  scratch.reserve(static_cast<size_t>(threads));
  for (int t = 0; t < threads; ++t) scratch.emplace_back(e, problem.keys);

  const int64_t query_rows = e.batch * e.q_len;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 16)
  for (int64_t u = 0; u < query_rows; ++u)
    PrepareRow(problem, w, u / e.q_len, u % e.q_len, scratch[static_cast<size_t>(omp_get_thread_num())].marks);
  const int64_t list_groups = e.batch * w.lists;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t u = 0; u < list_groups; ++u) InvertSets(w, u / w.lists, u % w.lists);
  const int64_t query_units = query_rows * e.kv_heads;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 8)
  for (int64_t u = 0; u < query_units; ++u)
    QueryGradients(problem, w, u / (e.q_len * e.kv_heads), (u / e.kv_heads) % e.q_len, u % e.kv_heads,
                   scratch[static_cast<size_t>(omp_get_thread_num())]);
  const int64_t key_blocks = (e.k_len + kKeysPerUnit - 1) / kKeysPerUnit;
  const int64_t key_units = e.batch * e.kv_heads * key_blocks;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4)
  for (int64_t u = 0; u < key_units; ++u) {
    const int64_t b = u / (e.kv_heads * key_blocks), g = (u / key_blocks) % e.kv_heads;
    const int64_t first = (u % key_blocks) * kKeysPerUnit, last = std::min(first + kKeysPerUnit, e.k_len);
    for (int64_t j = first; j < last; ++j)
      KeyGradients(problem, w, b, j, g, scratch[static_cast<size_t>(omp_get_thread_num())]);
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
