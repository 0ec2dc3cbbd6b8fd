// The bfloat16 forward on the AMX tiles in the row layout (amx_rows.hpp), and what it
// shares with the block kernel of forward.cpp: the once-per-call packings of K and V, and
// the output rows.
//
// For each (batch, head, block of 64 queries), over spans of up to amx::kSpanKeys keys (8
// consecutive non-empty key blocks of the tile plan):
//
//   S = Q·K_spanᵀ                            tiles, a row per query, unscaled
//   per row: keys outside [key_begin, key_end) → −inf (the partial tiles' mask)
//            m' = max(m, scale·max_j S),  P = exp(scale·S − m'),  l = l·e^(m−m') + Σ P
//   acc = acc·e^(m−m') + bf16(P)·V_span      tiles, onto acc, one reduction per span
//   out = acc / l,  lse = m + log l
//
// PyTorch's CPU flash attention and SGLang's take this shape (512-key blocks, P as the
// left operand as it stands); the block kernel's 64-key steps spent most of the tiles'
// time loading and storing the accumulator and 12% transposing P (bench/RESULTS.md §10g).
// Calls it takes: bfloat16 on the AMX tiles (Precision::fast) with the plain variants —
// causal, windows, lengths, varlen, GQA, sinks, any d and dv — and each key block read
// by more than one query block (else K and V are not worth packing). Score modifiers,
// elementwise masks, mask_mod, dropout and statistics take the block kernel, and so does
// a task whose partial tiles hold a non-finite value (decided before it writes anything).
#if defined(QKV_CPU_FORWARD_ROWS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_FORWARD_ROWS_INL_H_
#undef QKV_CPU_FORWARD_ROWS_INL_H_
#else
#define QKV_CPU_FORWARD_ROWS_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "core/problem.hpp"
#include "core/tile_plan.hpp"
#include "cpu/amx_rows.hpp"
#include "cpu/bf16_dot.hpp"
#include "cpu/block_mask.hpp"
#include "cpu/block_ops-inl.h"
#include "cpu/blocking.hpp"
#include "cpu/dot_products.hpp"
#include "cpu/finite_scan.hpp"
#include "cpu/scratch_cache.hpp"
#include "cpu/storage-inl.h"
#include "cpu/work_order.hpp"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {

// Every key block's K or V of a bfloat16 call in the layout a kernel's tiles load, packed
// once per call when a key block is read by more than one query block (a GQA group's heads,
// or a head's query blocks) and the copy stays under kMaxBytes:
//   values  V as pairs across rows (bf16dot::PackRowPairs; the P·V product of either unit),
//           zero pair rows up to 32. Packing per block measured ~20% of the AMX P·V's
//           time (64 × 64 keys × queries, dv 128, the Xeon of §10).
//   keys    K as pairs along d (amx::PackKeyPairs; the row kernel's S = Q·Kᵀ).
// A block's words follow its predecessor's, so a span of consecutive key blocks of one
// (entry, kv head) is one array.
enum class PackedKind { values, keys };

template <class T>
class PackedBlocks {
 public:
  static constexpr size_t kMaxBytes = size_t{512} << 20;

  PackedBlocks(const detail::ForwardProblem<T>& p, PackedKind kind, bool wanted) : kind_(kind) {
    const detail::Extents& e = p.extents;
    if (!std::is_same_v<T, bfloat16> || !wanted) return;
    if (e.group() == 1 && e.q_len <= kBlockQueries) return;  // each key block read once
    if (kind == PackedKind::values) {
      ld_ = bf16dot::pair_ld(static_cast<size_t>(e.v_dim));
      block_words_ = kBlockKeys / 2 * ld_;
    } else {
      ld_ = amx::kKeyBlock;
      block_words_ = amx::key_block_words(static_cast<size_t>(e.head_dim));
    }
    size_t blocks = 0;
    for (int64_t b = 0; b < e.batch; ++b) {
      first_.push_back(blocks);
      const int64_t key_blocks = (p.mask.sequences.k_len(b) + kBlockKeys - 1) / kBlockKeys;
      for (int64_t h = 0; h < e.kv_heads; ++h)
        for (int64_t k = 0; k < key_blocks; ++k) items_.push_back({b, h, k});
      blocks += static_cast<size_t>(e.kv_heads * key_blocks);
    }
    if (blocks * block_words_ * sizeof(uint32_t) > kMaxBytes) {
      items_.clear();
      return;
    }
    words_ = ScratchWords(blocks * block_words_);  // every word is written by pack()
  }

  bool active() const { return words_.data() != nullptr; }
  size_t size() const { return active() ? items_.size() : 0; }

