// Sparse attention's gathered blocks (sparse_forward.cpp, sparse_backward.cpp): the rows
// of one block of a row's attended keys, handed to the split-K schedule's register
// tiles (decode_tiles-inl.h) as row pointers — a gathered block is a block of the decode
// schedule whose rows are not consecutive.
#if defined(QKV_CPU_SPARSE_GATHER_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_SPARSE_GATHER_INL_H_
#undef QKV_CPU_SPARSE_GATHER_INL_H_
#else
#define QKV_CPU_SPARSE_GATHER_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "cpu/block_ops-inl.h"
#include "cpu/blocking.hpp"
#include "cpu/decode_tiles-inl.h"
#include "cpu/storage-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {

// Attended keys per online-softmax block: the score tile is (query heads of a group) ×
// 64 floats, and the block's K and V rows (64 × d) stay in L1/L2 between the two products.
inline constexpr size_t kGatherKeys = 64;

// Consecutive query rows that sweep the keys together, and the key range they sweep
// by (the sparse forward's units, the backward's dQ pass). Each row's attended keys are
// visited range by range, every row of the tile in turn within a range, so that a
// range's K and V rows, read from the last-level cache by the first row that lists them,
// are in L1/L2 for the others: the rows of a causal prefill list overlapping sets (at
// N 8192, topk 2048, each key a row lists is listed by a quarter or more of its
// neighbours). Row by row, each read its own 2048 rows from L3 and the gathers waited on
// them (perf: the samples on the instructions after the V rows' loads; on an Emerald
// Rapids Xeon ~10 GB/s of gathered rows, the FMAs mostly idle). A range of 256 keys keeps
// its rows in L2 (GQA d 128 bf16: 128 KiB; MLA d 576 + 512: 560 KiB). Measured there
// (the forward, bf16, causal top-2048 lists, N 8192, 2 threads, interleaved runs): GQA
// 32/8 d 128 3.18–3.41 s row by row, 2.36–2.66 s in tiles of 32 rows (16 rows: 2.49–3.30;
// ranges of 128 or 512 keys no better); the MLA shape (16 heads on the AMX tiles, N 4096,
// 1 thread) 1.52–1.65 → 1.40–1.45 s. kTileRows is both passes' smallest tile
// (SweepTileRows below sizes them to the lists).
inline constexpr size_t kTileRows = 32;
inline constexpr int64_t kRangeKeys = 256;
inline constexpr size_t kMaxTileRows = 256;

// The forward's key range: 512 keys where their copy (WidenedRange: floats of d_pad, and
// of dv_pad unless the values are the keys' first channels) stays within 1.25 MiB, else
// kRangeKeys. A row then lists twice the keys a range, so each row's per-range work (its
// softmax state read and written back: 68 KiB at the MLA shape's 16 heads; the block's
// softmax and padding) is spread over twice the products. Measured (Emerald Rapids without
// AMX, causal top-2048 lists, fp32, 2 threads, one build switching the range): MLA with
// v = k[..., :512] (1.2 MiB at 512 keys) N 32768 11.9–12.0 s at 256 keys, 10.6–10.7 at
// 512, 10.4–10.7 at 1024; GQA 32/8 d 128 (512 KiB) N 16384 3.91–4.03 / 3.48–3.65 /
// 4.57–4.65 s, N 32768 9.5–14.0 / 8.9–11.3 / 11.1–11.7 s, N 8192 the same at each.
inline int64_t ForwardRangeKeys(size_t d_pad, size_t dv_pad, bool values_in_keys) {
  const size_t key_bytes = sizeof(float) * (d_pad + (values_in_keys ? 0 : dv_pad));
  return 2 * static_cast<size_t>(kRangeKeys) * key_bytes <= (size_t{5} << 18) ? 2 * kRangeKeys : kRangeKeys;
}

