// Sparse attention forward on the cpu backend.
//
// A unit of work is (batch entry b, query row i, kv head g). Its G = Hq/Hkv query heads
// share one attended set A (in the [B, Nq, topk] mode every kv head's units read the same
// list; the set is rebuilt per unit, O(topk log topk) against the unit's 4·G·|A|·d flops)
// and so one gathered copy of those K/V rows: the G heads are the rows of the decode
// schedule's register tiles (decode_tiles-inl.h), so each gathered K and V vector is
// loaded once for all G heads. Over blocks of kGatherKeys attended keys, online softmax
// per head r:
//   S[r][t] = (scale·q_r)·k_(A_t)  → soft-cap      (the dense score pipeline, RowStages)
//   m' = max(m, max_t S),  alpha = e^(m − m'),  P = e^(S − m'),  l' = l·alpha + Σ_t P,
//   acc' = acc·alpha + P·V_A
// then with a sink logit σ_h (one more softmax entry without a value):
//   m_f = max(m, σ),  l_f = l·e^(m − m_f) + e^(σ − m_f),  out = acc·e^(m − m_f) / l_f,
//   lse = m_f + log l_f
// and without one m_f = m, l_f = l. A row with no attended key and no sink: out 0, lse −inf.
// Each unit writes its own rows of out and lse, computed the same way on any thread: the
// results do not depend on the thread count. Nothing Nq × Nk exists: per thread, one
// unit's set (topk), queries (G × d) and score block (G × 64).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/sparse_forward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/highway.h"
#include "cpu/block_ops-inl.h"
#include "cpu/decode_latent-inl.h"
#include "cpu/decode_tiles-inl.h"
#include "cpu/score_pipeline-inl.h"
#include "cpu/sparse_gather-inl.h"