  void pack(const detail::ForwardProblem<T>& p, size_t item) const {
    if constexpr (std::is_same_v<T, bfloat16>) {
      const Item& it = items_[item];
      const int64_t first_key = it.k_block * kBlockKeys;
      const size_t keys = static_cast<size_t>(std::min(kBlockKeys, p.mask.sequences.k_len(it.batch) - first_key));
      uint32_t* out = const_cast<uint32_t*>(block(p, it.batch, it.kv_head, it.k_block));
      if (kind_ == PackedKind::keys) {
        amx::PackKeyPairs(p.rows().k(it.batch, first_key, it.kv_head), p.args.k.strides[1], keys,
                          static_cast<size_t>(p.extents.head_dim), out);
        return;
      }
      bf16dot::PackRowPairs(p.rows().v(it.batch, first_key, it.kv_head), p.args.v.strides[1], keys,
                            static_cast<size_t>(p.extents.v_dim), out, ld_);
      const size_t packed = (keys + 1) / 2 * ld_;
      std::fill(out + packed, out + block_words_, 0u);
    } else {
      (void)p, (void)item;
    }
  }

  const uint32_t* block(const detail::ForwardProblem<T>& p, int64_t b, int64_t kv_head, int64_t k_block) const {
    const size_t key_blocks = static_cast<size_t>((p.mask.sequences.k_len(b) + kBlockKeys - 1) / kBlockKeys);
    const size_t index = first_[static_cast<size_t>(b)] + static_cast<size_t>(kv_head) * key_blocks +
                         static_cast<size_t>(k_block);
    return words_.data() + index * block_words_;
  }
  size_t ld() const { return ld_; }

 private:
  struct Item {
    int64_t batch, kv_head, k_block;
  };
  PackedKind kind_;
  size_t ld_ = 0, block_words_ = 0;
  std::vector<size_t> first_;  // per batch entry: its first block
  std::vector<Item> items_;
  ScratchWords words_;
};

// out = acc / l and lse = m + log l for a block's rows (acc rows acc_ld apart); a query
// that saw no key at all has l = 0: out 0, lse −inf.
template <class T>
void WriteOutputRows(const detail::ForwardProblem<T>& p, const QueryRows& rows, const float* acc, size_t acc_ld,
                     const float* m, const float* l) {
  const auto rows_of = p.rows();
  const size_t dv = static_cast<size_t>(p.extents.v_dim);
  for (size_t i = 0; i < static_cast<size_t>(rows.count); ++i) {
    const int64_t query = rows.first + static_cast<int64_t>(i);
    T* out = rows_of.out(rows.batch, query, rows.head);
    const float* row = acc + i * acc_ld;
    if (l[i] == 0.0f) {
      std::fill(out, out + dv, StoreAs<T>(0.0f));
    } else {
      for (size_t c = 0; c < dv; ++c) out[c] = StoreAs<T>(row[c] / l[i]);  // no 1/l rounding
    }
    if (!p.args.lse.empty()) {
      // A degenerate row was computed shifted by its largest bias (block_mask.hpp).
      const float shift = rows.degenerate != nullptr ? rows.degenerate[i] : 0.0f;
      rows_of.lse(rows.batch, rows.head, query) = l[i] == 0.0f ? kMinusInf : m[i] + std::log(l[i]) + shift;
    }
  }
}

// Whether a call may take the row kernel (the header's list) on its bfloat16 unit; it
// takes it when the packings of K and V made for it are there too (under kMaxBytes). The
// Highway target does not matter: the kernel is AVX-512 and AMX code of its own, with its
// own layouts (a forced QKV_SIMD_TARGET=AVX2, or the AVX2-only sanitizer build, on an AMX
// machine still takes it).
template <class T>
bool RowKernelFits(const detail::ForwardProblem<T>& p, Bf16Unit unit) {
  const detail::ScoreModifiers& mods = p.modifiers;
  return std::is_same_v<T, bfloat16> && unit == Bf16Unit::amx && amx_row_forward() && p.scale > 0.0 && mods.softcap == 0.0f && !mods.has_alibi() && !mods.has_score_mod() &&
         !mods.has_dropout() && !p.mask.has_elementwise() && !p.mask.has_mask_mod() && !p.collect_stats;
}

// Per-thread scratch of the row kernel.
struct RowScratch {
  static constexpr size_t kScoreLd = amx::kSpanKeys + 16;  // not a multiple of 4 KiB: no set aliasing
  size_t dv_ld;
  hwy::AlignedFreeUniquePtr<float[]> s;    // kBlockQueries × kScoreLd: S
  std::vector<uint16_t> p;                 // kBlockQueries × amx::kSpanKeys: bf16(P)
  hwy::AlignedFreeUniquePtr<float[]> acc;  // kBlockQueries × dv_ld
  hwy::AlignedFreeUniquePtr<float[]> stats;  // m, l, alpha: 3 × kBlockQueries
  std::vector<uint16_t> q_rows;            // kBlockQueries × amx::query_ld(d)
  std::vector<int32_t> key_begin, key_end;  // per row: its visible keys [begin, end)
  std::vector<int32_t> lo, hi;               // the same relative to a span, clamped to it

