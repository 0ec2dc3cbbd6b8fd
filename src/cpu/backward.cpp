// Fused backward, FlashAttention-2 style, without atomics and without a
// thread-count-dependent reduction (bitwise identical results for any number of
// threads). Two schedules (work_order.hpp, backward_single_pass): with many heads, one
// task per (batch, kv head) does passes 1 and 2 together (dQ accumulated in key-block
// order); with few heads, the two passes below run as separate parallel loops.
//
// In the forward pass  Sᵀ = K·(scale·Q)ᵀ,  P = exp(S − lse),  O = P·V;  so now:
//   prepack (per query block): scale·Qᵀ, dOᵀ, lse (−inf → +inf so masked rows give
//     P = 0), D = rowsum(dO ⊙ O)                       (FlashAttention's D_i = ⟨P_i, dP_i⟩)
//   pass 1, one task per (batch, kv head, 64 keys), over every query that sees them:
//     Pᵀ = exp(K_blk·Qᵀ − lse),  dV += Pᵀ·dO,  dPᵀ = V_blk·dOᵀ,  dSᵀ = Pᵀ⊙(dPᵀ − D),
//     dK += dSᵀ·Q                                         (scaled once at the end)
//   pass 2, one task per (batch, head, 64 queries), over every key it sees:
//     the same Pᵀ and dSᵀ, then dQ += dS·K_blk              (scaled once at the end)
// Run separately, pass 2 recomputes S and dP (7 block products instead of 5): the price
// of using every core on one head without per-thread copies of dQ.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/backward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "cpu/block_ops-inl.h"
#include "cpu/gemm-inl.h"