#ifndef QKV_CPU_SPARSE_FORWARD_ONCE_
#define QKV_CPU_SPARSE_FORWARD_ONCE_
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "core/score_pipeline.hpp"
#include "cpu/dot_products.hpp"
#include "cpu/sparse.hpp"
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {
namespace {

// One thread's scratch, reused by its units.
template <class T>
struct ForwardScratch {
  ForwardScratch(const detail::Extents& e, const detail::KeySelection& selection, Bf16Unit latent_unit)
      : latent(latent_unit != Bf16Unit::fp32_fma),
        lat(latent ? LatentScratch(static_cast<size_t>(e.group()), static_cast<size_t>(e.group()), kGatherKeys,
                                   static_cast<size_t>(e.head_dim), static_cast<size_t>(e.v_dim),
                                   latent_unit == Bf16Unit::amx)
                   : LatentScratch()),
        k_rows(latent ? kGatherKeys : 0),
        v_rows(latent ? kGatherKeys : 0),
        k_next(latent ? kGatherKeys : 0),
        keys(static_cast<size_t>(selection.topk)),
        marks(selection.marks_for(e.k_len)),
        block(static_cast<size_t>(e.head_dim), static_cast<size_t>(e.v_dim)),
        queries(AllocateFloats(static_cast<size_t>(e.group()) * block.d_pad())),
        scores(AllocateFloats(static_cast<size_t>(e.group()) * kGatherKeys)),
        acc(AllocateFloats(static_cast<size_t>(e.group()) * block.dv_pad())),
        m(static_cast<size_t>(e.group())),
        l(m.size()),
        alpha(m.size()) {}

  bool latent;                   // sparse_dot_unit: the latent step, its scratch and row pointers
  LatentScratch lat;
  std::vector<const T*> k_rows, v_rows, k_next;
  std::vector<int32_t> keys;     // the unit's attended set
  std::vector<uint64_t> marks;   // attended_keys's bit set
  GatheredBlock<T> block;        // one block of its K/V rows
  hwy::AlignedFreeUniquePtr<float[]> queries, scores, acc;  // G × d_pad, G × 64, G × dv_pad
  std::vector<float> m, l, alpha;  // online-softmax state per head of the group
};

// The unit's outputs from its softmax state (m, l, acc): out and lse of the group's heads.
template <class T>
void Finish(const detail::SparseForwardProblem<T>& problem, int64_t b, int64_t i, int64_t g, ForwardScratch<T>& s);

// The unit's blocks on the latent step (sparse_dot_unit): the group's query rows rounded
// to bfloat16 (they are bf16 already) and paired once, then each block of attended keys
// gathered as row pointers, the next block's keys prefetched.
inline void LatentUnit(const detail::SparseForwardProblem<bfloat16>& problem, int64_t b, int64_t i, int64_t g,
                       size_t count, ForwardScratch<bfloat16>& s) {
  const auto& dense = problem.dense;
  const detail::Extents& e = dense.extents;
  const auto rows = dense.rows();
  const size_t group = static_cast<size_t>(e.group());
  const size_t d = static_cast<size_t>(e.head_dim), dv = static_cast<size_t>(e.v_dim), dv_pad = s.block.dv_pad();
  for (size_t r = 0; r < group; ++r)
    std::copy_n(rows.q(b, i, g * e.group() + static_cast<int64_t>(r)), d, s.lat.q_rows.data() + r * d);
  bf16dot::PackQueryPairs(s.lat.q_rows.data(), static_cast<std::int64_t>(d), group, d, s.lat.q_pairs.data(), s.lat.q_ld);
  const float scale = static_cast<float>(dense.scale);
  const amx::TileScope tile_scope(s.lat.amx);  // one configuration for the unit's blocks (no hook runs)
  for (size_t start = 0; start < count; start += kGatherKeys) {
    const size_t n = std::min(kGatherKeys, count - start);
    const int32_t* keys = s.keys.data() + start;
    for (size_t j = 0; j < n; ++j) {
      s.k_rows[j] = rows.k(b, keys[j], g);
      s.v_rows[j] = rows.v(b, keys[j], g);
    }
    const size_t ahead = std::min(kGatherKeys, count - start - n);
    for (size_t j = 0; j < ahead; ++j) s.k_next[j] = rows.k(b, keys[n + j], g);
    LatentBlock<bfloat16>(group, s.m.data(), s.l.data(), s.acc.get(), s.alpha.data(), s.lat, n, d, d, dv, dv_pad, scale,
                s.k_rows.data(), nullptr, s.v_rows.data(), nullptr, nullptr,
                Ahead<bfloat16>{s.k_next.data(), ahead, RowBytes<bfloat16>(d)},
                Ahead<bfloat16>{});
  }
}

template <class T>
void ForwardUnit(const detail::SparseForwardProblem<T>& problem, int64_t b, int64_t i, int64_t g,
                 ForwardScratch<T>& s) {
  const auto& dense = problem.dense;
  const detail::Extents& e = dense.extents;
  const auto rows = dense.rows();
  const size_t group = static_cast<size_t>(e.group()), d = static_cast<size_t>(e.head_dim);
  const size_t d_pad = s.block.d_pad(), dv_pad = s.block.dv_pad();
  const size_t lanes = VectorLanes();
  const auto count = static_cast<size_t>(problem.keys.attended_keys(dense.mask, b, problem.keys.list_of(g), i, s.keys.data(), s.marks));
  const float scale = static_cast<float>(dense.scale);
  std::fill(s.m.begin(), s.m.end(), kMinusInf);
  std::fill(s.l.begin(), s.l.end(), 0.0f);
  std::fill(s.acc.get(), s.acc.get() + group * dv_pad, 0.0f);
  if constexpr (std::is_same_v<T, bfloat16>) {
    if (s.latent) {
      LatentUnit(problem, b, i, g, count, s);
      Finish(problem, b, i, g, s);
      return;
    }
  }
  for (size_t r = 0; r < group; ++r)
    ScaledRow(rows.q(b, i, g * e.group() + static_cast<int64_t>(r)), d, d_pad, scale, s.queries.get() + r * d_pad);

  for (size_t start = 0; start < count; start += kGatherKeys) {
    const size_t n = std::min(kGatherKeys, count - start), padded = round_up(n, lanes);
    const int32_t* keys = s.keys.data() + start;
    s.block.Gather(n, padded, [&](size_t j) { return rows.k(b, keys[j], g); },
                   [&](size_t j) { return rows.v(b, keys[j], g); });
    const int32_t* next = keys + n;  // the next block, prefetched while this one computes
    s.block.GatherNext(std::min(kGatherKeys, count - start - n), [&](size_t j) { return rows.k(b, next[j], g); },
                       [&](size_t j) { return rows.v(b, next[j], g); });
    s.block.Visit([&](auto k_rows, auto v_rows, size_t k_dim, size_t v_dim, auto k_ahead, auto v_ahead) {
      for (size_t j = 0; j < padded; j += lanes)
        ScoreKeys(group, s.queries.get(), d_pad, k_rows + j, k_dim, k_ahead.offset(j), s.scores.get() + j, kGatherKeys);
      // The score pipeline per head; its mask stage removes the padding past the block.
      for (size_t r = 0; r < group; ++r)
        detail::apply_score_pipeline(
            dense.modifiers,
            RowStages{.rule = dense.mask, .mods = dense.modifiers, .batch = b,
                      .head = g * e.group() + static_cast<int64_t>(r), .query = i, .first_key = 0, .keys = n,
                      .padded = padded, .key_begin = 0, .key_end = static_cast<int64_t>(n),
                      .s = s.scores.get() + r * kGatherKeys});
      SoftmaxRows(group, padded, s.scores.get(), kGatherKeys, s.m.data(), s.l.data(), s.alpha.data());
      ValueBlock(group, s.scores.get(), kGatherKeys, n, v_rows, v_dim, v_ahead, s.alpha.data(), s.acc.get(), dv_pad);
    });
  }

  Finish(problem, b, i, g, s);
}

template <class T>
void Finish(const detail::SparseForwardProblem<T>& problem, int64_t b, int64_t i, int64_t g, ForwardScratch<T>& s) {
  const auto& dense = problem.dense;
  const detail::Extents& e = dense.extents;
  const auto rows = dense.rows();
  const size_t group = static_cast<size_t>(e.group()), dv = static_cast<size_t>(e.v_dim), dv_pad = s.block.dv_pad();
  const auto& sinks = dense.modifiers.sinks;
  for (size_t r = 0; r < group; ++r) {
    const int64_t h = g * e.group() + static_cast<int64_t>(r);
    float m_final = s.m[r], l_final = s.l[r], carry = 1.0f;  // carry = e^(m − m_f)
    if (!sinks.empty()) {
      m_final = std::max(s.m[r], sinks[h]);
      carry = s.m[r] == kMinusInf ? 0.0f : std::exp(s.m[r] - m_final);
      l_final = s.l[r] * carry + std::exp(sinks[h] - m_final);
    }
    T* out = rows.out(b, i, h);
    const float* acc = s.acc.get() + r * dv_pad;
    const bool empty = l_final == 0.0f;  // no key and no sink
    const float factor = empty ? 0.0f : carry / l_final;
    for (size_t c = 0; c < dv; ++c) out[c] = StoreAs<T>(empty ? 0.0f : acc[c] * factor);
    if (!dense.args.lse.empty()) rows.lse(b, h, i) = empty ? kMinusInf : m_final + std::log(l_final);
  }
}

template <class T>
void SparseForwardImpl(const detail::SparseForwardProblem<T>& problem) {
  const detail::Extents& e = problem.dense.extents;
  const int64_t units = e.batch * e.q_len * e.kv_heads;
  if (units == 0) return;
  // Scratch allocated before the parallel region: a workspace the system cannot give is
  // a qkv::Error from here, not an exception escaping an OpenMP thread.
  const int threads = static_cast<int>(std::min<int64_t>(problem.dense.threads, units));
  // The latent step's unit (decode_latent-inl.h's column step, as latent decode takes; on
  // the AMX tiles the float step ran until 2026-12-06: bench/RESULTS.md §15b). The queries
  // and keys are bf16 already, their products exact in float32: the logits, and so the lse
  // the backward divides by, are the float step's up to the order of the float32 sums; each
  // weight P is rounded to bfloat16 once for P·V (the bf16 contract, docs/numerics.md).
  const Bf16Unit latent_unit = sparse_dot_unit<T>(e, problem.dense.modifiers, problem.dense.precision);
  std::vector<ForwardScratch<T>> scratch;
  scratch.reserve(static_cast<size_t>(threads));
  for (int t = 0; t < threads; ++t) scratch.emplace_back(e, problem.keys, latent_unit);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 8)
  for (int64_t u = 0; u < units; ++u) {
    // Queries innermost: consecutive units read one kv head's K and V, which then stay in
    // the last-level cache (all kv heads' rows at 8192 keys are 64 MiB in float at d 128).
    const int64_t i = u % e.q_len, g = (u / e.q_len) % e.kv_heads, b = u / (e.kv_heads * e.q_len);
    ForwardUnit(problem, b, i, g, scratch[static_cast<size_t>(omp_get_thread_num())]);
  }
}

}  // namespace

void SparseForwardFloat(const detail::SparseForwardProblem<float>& p) { SparseForwardImpl(p); }
void SparseForwardBf16(const detail::SparseForwardProblem<bfloat16>& p) { SparseForwardImpl(p); }
void SparseForwardF16(const detail::SparseForwardProblem<float16>& p) { SparseForwardImpl(p); }

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::cpu {
HWY_EXPORT(SparseForwardFloat);
HWY_EXPORT(SparseForwardBf16);
HWY_EXPORT(SparseForwardF16);

void sparse_forward(const detail::SparseForwardProblem<float>& problem) {
  apply_simd_target_override();
  HWY_DYNAMIC_DISPATCH(SparseForwardFloat)(problem);
}
void sparse_forward(const detail::SparseForwardProblem<bfloat16>& problem) {
  apply_simd_target_override();
  HWY_DYNAMIC_DISPATCH(SparseForwardBf16)(problem);
}
void sparse_forward(const detail::SparseForwardProblem<float16>& problem) {
  apply_simd_target_override();
  HWY_DYNAMIC_DISPATCH(SparseForwardF16)(problem);
}
}  // namespace qkv::cpu
#endif