  explicit RowScratch(const detail::Extents& e)
      : dv_ld(round_up(static_cast<size_t>(e.v_dim), 16)),
        s(AllocateFloats(kBlockQueries * kScoreLd)),
        p(kBlockQueries * amx::kSpanKeys),
        acc(AllocateFloats(kBlockQueries * dv_ld)),
        stats(AllocateFloats(3 * kBlockQueries)),
        q_rows(kBlockQueries * amx::query_ld(static_cast<size_t>(e.head_dim))),
        key_begin(kBlockQueries),
        key_end(kBlockQueries),
        lo(kBlockQueries),
        hi(kBlockQueries) {}
};

// One forward task on the row kernel. Returns false, having written nothing, when a
// partial tile of the task reads a key block whose V holds NaN/Inf: the block kernel then
// takes the task (its slow path skips the zero weights, which the tiles cannot).
template <class T>
bool RowsForwardBlock(const detail::ForwardProblem<T>& p, const detail::TilePlan& plan, const KeyValueFinite& finite,
                      const PackedBlocks<T>& keys_packed, const PackedBlocks<T>& values_packed,
                      const ForwardTask& task, RowScratch& s) {
  const detail::Extents& e = p.extents;
  const int64_t b = task.batch, h = task.head, kv_head = e.kv_head_of(h);
  const int64_t q_block = task.first_query / kBlockQueries;
  const int64_t k_len = p.mask.sequences.k_len(b);
  const int64_t first_block = plan.first_key_block(b, h, q_block), last_block = plan.last_key_block(b, h, q_block);
  for (int64_t k_block = first_block; k_block <= last_block; ++k_block)
    if (plan.at(b, h, q_block, k_block) == detail::Tile::partial && !finite.values(b, kv_head, k_block)) return false;

  QueryRows rows{.batch = b, .head = h, .first = task.first_query,
                 .count = std::min(kBlockQueries, p.mask.q_len(b) - task.first_query),
                 .degenerate = plan.degenerate_rows(b, h, task.first_query)};
  const size_t count = static_cast<size_t>(rows.count);
  describe_rows(p.mask, rows, s.key_begin.data(), s.key_end.data(), count);
  const size_t d = static_cast<size_t>(e.head_dim), dv = static_cast<size_t>(e.v_dim);
  if constexpr (std::is_same_v<T, bfloat16>)
    amx::PackQueryRows(p.rows().q(b, rows.first, h), p.args.q.strides[1], count, d, s.q_rows.data());
  float* m = s.stats.get();
  float* l = m + kBlockQueries;
  float* alpha = l + kBlockQueries;
  const detail::ScoreModifiers& mods = p.modifiers;
  // A sink is a key with logit sinks[h] and no value: it starts every row's max and sum.
  std::fill(m, m + count, mods.has_sinks() ? mods.sinks[h] : kMinusInf);
  std::fill(l, l + count, mods.has_sinks() ? 1.0f : 0.0f);
  std::fill(s.acc.get(), s.acc.get() + round_up(count, 16) * s.dv_ld, 0.0f);  // the tiles' rows too

  const float scale = static_cast<float>(p.scale);
  const amx::TileScope tile_scope(true);  // no hook runs between the products
  constexpr int64_t kSpanBlocks = static_cast<int64_t>(amx::kSpanKeys) / kBlockKeys;
  for (int64_t k_block = first_block; k_block <= last_block;) {
    if (plan.at(b, h, q_block, k_block) == detail::Tile::empty) {
      ++k_block;
      continue;
    }
    int64_t blocks = 1;
    while (blocks < kSpanBlocks && k_block + blocks <= last_block &&
           plan.at(b, h, q_block, k_block + blocks) != detail::Tile::empty)
      ++blocks;
    const int64_t first_key = k_block * kBlockKeys;
    const size_t keys = static_cast<size_t>(std::min(blocks * kBlockKeys, k_len - first_key));
    for (size_t i = 0; i < count; ++i) {
      s.lo[i] = static_cast<int32_t>(std::clamp<int64_t>(s.key_begin[i] - first_key, 0, static_cast<int64_t>(keys)));
      s.hi[i] = static_cast<int32_t>(std::clamp<int64_t>(s.key_end[i] - first_key, 0, static_cast<int64_t>(keys)));
    }
    if constexpr (std::is_same_v<T, bfloat16>) {
      const amx::Span span{.q = s.q_rows.data(), .count = count, .d = d,
                           .k_blocks = keys_packed.block(p, b, kv_head, k_block), .keys = keys,
                           .v_pairs = values_packed.block(p, b, kv_head, k_block), .v_ld = values_packed.ld(),
                           .dv = dv, .lo = s.lo.data(), .hi = s.hi.data(), .scale = scale};
      amx::AttendSpan(span, {s.s.get(), RowScratch::kScoreLd, s.p.data(), amx::kSpanKeys}, {m, l, alpha, s.acc.get(), s.dv_ld});
    }
    k_block += blocks;
  }
  WriteOutputRows(p, rows, s.acc.get(), s.dv_ld, m, l);
  count_amx_row_task();
  return true;
}

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