// The tile rows of both passes (the forward's, the backward's dQ tiles) for keys [0,
// k_len) and lists of topk: enough that the tile lists each of a range's keys ~16 times
// (a row lists about topk / k_len of them), so that each range's copy (WidenedRange)
// serves many rows: with topk 2048, 32 rows at N ≤ 4096, 64 at 8192, 128 at 16384, 256
// from 32768 — but 128 at most where a row's state (its heads' accumulators, group ·
// max(d, dv) floats) would make 256 rows' more than 1 MiB. A row's results do not depend
// on its tile: the same bits at any size. Measured (Emerald Rapids without AMX, causal
// top-2048 lists, 2 threads, one process taking tiles of 32, 64 and 128 rows in turn,
// best of each): at N 8192 the MLA shape (16 heads, d 576, dv 512) 3.32 / 2.59 / 3.04 s,
// GQA 32/8 d 128 fp32 1.98 / 1.90 / 1.99 s, bf16 1.93 / 1.70 / 1.91 s; at N 32768 the
// MLA shape 17.6 / 14.6 / 13.8 s. On a Zen 5 (2026-12-07, 2 threads, builds alternating):
// GQA fp32 at N 32768, 256 rows against 128: forward 5.03–5.10 against 5.65–5.71 s,
// backward 16.2–17.0 against 17.3–18.1 s (32 rows: 27.0–29.1 s); the MLA shape's forward
// at 256 rows 11.6–12.4 against 8.6–9.8 s at 128 (36 KiB a row), hence the cap.
template <class Extents>
size_t SweepTileRows(const Extents& e, int64_t topk) {
  const auto row_bytes = static_cast<size_t>(e.group() * std::max(e.head_dim, e.v_dim)) * sizeof(float);
  const size_t most = row_bytes * kMaxTileRows <= (size_t{1} << 20) ? kMaxTileRows : kMaxTileRows / 2;
  size_t rows = kTileRows;
  while (rows < most && static_cast<int64_t>(rows) * std::max<int64_t>(topk, 1) < 16 * e.k_len) rows *= 2;
  return rows;
}

// The blocks of a tile's rows in sweep order: for each range of kRangeKeys keys, for each
// row t < tile in turn, its sorted keys in the range in blocks of ≤ kGatherKeys:
// block(t, keys, n, next, ahead), next[0, ahead) the row's following block in the range
// (to prefetch; ahead 0: none). set_of(t) returns row t's sorted keys and their count.
// A row's blocks depend on its own keys only, never on the tile's other rows: results
// stay the same whichever rows share its tile. on_range(begin, end) runs before each
// range's blocks, end ≤ begin + kRangeKeys the tile's last listed key + 1 at most.
struct NoRangeStep {
  void operator()(int64_t, int64_t) const {}
};
// range_keys: kRangeKeys, or a range past every key (one range: each row's keys in
// consecutive blocks of kGatherKeys, for a tile of one row).
inline constexpr int64_t kWholeRange = int64_t{1} << 40;
template <class SetOf, class Block, class OnRange = NoRangeStep>
HWY_INLINE void SweepTile(size_t tile, int64_t range_keys, const SetOf& set_of, const Block& block,
                          const OnRange& on_range = {}) {
  size_t cursor[kMaxTileRows] = {};
  int32_t last = -1;
  for (size_t t = 0; t < tile; ++t) {
    const auto [keys, count] = set_of(t);
    if (count > 0) last = std::max(last, keys[count - 1]);
  }
  for (int64_t range = 0; range <= last; range += range_keys) {
    on_range(range, std::min<int64_t>(range + range_keys, int64_t{last} + 1));
    for (size_t t = 0; t < tile; ++t) {
      const auto [keys, count] = set_of(t);
      size_t end = cursor[t];
      while (end < count && keys[end] < range + range_keys) ++end;
      for (size_t start = cursor[t]; start < end; start += kGatherKeys) {
        const size_t n = std::min(kGatherKeys, end - start);
        block(t, keys + start, n, keys + start + n, std::min(kGatherKeys, end - start - n));
      }
      cursor[t] = end;
    }
  }
}

// dst row r = scale·q_r in float, zero-padded to d_pad (the split-K schedule's scaled
// queries: both passes of the backward must build them the same way, so the logits they
// recompute are the forward's bit for bit).
template <class T>
HWY_INLINE void ScaledRow(const T* q, size_t d, size_t d_pad, float scale, float* HWY_RESTRICT dst) {
  WidenRows(q, 0, 1, d, dst, d_pad);
  for (size_t c = 0; c < d; ++c) dst[c] *= scale;
}