#ifndef QKV_CPU_BACKWARD_ONCE_
#define QKV_CPU_BACKWARD_ONCE_
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/block_mask.hpp"
#include "cpu/blocking.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/work_order.hpp"
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {

namespace {

// Whole-problem packed operands, [batch][head] panels of nq_ld query columns each.
// Extra memory ≈ B·Hq·Nq·(d + dv + 2) floats (+ padded Q / dO rows for head dims that
// are not whole vectors): linear in N.
struct Packed {
  size_t nq_ld = 0;  // queries rounded up to whole vectors
  size_t d_ld = 0, dv_ld = 0;
  bool pad_q_rows = false, pad_dout_rows = false;
  hwy::AlignedFreeUniquePtr<float[]> qt;      // d × nq_ld: scale·Qᵀ
  hwy::AlignedFreeUniquePtr<float[]> dot;     // dv × nq_ld: dOᵀ
  hwy::AlignedFreeUniquePtr<float[]> lse;     // nq_ld: −inf and padding → +inf
  hwy::AlignedFreeUniquePtr<float[]> delta;   // nq_ld: D_i
  hwy::AlignedFreeUniquePtr<float[]> q_rows;  // Nq × d_ld, only if d % lanes ≠ 0
  hwy::AlignedFreeUniquePtr<float[]> dout_rows;  // Nq × dv_ld, only if dv % lanes ≠ 0
  const detail::Extents* e = nullptr;

  size_t head_index(int64_t b, int64_t h) const {
    return static_cast<size_t>(b * e->q_heads + h);
  }
  float* qt_of(int64_t b, int64_t h) const {
    return qt.get() + head_index(b, h) * static_cast<size_t>(e->head_dim) * nq_ld;
  }
  float* dot_of(int64_t b, int64_t h) const {
    return dot.get() + head_index(b, h) * static_cast<size_t>(e->v_dim) * nq_ld;
  }
  float* lse_of(int64_t b, int64_t h) const { return lse.get() + head_index(b, h) * nq_ld; }
  float* delta_of(int64_t b, int64_t h) const { return delta.get() + head_index(b, h) * nq_ld; }
  float* q_rows_of(int64_t b, int64_t h) const {
    return q_rows.get() + head_index(b, h) * static_cast<size_t>(e->q_len) * d_ld;
  }
  float* dout_rows_of(int64_t b, int64_t h) const {
    return dout_rows.get() + head_index(b, h) * static_cast<size_t>(e->q_len) * dv_ld;
  }
};

// A B-operand: row-major rows `ld` floats apart, each padded to whole vectors.
struct Rows {
  const float* data;
  size_t ld;
};

// Per-thread scratch (floats): two score tiles and the block accumulators.
struct BackwardScratch {
  size_t width;
  hwy::AlignedFreeUniquePtr<float[]> pt;    // kBlockKeys × width: Pᵀ
  hwy::AlignedFreeUniquePtr<float[]> dst;   // kBlockKeys × width: dPᵀ, then dSᵀ
  hwy::AlignedFreeUniquePtr<float[]> acc;   // kBlockKeys × (d_ld + dv_ld): dK, dV
  hwy::AlignedFreeUniquePtr<float[]> k_pad; // kBlockKeys × d_ld, only if d % lanes ≠ 0
  hwy::AlignedFreeUniquePtr<float[]> dq;    // dQ accumulator: dq_rows × d_ld
  hwy::AlignedFreeUniquePtr<float[]> partial;  // one block product before it is added
  std::vector<int64_t> key_end;

  // dq_rows: kBlockQueries (two-pass) or group × Nq (single-pass).
  BackwardScratch(const Packed& packed, size_t lanes, size_t dq_rows)
      : width(round_up(kBlockQueries, lanes)),
        pt(AllocateFloats(kBlockKeys * width)),
        dst(AllocateFloats(kBlockKeys * width)),
        acc(AllocateFloats(kBlockKeys * (packed.d_ld + packed.dv_ld))),
        k_pad(AllocateFloats(packed.pad_q_rows ? kBlockKeys * packed.d_ld : 0)),
        dq(AllocateFloats(dq_rows * packed.d_ld)),
        partial(AllocateFloats(std::max<size_t>(kBlockKeys, width) *
                               std::max(packed.d_ld, packed.dv_ld))),
        key_end(width) {}
};

void PackQueryBlock(const detail::BackwardProblem<float>& p, const ForwardTask& task,
                    Packed& packed) {
  const auto& a = p.args;
  const detail::Extents& e = p.extents;
  const size_t lanes = VectorLanes();
  const int64_t b = task.batch, h = task.head, first = task.first_query;
  const size_t count = static_cast<size_t>(std::min(kBlockQueries, e.q_len - first));
  // The block's columns, up to whole vectors (the last block also zeroes the padding).
  const size_t cols = std::min(round_up(count, lanes), packed.nq_ld - static_cast<size_t>(first));
  const size_t d = static_cast<size_t>(e.head_dim), dv = static_cast<size_t>(e.v_dim);

  // The block's columns of the transposed panels (rows of Qᵀ are nq_ld apart).
  float* qt = packed.qt_of(b, h) + first;
  float* dot = packed.dot_of(b, h) + first;
  PackTransposed(&a.q(b, first, h, 0), a.q.strides[1], count, d, static_cast<float>(p.scale), qt,
                 packed.nq_ld, cols);
  PackTransposed(&a.dout(b, first, h, 0), a.dout.strides[1], count, dv, 1.0f, dot, packed.nq_ld,
                 cols);

  float* lse = packed.lse_of(b, h) + first;
  float* delta = packed.delta_of(b, h) + first;
  for (size_t i = 0; i < cols; ++i) {
    if (i >= count) {
      lse[i] = kPlusInf;
      delta[i] = 0.0f;
      continue;
    }
    const int64_t query = first + static_cast<int64_t>(i);
    const float value = a.lse(b, h, query);
    lse[i] = value == kMinusInf ? kPlusInf : value;
    // D_i = ⟨dO_i, O_i⟩ in double: it is subtracted from every dP_ij of the row.
    double dot_product = 0.0;
    for (size_t c = 0; c < dv; ++c)
      dot_product += static_cast<double>(a.dout(b, query, h, c)) * a.out(b, query, h, c);
    delta[i] = static_cast<float>(dot_product);
  }
  if (packed.pad_q_rows)
    PackRowsPadded(&a.q(b, first, h, 0), a.q.strides[1], count, d,
                   packed.q_rows_of(b, h) + static_cast<size_t>(first) * packed.d_ld, packed.d_ld);
  if (packed.pad_dout_rows)
    PackRowsPadded(&a.dout(b, first, h, 0), a.dout.strides[1], count, dv,
                   packed.dout_rows_of(b, h) + static_cast<size_t>(first) * packed.dv_ld,
                   packed.dv_ld);
}

// Pᵀ and dSᵀ of one (key block, query block) pair into scratch.pt and scratch.dst.
// Returns the columns (queries, padded to whole vectors) computed.
size_t ScoreBlock(const detail::BackwardProblem<float>& p, const Packed& packed,
                  const QueryRows& rows, int64_t kv_head, int64_t first_key, int64_t keys,
                  BackwardScratch& s) {
  const auto& a = p.args;
  const detail::Extents& e = p.extents;
  const size_t width = round_up(static_cast<size_t>(rows.count), VectorLanes());
  const size_t kn = static_cast<size_t>(keys);
  const float* k = &a.k(rows.batch, first_key, kv_head, 0);
  const float* v = &a.v(rows.batch, first_key, kv_head, 0);
  const size_t offset = static_cast<size_t>(rows.first);

  Gemm(kn, width, static_cast<size_t>(e.head_dim),
       StridedA{k, static_cast<size_t>(a.k.strides[1]), 1},
       packed.qt_of(rows.batch, rows.head) + offset, packed.nq_ld, s.pt.get(), width, false);
  if (needs_mask(p.mask, rows, first_key, keys))
    apply_mask(p.mask, rows, first_key, keys, s.pt.get(), width);
  ProbabilitiesFromLse(s.pt.get(), kn, width, packed.lse_of(rows.batch, rows.head) + offset);

  Gemm(kn, width, static_cast<size_t>(e.v_dim),
       StridedA{v, static_cast<size_t>(a.v.strides[1]), 1},
       packed.dot_of(rows.batch, rows.head) + offset, packed.nq_ld, s.dst.get(), width, false);
  ScoreGradient(s.pt.get(), s.dst.get(), kn, width,
                packed.delta_of(rows.batch, rows.head) + offset);
  return width;
}

// dQ_rows += dS·K_blk for the block just scored (dS read in place from dSᵀ in s.dst).
void AccumulateQueryGradient(const detail::BackwardProblem<float>& p, const Packed& packed,
                             const QueryRows& rows, size_t width, int64_t kv_head,
                             int64_t first_key, int64_t keys, float* dq_rows,
                             BackwardScratch& s) {
  const auto& a = p.args;
  const size_t d = static_cast<size_t>(p.extents.head_dim);
  const size_t kn = static_cast<size_t>(keys), count = static_cast<size_t>(rows.count);
  const float* k = &a.k(rows.batch, first_key, kv_head, 0);
  const int64_t k_row = a.k.strides[1];
  if (needs_mask(p.mask, rows, first_key, keys) && !AllFinite(k, k_row, kn, d)) {
    AccumulateSkippingZeros(s.dst.get(), width, count, kn, k, k_row, d, dq_rows, packed.d_ld);
    return;
  }
  const float* k_operand = k;
  size_t k_ld = static_cast<size_t>(k_row);
  if (packed.pad_q_rows) {  // d is not whole vectors: pad K's rows like Q's
    PackRowsPadded(k, k_row, kn, d, s.k_pad.get(), packed.d_ld);
    k_operand = s.k_pad.get();
    k_ld = packed.d_ld;
  }
  GemmAddBlock(count, packed.d_ld, kn, StridedA{s.dst.get(), 1, width}, k_operand, k_ld, dq_rows,
               packed.d_ld, s.partial.get());
}

// dK, dV of one key block over every query that sees it. With dq_group (the
// single-pass schedule), also adds dS·K_blk to the group's dQ rows [head][query][d_ld].
void KeyValueBlock(const detail::BackwardProblem<float>& p, const Packed& packed,
                   const KeyTask& task, BackwardScratch& s, float* dq_group = nullptr) {
  const auto& a = p.args;
  const detail::Extents& e = p.extents;
  const int64_t b = task.batch, first_key = task.first_key;
  const int64_t keys = std::min(kBlockKeys, e.k_len - first_key);
  const size_t kn = static_cast<size_t>(keys);
  const size_t d = static_cast<size_t>(e.head_dim), dv = static_cast<size_t>(e.v_dim);
  float* dk_acc = s.acc.get();                     // kn × d_ld
  float* dv_acc = dk_acc + kBlockKeys * packed.d_ld;  // kn × dv_ld
  std::fill(dk_acc, dk_acc + kn * packed.d_ld, 0.0f);
  std::fill(dv_acc, dv_acc + kn * packed.dv_ld, 0.0f);

  const int64_t first_seeing = first_query_seeing(p.mask, b, first_key, e.q_len);
  const int64_t start = first_seeing / kBlockQueries * kBlockQueries;
  for (int64_t h = task.kv_head * e.group(); h < (task.kv_head + 1) * e.group(); ++h) {
    const Rows q_rows = packed.pad_q_rows
                            ? Rows{packed.q_rows_of(b, h), packed.d_ld}
                            : Rows{&a.q(b, 0, h, 0), static_cast<size_t>(a.q.strides[1])};
    const Rows dout_rows =
        packed.pad_dout_rows ? Rows{packed.dout_rows_of(b, h), packed.dv_ld}
                             : Rows{&a.dout(b, 0, h, 0), static_cast<size_t>(a.dout.strides[1])};
    for (int64_t first = start; first < e.q_len; first += kBlockQueries) {
      QueryRows rows{.batch = b, .head = h, .first = first,
                     .count = std::min(kBlockQueries, e.q_len - first)};
      describe_rows(p.mask, rows, s.key_end.data());
      if (rows.max_key_end <= first_key) continue;  // nobody in this block sees these keys
      const size_t width = ScoreBlock(p, packed, rows, task.kv_head, first_key, keys, s);
      const size_t count = static_cast<size_t>(rows.count);
      // dV += Pᵀ·dO_blk and dK += dSᵀ·Q_blk (the sum runs over this block's queries).
      GemmAddBlock(kn, packed.dv_ld, count, StridedA{s.pt.get(), width, 1},
                   dout_rows.data + static_cast<size_t>(first) * dout_rows.ld, dout_rows.ld,
                   dv_acc, packed.dv_ld, s.partial.get());
      GemmAddBlock(kn, packed.d_ld, count, StridedA{s.dst.get(), width, 1},
                   q_rows.data + static_cast<size_t>(first) * q_rows.ld, q_rows.ld, dk_acc,
                   packed.d_ld, s.partial.get());
      if (dq_group != nullptr) {
        const size_t head_in_group = static_cast<size_t>(h - task.kv_head * e.group());
        float* dq_rows = dq_group + (head_in_group * static_cast<size_t>(e.q_len) +
                                     static_cast<size_t>(first)) * packed.d_ld;
        AccumulateQueryGradient(p, packed, rows, width, task.kv_head, first_key, keys, dq_rows, s);
      }
    }
  }
  const float scale = static_cast<float>(p.scale);
  for (size_t j = 0; j < kn; ++j) {
    const int64_t key = first_key + static_cast<int64_t>(j);
    float* dk = &a.dk(b, key, task.kv_head, 0);
    float* dvv = &a.dv(b, key, task.kv_head, 0);
    for (size_t c = 0; c < d; ++c) dk[c] = scale * dk_acc[j * packed.d_ld + c];
    for (size_t c = 0; c < dv; ++c) dvv[c] = dv_acc[j * packed.dv_ld + c];
  }
}

// dq = scale·dq_acc for `count` rows starting at query `first` of head h.
void WriteQueryGradient(const detail::BackwardProblem<float>& p, const Packed& packed,
                        int64_t b, int64_t h, int64_t first, int64_t count,
                        const float* dq_acc) {
  const size_t d = static_cast<size_t>(p.extents.head_dim);
  const float scale = static_cast<float>(p.scale);
  for (int64_t i = 0; i < count; ++i) {
    float* dq = &p.args.dq(b, first + i, h, 0);
    const float* acc = dq_acc + static_cast<size_t>(i) * packed.d_ld;
    for (size_t c = 0; c < d; ++c) dq[c] = scale * acc[c];
  }
}

// Pass 2 of the two-pass schedule: one query block's dQ over every key it sees.
void QueryBlockGradient(const detail::BackwardProblem<float>& p, const Packed& packed,
                        const ForwardTask& task, BackwardScratch& s) {
  const detail::Extents& e = p.extents;
  const int64_t kv_head = e.kv_head_of(task.head);
  QueryRows rows{.batch = task.batch, .head = task.head, .first = task.first_query,
                 .count = std::min(kBlockQueries, e.q_len - task.first_query)};
  describe_rows(p.mask, rows, s.key_end.data());
  float* dq_acc = s.dq.get();  // count × d_ld
  std::fill(dq_acc, dq_acc + static_cast<size_t>(rows.count) * packed.d_ld, 0.0f);
  for (int64_t first_key = 0; first_key < rows.max_key_end; first_key += kBlockKeys) {
    const int64_t keys = std::min(kBlockKeys, rows.max_key_end - first_key);
    const size_t width = ScoreBlock(p, packed, rows, kv_head, first_key, keys, s);
    AccumulateQueryGradient(p, packed, rows, width, kv_head, first_key, keys, dq_acc, s);
  }
  WriteQueryGradient(p, packed, task.batch, task.head, rows.first, rows.count, dq_acc);
}

// The single-pass schedule: one (batch, kv head) does every key block in order, and
// adds each block's dS·K to the group's dQ as it goes (fixed order: deterministic).
void HeadGroupGradient(const detail::BackwardProblem<float>& p, const Packed& packed,
                       int64_t b, int64_t kv_head, BackwardScratch& s) {
  const detail::Extents& e = p.extents;
  const size_t rows_per_head = static_cast<size_t>(e.q_len) * packed.d_ld;
  float* dq_group = s.dq.get();  // group × Nq × d_ld
  std::fill(dq_group, dq_group + static_cast<size_t>(e.group()) * rows_per_head, 0.0f);
  for (int64_t first_key = 0; first_key < e.k_len; first_key += kBlockKeys)
    KeyValueBlock(p, packed, KeyTask{b, kv_head, first_key, 0}, s, dq_group);
  for (int64_t g = 0; g < e.group(); ++g)
    WriteQueryGradient(p, packed, b, kv_head * e.group() + g, 0, e.q_len,
                       dq_group + static_cast<size_t>(g) * rows_per_head);
}

}  // namespace

void BackwardImpl(const detail::BackwardProblem<float>& p) {
  const detail::Extents& e = p.extents;
  const size_t lanes = VectorLanes();
  const std::vector<ForwardTask> query_tasks = forward_tasks(e, p.mask);
  const std::vector<KeyTask> kv_tasks = key_tasks(e, p.mask);
  if (query_tasks.empty() && kv_tasks.empty()) return;

  Packed packed;
  packed.e = &e;
  packed.nq_ld = round_up(static_cast<size_t>(e.q_len), lanes);
  packed.d_ld = round_up(static_cast<size_t>(e.head_dim), lanes);
  packed.dv_ld = round_up(static_cast<size_t>(e.v_dim), lanes);
  packed.pad_q_rows = static_cast<size_t>(e.head_dim) % lanes != 0;
  packed.pad_dout_rows = static_cast<size_t>(e.v_dim) % lanes != 0;
  const size_t heads = static_cast<size_t>(e.batch * e.q_heads);
  const size_t nq = static_cast<size_t>(e.q_len);
  packed.qt = AllocateFloats(heads * static_cast<size_t>(e.head_dim) * packed.nq_ld);
  packed.dot = AllocateFloats(heads * static_cast<size_t>(e.v_dim) * packed.nq_ld);
  packed.lse = AllocateFloats(heads * packed.nq_ld);
  packed.delta = AllocateFloats(heads * packed.nq_ld);
  packed.q_rows = AllocateFloats(packed.pad_q_rows ? heads * nq * packed.d_ld : 0);
  packed.dout_rows =
      AllocateFloats(packed.pad_dout_rows ? heads * nq * packed.dv_ld : 0);

  const bool single_pass = backward_single_pass(e);
  const size_t head_groups = static_cast<size_t>(e.batch * e.kv_heads);
  const size_t most_tasks =
      single_pass ? head_groups : std::max(query_tasks.size(), kv_tasks.size());
  const size_t dq_rows = single_pass ? static_cast<size_t>(e.group() * e.q_len)
                                     : static_cast<size_t>(kBlockQueries);
  // The backward does about 3.5 forwards' worth of block products.
  const int threads = threads_for(p.threads, most_tasks, 3.5 * forward_flops(query_tasks, e));
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (size_t t = 0; t < query_tasks.size(); ++t) PackQueryBlock(p, query_tasks[t], packed);
    // (implicit barrier: every task below reads every query block's packed panels)
    BackwardScratch scratch(packed, lanes, dq_rows);
    if (single_pass) {
#pragma omp for schedule(dynamic, 1)
      for (size_t t = 0; t < head_groups; ++t)
        HeadGroupGradient(p, packed, static_cast<int64_t>(t) / e.kv_heads,
                          static_cast<int64_t>(t) % e.kv_heads, scratch);
    } else {
#pragma omp for schedule(dynamic, 1) nowait
      for (size_t t = 0; t < kv_tasks.size(); ++t)
        KeyValueBlock(p, packed, kv_tasks[t], scratch);
      // Pass 2 reads only the packed panels and K, V: no barrier needed before it.
#pragma omp for schedule(dynamic, 1)
      for (size_t t = 0; t < query_tasks.size(); ++t)
        QueryBlockGradient(p, packed, query_tasks[t], scratch);
    }
  }
}

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::cpu {
HWY_EXPORT(BackwardImpl);

void backward(const detail::BackwardProblem<float>& problem) {
  HWY_DYNAMIC_DISPATCH(BackwardImpl)(problem);
}

const char* simd_target_name() {
  // Highway numbers targets so that the best has the lowest bit.
  const int64_t usable = hwy::SupportedTargets() & HWY_TARGETS;
  return hwy::TargetName(usable & -usable);
}

std::vector<int64_t> compiled_simd_targets() {
  std::vector<int64_t> targets;
  for (int64_t rest = hwy::SupportedTargets() & HWY_TARGETS; rest != 0; rest &= rest - 1)
    targets.push_back(rest & -rest);
  return targets;
}
}  // namespace qkv::cpu
#endif