// The K and V rows of keys[0, n), padded to `padded` (whole vectors of keys) with the
// block's last row again: its scores are overwritten with −inf (RowStages::mask) and its
// weights are never used. Read in place when d and dv are whole vectors (16-bit rows are
// widened inside the loads); otherwise widened into zero-padded float rows first, as the
// split-K schedule's packed path does. Visit(f) calls f(k_rows, v_rows, k_dim, v_dim,
// k_ahead, v_ahead): the Ahead (decode_tiles-inl.h) of the next block's rows, for the
// tiles to prefetch key by key while they compute this block. The rows of a gathered
// block are scattered over K and V, so no hardware prefetcher finds them: measured
// (32/8 heads, d = 128, 2048 keys, topk 2048) the block's arithmetic waits on them
// otherwise. (The packed path widens its rows itself and prefetches nothing.)
template <class T>
class GatheredBlock {
 public:
  GatheredBlock(size_t d, size_t dv)
      : d_(d),
        dv_(dv),
        d_pad_(round_up(d, VectorLanes())),
        dv_pad_(round_up(dv, VectorLanes())),
        in_place_(d_pad_ == d && dv_pad_ == dv),
        k_pack_(AllocateFloats(in_place_ ? 0 : kGatherKeys * d_pad_)),
        v_pack_(AllocateFloats(in_place_ ? 0 : kGatherKeys * dv_pad_)),
        k_in_(kGatherKeys),
        v_in_(kGatherKeys),
        k_packed_(kGatherKeys),
        v_packed_(kGatherKeys),
        k_next_(kGatherKeys),
        v_next_(kGatherKeys) {}

  size_t d_pad() const { return d_pad_; }
  size_t dv_pad() const { return dv_pad_; }

  // k_row(j) / v_row(j): the stored rows of keys[j], j < n.
  template <class KeyRow, class ValueRow>
  void Gather(size_t n, size_t padded, const KeyRow& k_row, const ValueRow& v_row) {
    for (size_t j = 0; j < padded; ++j) {
      const size_t from = std::min(j, n - 1);
      if (in_place_) {
        k_in_[j] = k_row(from);
        v_in_[j] = v_row(from);
        continue;
      }
      if (j < n) {
        WidenRows(k_row(j), 0, 1, d_, k_pack_.get() + j * d_pad_, d_pad_);
        WidenRows(v_row(j), 0, 1, dv_, v_pack_.get() + j * dv_pad_, dv_pad_);
      }
      k_packed_[j] = k_pack_.get() + from * d_pad_;
      v_packed_[j] = v_pack_.get() + from * dv_pad_;
    }
  }

  // The next block's rows, keys[0, n) (n = 0: there is none).
  template <class KeyRow, class ValueRow>
  void GatherNext(size_t n, const KeyRow& k_row, const ValueRow& v_row) {
    next_count_ = in_place_ ? n : 0;
    for (size_t j = 0; j < next_count_; ++j) {
      k_next_[j] = k_row(j);
      v_next_[j] = v_row(j);
    }
  }

  template <class F>
  void Visit(F&& f) const {
    if (in_place_) {
      f(k_in_.data(), v_in_.data(), d_, dv_, Ahead<T>{k_next_.data(), next_count_, d_ * sizeof(T)},
        Ahead<T>{v_next_.data(), next_count_, dv_ * sizeof(T)});
    } else {
      f(k_packed_.data(), v_packed_.data(), d_pad_, dv_pad_, Ahead<float>{}, Ahead<float>{});
    }
  }

 private:
  size_t d_, dv_, d_pad_, dv_pad_;
  bool in_place_;
  hwy::AlignedFreeUniquePtr<float[]> k_pack_, v_pack_;
  std::vector<const T*> k_in_, v_in_;
  std::vector<const float*> k_packed_, v_packed_;
  std::vector<const T*> k_next_, v_next_;
  size_t next_count_ = 0;
};

// A range copy's rows of keys[0, n) (k row `at` at k + at·k_ld, v likewise, `at` = key −
// begin), padded to `padded` with the last (its scores are masked, its weights unused).
template <class E>
HWY_INLINE void PointRows(const int32_t* HWY_RESTRICT keys, size_t n, size_t padded, int64_t begin, const E* k,
                          size_t k_ld, const E* v, size_t v_ld, const E** HWY_RESTRICT k_ptr,
                          const E** HWY_RESTRICT v_ptr) {
  for (size_t j = 0; j < n; ++j) {  // (the padding apart: this loop vectorizes)
    const auto at = static_cast<size_t>(keys[j] - begin);
    k_ptr[j] = k + at * k_ld;
    v_ptr[j] = v + at * v_ld;
  }
  for (size_t j = n; j < padded; ++j) {
    k_ptr[j] = k_ptr[n - 1];
    v_ptr[j] = v_ptr[n - 1];
  }
}

// The float step (the forward's and both backward passes'): a key range's K and V rows of
// one kv head copied — widened, for 16-bit storage — to float once (kRangeKeys × d_pad,
// × dv_pad, zero-padded) for every row of the tile that lists them, instead of each row
// loading them from the stored rows — the same floats, so the same bits. Widen(begin, end,
// ...) fills it (SweepTile's on_range, or a pass's key block); Point(keys, n, padded)
// points a block's rows there (padded with its last row, as GatheredBlock::Gather does);
// Visit(f) then calls f as GatheredBlock::Visit does, on float rows (nothing to prefetch:
// in L2). Float storage gains too: one head's stored rows are Hkv·d floats apart (4 KiB at
// 8 kv heads of 128, layout bshd), so a range's rows share few L1 and L2 sets and evict
// each other, where the copy's rows are consecutive. Measured (GQA 32/8 d 128, causal
// top-2048 lists, N 4096, 1 thread, Emerald Rapids): forward 2.11–2.14 → 1.31 s with bshd
// rows, 1.56 → 1.21 s with each head's rows consecutive (bhsd). Inactive (a bf16 unit's
// rows) it allocates nothing.
class WidenedRange {
 public:
  static constexpr int64_t kCopyAhead = 8;  // keys ahead whose rows the copy prefetches

  // range_keys: the most keys a range holds (kRangeKeys, or the forward's ForwardRangeKeys).
  WidenedRange(bool active, size_t d, size_t dv, int64_t range_keys = kRangeKeys)
      : active_(active),
        d_(d),
        dv_(dv),
        d_pad_(round_up(d, VectorLanes())),
        dv_pad_(round_up(dv, VectorLanes())),
        k_(AllocateFloats(active ? static_cast<size_t>(range_keys) * d_pad_ : 0)),
        v_(AllocateFloats(active ? static_cast<size_t>(range_keys) * dv_pad_ : 0)),
        k_ptr_(active ? kGatherKeys : 0),
        v_ptr_(active ? kGatherKeys : 0) {}

  bool active() const { return active_; }
  size_t d_pad() const { return d_pad_; }
  size_t dv_pad() const { return dv_pad_; }

  // Keys [begin, end), end − begin ≤ range_keys; k_row(j) / v_row(j) the stored rows of key j.
  // Latent attention's values are its keys' first dv channels (v a view of k, as
  // DeepSeek's MLA cache is read): then only the keys are copied and the values read from
  // their rows — the same floats, half the copy and of the range's L2 footprint (MLA: 2.3
  // of 4.4 KiB a key). (dv a whole number of vectors: the copy's padding is never read.)
  template <class KeyRow, class ValueRow>
  void Widen(int64_t begin, int64_t end, const KeyRow& k_row, const ValueRow& v_row) {
    begin_ = begin;
    values_in_keys_ = dv_ <= d_ && dv_pad_ == dv_;
    for (int64_t j = begin; j < end && values_in_keys_; ++j) values_in_keys_ = v_row(j) == k_row(j);
    for (int64_t j = begin; j < end; ++j) {
      const auto at = static_cast<size_t>(j - begin);
      if (j + kCopyAhead < end) {
        PrefetchRow(k_row(j + kCopyAhead), d_ * sizeof(*k_row(j)));
        if (!values_in_keys_) PrefetchRow(v_row(j + kCopyAhead), dv_ * sizeof(*v_row(j)));
      }
      WidenRows(k_row(j), 0, 1, d_, k_.get() + at * d_pad_, d_pad_);
      if (!values_in_keys_) WidenRows(v_row(j), 0, 1, dv_, v_.get() + at * dv_pad_, dv_pad_);
    }
  }

  // keys[0, n) of the widened range, padded to `padded` with the last.
  void Point(const int32_t* keys, size_t n, size_t padded) {
    PointRows(keys, n, padded, begin_, k_.get(), d_pad_, values_in_keys_ ? k_.get() : v_.get(),
              values_in_keys_ ? d_pad_ : dv_pad_, k_ptr_.data(), v_ptr_.data());
  }

  template <class F>
  void Visit(F&& f) const {
    f(k_ptr_.data(), v_ptr_.data(), d_pad_, dv_pad_, Ahead<float>{}, Ahead<float>{});
  }

 private:
  bool active_;
  size_t d_, dv_, d_pad_, dv_pad_;
  hwy::AlignedFreeUniquePtr<float[]> k_, v_;
  int64_t begin_ = 0;
  bool values_in_keys_ = false;  // the range's values are its keys' first dv channels
  std::vector<const float*> k_ptr_, v_ptr_;
};

// A stored row of n values copied as it is, by a vector loop: rows of a few hundred bytes,
// for which a memmove call per row (std::copy_n) cost ~11% of the pair step's kernel
// samples at N 32768 (GQA 32/8 d 128, bf16).
template <class T>
HWY_INLINE void CopyRow(const T* HWY_RESTRICT src, size_t n, T* HWY_RESTRICT dst) {
  const hn::ScalableTag<uint8_t> du8;
  const size_t lanes = hn::Lanes(du8), bytes = n * sizeof(T);
  const auto* in = reinterpret_cast<const uint8_t*>(src);
  auto* out = reinterpret_cast<uint8_t*>(dst);
  size_t c = 0;
  for (; c + lanes <= bytes; c += lanes) hn::StoreU(hn::LoadU(du8, in + c), du8, out + c);
  if (c < bytes) std::memcpy(out + c, in + c, bytes - c);
}

// The pair step's range (sparse_forward.cpp, bf16_group_block.hpp): a key range's K and V
// rows of one kv head copied as stored (bfloat16, each row d or dv consecutive values)
// once for every row of the tile, as WidenedRange copies them to float for the float
// step, for the same reason: one head's stored rows are Hkv·d values apart (2 KiB at 8 kv
// heads of 128), so the range's rows would share few L1 and L2 sets. Values that are the
// keys' first channels (v a view of k) are read from the keys' copy.
template <class T>
class StoredRange {
 public:
  StoredRange(bool active, size_t d, size_t dv, int64_t range_keys)
      : active_(active),
        d_(d),
        dv_(dv),
        k_(active ? static_cast<size_t>(range_keys) * d : 0),
        v_(active ? static_cast<size_t>(range_keys) * dv : 0),
        k_ptr_(active ? kGatherKeys : 0),
        v_ptr_(active ? kGatherKeys : 0) {}

  bool active() const { return active_; }

  // Keys [begin, end); k_row(j) / v_row(j) the stored rows of key j.
  template <class KeyRow, class ValueRow>
  void Copy(int64_t begin, int64_t end, const KeyRow& k_row, const ValueRow& v_row) {
    begin_ = begin;
    values_in_keys_ = dv_ <= d_;
    for (int64_t j = begin; j < end && values_in_keys_; ++j) values_in_keys_ = v_row(j) == k_row(j);
    for (int64_t j = begin; j < end; ++j) {
      const auto at = static_cast<size_t>(j - begin);
      if (j + WidenedRange::kCopyAhead < end) {
        PrefetchRow(k_row(j + WidenedRange::kCopyAhead), d_ * sizeof(T));
        if (!values_in_keys_) PrefetchRow(v_row(j + WidenedRange::kCopyAhead), dv_ * sizeof(T));
      }
      CopyRow(k_row(j), d_, k_.data() + at * d_);
      if (!values_in_keys_) CopyRow(v_row(j), dv_, v_.data() + at * dv_);
    }
  }

  // keys[0, n) of the copied range, padded to `padded` with the last.
  void Point(const int32_t* keys, size_t n, size_t padded) {
    PointRows(keys, n, padded, begin_, k_.data(), d_, values_in_keys_ ? k_.data() : v_.data(),
              values_in_keys_ ? d_ : dv_, k_ptr_.data(), v_ptr_.data());
  }

  const T* const* k_rows() const { return k_ptr_.data(); }
  const T* const* v_rows() const { return v_ptr_.data(); }

 private:
  bool active_;
  size_t d_, dv_;
  std::vector<T> k_, v_;
  int64_t begin_ = 0;
  bool values_in_keys_ = false;
  std::vector<const T*> k_ptr_, v_ptr_;
};

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
