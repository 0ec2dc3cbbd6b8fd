// The split-K decode's memory side (decode.cpp): per-thread scratch laid out once per
// call, the row pointers (and scales) of a unit of work read in place from the cache,
// the cache lines of the next unit's scales to prefetch, and the scores of keys scaled
// per channel. Included by decode.cpp only, so that its -ffp-contract=off
// (src/CMakeLists.txt) applies to this code too.
#if defined(QKV_CPU_DECODE_ROWS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_DECODE_ROWS_INL_H_
#undef QKV_CPU_DECODE_ROWS_INL_H_
#else
#define QKV_CPU_DECODE_ROWS_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "core/kv_source.hpp"
#include "cpu/amx_rows.hpp"
#include "cpu/bf16_dot.hpp"
#include "cpu/block_ops-inl.h"
#include "cpu/blocking.hpp"
#include "cpu/decode_plan.hpp"
#include "cpu/decode_tiles-inl.h"
#include "cpu/int8_dot.hpp"
#include "cpu/scratch_cache.hpp"
#include "cpu/storage-inl.h"
#include "qkv/half.hpp"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {

using detail::KvSource;
using detail::ScalePtr;

// ---------------------------------------------------------------------------------
// How many units of (block, kv head) ahead of the computing one the prefetches run.
// Measured (32/8, d = 128, 32768 keys, 1 thread, CPU time): one unit ahead leaves
// [keys, heads, d] and paged caches 20–30% behind two (each row of a head sits in its own
// 4 KiB page there, so a unit's misses take longer than one unit's arithmetic); 3 and 4
// are no faster than 2; PyTorch's head-major buffer gains ~3%.
constexpr size_t kUnitsAhead = 2;

// Storage whose rows carry a scale (value = element · scale): int8, float8 (its per-tensor
// or per-head scale is read as every row's), and int4's keys.
template <class T>
inline constexpr bool kScaledStorage = std::is_same_v<T, std::int8_t> || std::is_same_v<T, uint4x2> || kIsFloat8<T>;

// AllocateFloats, zero-filled.
inline hwy::AlignedFreeUniquePtr<float[]> AllocateZeroedFloats(size_t count) {
  hwy::AlignedFreeUniquePtr<float[]> memory = AllocateFloats(count);
  std::fill(memory.get(), memory.get() + count, 0.0f);
  return memory;
}

// Values scaled per row (int8, float8); int4 values carry a scale and zero point per
// group of channels instead.
template <class T>
inline constexpr bool kRowScaledValues = std::is_same_v<T, std::int8_t> || kIsFloat8<T>;
template <class T>
inline constexpr bool kGroupedValues = std::is_same_v<T, uint4x2>;

// Whether a block of `rows` query rows has its values widened into scratch once instead
// of read in place by every row tile (decode.cpp's BlockStep): float and 16-bit storage
// with many rows (MLA's stacked heads, GQA groups of several queries), where the tiles
// would otherwise widen each value vector again and, at power-of-two row strides, miss
// L1 on it (MLA's latent decode, 128 heads, fp32 cache of 4096 keys, 1 thread on a Zen 2
// EPYC: 22.1 ms in place, 19.6 ms with the keys and values widened per block).
inline constexpr size_t kPackValueRows = 24;
template <class T>
constexpr bool PackValuesFor(size_t rows) {
  return (std::is_same_v<T, float> || std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>) &&
         rows >= kPackValueRows;
}

// Per-thread scratch, laid out once per call (sizes in floats / rows).
// Scratch of the latent step on vdpbf16ps (decode_latent-inl.h's LatentBlock; the
// split-K schedule's and sparse attention's): the tile's query rows rounded to bfloat16
// once and paired ([⌈d/2⌉][q_ld] words), a block's keys gathered into whole bf16 rows (d
// apart) and values (dv apart, when not the keys' own first channels), its transposed
// scores then weights ([block][st_ld]), and the pairs of its values and weights.
struct LatentScratch {
  LatentScratch() : st(AllocateFloats(0)), widened(AllocateFloats(0)), span_scores(AllocateFloats(0)) {}
  // on_spans: the row-layout step on the tiles (decode_latent-inl.h's LatentSpan) for
  // blocks of up to amx::kSpanKeys keys, which needs none of the column step's buffers
  // but the query rows.
  LatentScratch(size_t tile_rows, size_t group_rows, size_t block_keys, size_t head_dim, size_t v_dim,
                bool on_tiles = false, bool on_spans = false)
      : amx(on_tiles),
        spans(on_spans),
        q_ld(bf16dot::pair_ld(tile_rows)),
        st_ld(bf16dot::pair_ld(group_rows)),
        q_rows(tile_rows * head_dim),
        keys(on_spans ? 0 : block_keys * head_dim),
        values(on_spans ? 0 : block_keys * v_dim),
        q_pairs(on_spans ? 0 : (head_dim + 1) / 2 * q_ld),
        v_pairs(on_spans ? 0 : (block_keys + 1) / 2 * bf16dot::pair_ld(v_dim)),
        p_pairs(on_spans ? 0 : (block_keys + 1) / 2 * st_ld),
        st(AllocateFloats(on_spans ? 0 : block_keys * st_ld)),
        widened(AllocateFloats(std::max(head_dim, v_dim))),
        span_queries(on_spans ? (tile_rows + amx::kMaxQueries - 1) / amx::kMaxQueries * amx::kMaxQueries *
                                    amx::query_ld(head_dim) / 2
                              : 0),
        span_rows(on_spans ? amx::kKeyBlock * round_up(std::max(head_dim, v_dim), 2) / 2 : 0),
        span_keys(on_spans ? (block_keys + amx::kKeyBlock - 1) / amx::kKeyBlock * amx::key_block_words(head_dim) : 0),
        span_values(on_spans ? round_up(block_keys, 32) / 2 * bf16dot::pair_ld(v_dim) : 0),
        span_weights(on_spans ? amx::kMaxQueries * amx::kSpanKeys / 2 : 0),
        span_scores(AllocateFloats(on_spans ? amx::kMaxQueries * kSpanScoreLd : 0)),
        span_lo(on_spans ? amx::kMaxQueries : 0),
        span_hi(on_spans ? amx::kMaxQueries : 0) {}

  static constexpr size_t kSpanScoreLd = amx::kSpanKeys + 16;  // not a multiple of 4 KiB: no set aliasing

  bool amx = false;  // the block's two products on the AMX tiles (amx_dot.hpp), else vdpbf16ps
  bool spans = false;  // blocks every row sees whole or in part: LatentSpan
  size_t q_ld = 0, st_ld = 0;
  std::vector<bfloat16> q_rows, keys, values;
  std::vector<std::uint32_t> q_pairs, v_pairs, p_pairs;
  hwy::AlignedFreeUniquePtr<float[]> st;
  hwy::AlignedFreeUniquePtr<float[]> widened;  // one float8 row widened (LatentRow)
  // LatentSpan's: the query rows packed for the tiles (amx::PackQueryRows, 64-row groups
  // query_ld(d) values a row), a 64-key part's rows gathered when the cache's are not
  // equally spaced, the span's keys in the tiles' order and its values' pairs, S and bf16(P)
  // of one row group, and each row's visible keys.
  ScratchWords span_queries, span_rows, span_keys, span_values, span_weights;
  hwy::AlignedFreeUniquePtr<float[]> span_scores;
  std::vector<std::int32_t> span_lo, span_hi;
};

template <class T>
struct DecodeScratch {
  hwy::AlignedFreeUniquePtr<float[]> queries;  // Hq·tile rows × d_pad: scale·q, zero-padded
  hwy::AlignedFreeUniquePtr<float[]> keys;     // block × d_pad: widened K rows (packed plans, split keys)
  hwy::AlignedFreeUniquePtr<float[]> values;   // block × v_ld: widened V rows (packed plans, PackValuesFor)
  hwy::AlignedFreeUniquePtr<float[]> scores;   // group rows × block: S, then P
  hwy::AlignedFreeUniquePtr<float[]> alpha;    // group rows: e^(m_old − m_new)
  hwy::AlignedFreeUniquePtr<float[]> merged;   // dv_pad: one row's sum over chunks
  // Row pointers of K and V of the current unit and the kUnitsAhead after it (a ring
  // of kUnitsAhead + 1 slots of block_keys rows each).
  std::vector<const T*> k_ring, v_ring;
  // int8 caches: the rows' scales, in the ring's layout.
  hwy::AlignedFreeUniquePtr<float[]> k_scales, v_scales;
  std::vector<const float*> k_packed, v_packed;  // rows of `keys` / `values`
  // Keys scaled per channel: one vector of keys' scores when the vector's keys span two
  // groups.
  hwy::AlignedFreeUniquePtr<float[]> split_scores;
  // int4 values: the ring rows' group scales then zero points as float, [2·groups]
  // [block_keys] a ring slot (group g's scales of the slot's keys contiguous, as the
  // cache stores them; zero past the keys), and the block's weights P_rj·s_jg [row]
  // [group][block_keys] and biases Σ_j P_rj·z_jg [row][group] (GroupedWeights).
  hwy::AlignedFreeUniquePtr<float[]> group_scales, group_weights, group_bias;
  // Keys scaled per channel: one group's d scales then d zero points, widened from float16
  // (d_pad apart), then d_pad zeros, the zero points of a cache that stores none.
  hwy::AlignedFreeUniquePtr<float[]> channel_floats;
  // A float window: the block's rows in it.
  std::vector<const float*> window_k, window_v;
  // Keys in two parts (KvSource::split_keys, latent attention): the second parts' row
  // pointers in the ring's layout.
  std::vector<const T*> rope_ring;
  // Row stride of `values`: dv_pad plus a vector, so that the widened rows of a block are
  // not a power of two apart (512 floats: every row's slice of a column panel in the same
  // two L1 sets, evicted between the row tiles that reuse it).
  size_t v_ld;
  // The unit after the ring's farthest: its scales' cache lines (ScaleLines).
  std::vector<const char*> scale_lines;
  // int8 caches on VNNI (int8_dot.hpp): the tile's query rows as two int8 terms each,
  // their scales and biases; a block's weights as bytes and its values interleaved.
  bool vnni;
  size_t query_ld;
  std::vector<std::int8_t> query_terms;
  std::vector<float> query_scales;
  std::vector<std::int32_t> query_biases;
  std::vector<std::uint8_t> weight_bytes;
  std::vector<std::int8_t> value_bytes;
  // Latent attention over a bfloat16 cache on vdpbf16ps (decode_latent-inl.h).
  bool latent;
  LatentScratch lat;

  int8dot::Queries quantized_queries() {
    return {query_terms.data(), query_scales.data(), query_biases.data(), query_ld};
  }

  DecodeScratch(const DecodePlan& plan, const KvSource& kv, bool int8_dots, size_t head_dim, size_t v_dim,
                bool latent_dots = false, bool latent_on_tiles = false, bool latent_spans = false)
      : queries(AllocateFloats(plan.tile_rows() * plan.d_pad)),
        keys(AllocateFloats(plan.packed || kv.split_keys() ? plan.block_keys * plan.d_pad : 0)),
        values(AllocateFloats(plan.packed || PackValuesFor<T>(plan.group_rows()) ? plan.block_keys * (plan.dv_pad + plan.lanes)
                                                                                  : 0)),
        scores(AllocateFloats(plan.group_rows() * plan.block_keys)),
        alpha(AllocateFloats(plan.group_rows())),
        merged(AllocateFloats(plan.dv_pad)),
        k_ring((kUnitsAhead + 1) * plan.block_keys), v_ring((kUnitsAhead + 1) * plan.block_keys),
        k_scales(AllocateFloats(kScaledStorage<T> ? (kUnitsAhead + 1) * plan.block_keys : 0)),
        v_scales(AllocateFloats(kScaledStorage<T> ? (kUnitsAhead + 1) * plan.block_keys : 0)),
        k_packed(plan.packed || kv.split_keys() ? plan.block_keys : 0),
        v_packed(plan.packed || PackValuesFor<T>(plan.group_rows()) ? plan.block_keys : 0),
        split_scores(AllocateFloats(kScaledStorage<T> ? plan.group_rows() * VectorLanes() : 0)),
        group_scales(AllocateFloats(kGroupedValues<T> ? (kUnitsAhead + 1) * 2 * static_cast<size_t>(kv.value_groups()) *
                                                           plan.block_keys
                                                     : 0)),
        group_weights(AllocateFloats(kGroupedValues<T> ? plan.group_rows() * static_cast<size_t>(kv.value_groups()) *
                                                              plan.block_keys
                                                        : 0)),
        group_bias(AllocateFloats(kGroupedValues<T> ? plan.group_rows() * static_cast<size_t>(kv.value_groups()) : 0)),
        channel_floats(AllocateZeroedFloats(kv.channel_scaled() ? 3 * plan.d_pad : 0)),
        window_k(kv.windowed() ? plan.block_keys : 0), window_v(kv.windowed() ? plan.block_keys : 0),
        rope_ring(kv.split_keys() ? (kUnitsAhead + 1) * plan.block_keys : 0),
        v_ld(plan.dv_pad + plan.lanes),
        vnni(int8_dots),
        query_ld(int8dot::query_ld(head_dim)),
        query_terms(vnni ? plan.tile_rows() * 2 * query_ld : 0),
        query_scales(vnni ? plan.tile_rows() : 0),
        query_biases(vnni ? 2 * plan.tile_rows() : 0),
        weight_bytes(vnni ? int8dot::weight_bytes(plan.group_rows(), plan.block_keys) : 0),
        value_bytes(vnni ? int8dot::value_bytes(plan.block_keys, v_dim) : 0),
        latent(latent_dots),
        lat(latent ? LatentScratch(plan.tile_rows(), plan.group_rows(), plan.block_keys, head_dim, v_dim,
                                   latent_on_tiles, latent_spans)
                   : LatentScratch()) {}
};

// Entries [keys, padded) of a block's row pointers (and scales) repeat entry keys − 1.
template <class T>
void PadRows(size_t keys, size_t padded, const T** k, const T** v, float* k_scale, float* v_scale) {
  for (size_t j = keys; j < padded; ++j) {
    k[j] = k[keys - 1];
    v[j] = v[keys - 1];
    if constexpr (kScaledStorage<T>) k_scale[j] = k_scale[keys - 1];
    if constexpr (kRowScaledValues<T>) v_scale[j] = v_scale[keys - 1];
  }
}

// Row pointers of K and V for keys [first, first + keys) of (batch, head), in place in
// the cache (contiguous or paged), padded to `padded` entries with the last row, whose
// scores the mask then removes (so a partial vector of keys never reads past the cache).
// Scaled storage: the rows' scales too (int4: the keys' row scales, and each value row's
// group scales and zero points as float into groups, [2·groups][t_ld], zero past `keys`).
// Keys in two parts (kv.split_keys()): their second parts' rows into `rope`.
template <class T>
void RowPointers(const KvSource& kv, int64_t batch, int64_t head, int64_t first, size_t keys,
                 size_t padded, const T** k, const T** v, float* k_scale, float* v_scale, float* groups, size_t t_ld,
                 const T** rope) {
  const T* k_base = static_cast<const T*>(kv.k);
  const T* v_base = static_cast<const T*>(kv.v);
  size_t j = 0;
  while (j < keys) {  // one run of evenly strided rows (a page, or everything) at a time
    const int64_t key = first + static_cast<int64_t>(j);
    const size_t run = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(keys - j), kv.run_end(key) - key));
    const T* k_row = k_base + kv.offset(kv.k_strides, batch, key, head);
    const T* v_row = v_base + kv.offset(kv.v_strides, batch, key, head);
    for (size_t r = 0; r < run; ++r) {
      k[j + r] = k_row + static_cast<int64_t>(r) * kv.k_strides.row;
      v[j + r] = v_row + static_cast<int64_t>(r) * kv.v_strides.row;
    }
    if (kv.split_keys()) {
      const T* rope_row = static_cast<const T*>(kv.k_rope) + kv.offset(kv.k_rope_strides, batch, key, head);
      for (size_t r = 0; r < run; ++r) rope[j + r] = rope_row + static_cast<int64_t>(r) * kv.k_rope_strides.row;
    }
    if constexpr (kScaledStorage<T>) {
      const ScalePtr ks = kv.k_scale + kv.offset(kv.k_scale_strides, batch, key, head);
      if (ks.half && kv.k_scale_strides.row == 1) {  // a run of float16 flags: one widening pass
        WidenRows(ks.halves(), 0, 1, run, k_scale + j, run);
      } else {
        for (size_t r = 0; r < run; ++r) k_scale[j + r] = ks[static_cast<int64_t>(r) * kv.k_scale_strides.row];
      }
    }
    if constexpr (kRowScaledValues<T>) {
      const ScalePtr vs = kv.v_scale + kv.offset(kv.v_scale_strides, batch, key, head);
      for (size_t r = 0; r < run; ++r) v_scale[j + r] = vs[static_cast<int64_t>(r) * kv.v_scale_strides.row];
    }
    if constexpr (kGroupedValues<T>) {  // each of the run's 2·groups rows of scales in one pass
      const ScalePtr vg = kv.value_group_scales(batch, key, head);
      for (int64_t m = 0; m < 2 * kv.value_groups(); ++m) {
        const ScalePtr from = vg + m * kv.v_group_stride;
        float* to = groups + static_cast<size_t>(m) * t_ld + j;
        if (kv.v_group_strides.row != 1) {
          for (size_t r = 0; r < run; ++r) to[r] = from[static_cast<int64_t>(r) * kv.v_group_strides.row];
        } else if (from.half) {
          WidenRows(from.halves(), 0, 1, run, to, run);
        } else {
          std::copy(from.floats(), from.floats() + run, to);
        }
      }
    }
    j += run;
  }
  if constexpr (kGroupedValues<T>) {  // zeros past the keys: their weights and biases are 0
    for (size_t m = 0; m < 2 * static_cast<size_t>(kv.value_groups()); ++m)
      std::fill(groups + m * t_ld + keys, groups + m * t_ld + padded, 0.0f);
  }
  PadRows<T>(keys, padded, k, v, k_scale, v_scale);
  if (kv.split_keys()) std::fill(rope + keys, rope + padded, rope[keys - 1]);
}

// The cache lines of the scales and zero points that keys [first, first + keys) of head
// `head` read (quantized storage; none for the others): their row scales or flags, value
// group scales, and the channel scales and zero points of their key groups. The rows
// themselves are prefetched a unit ahead (Ahead); without these their scales missed in
// RowPointers and in the channel-scaled scores, ~30% of an int4 decode's time (measured
// with perf on the Zen 5 of bench/RESULTS.md §12, 12/12 heads, d 128, 32k keys).
template <class T>
void ScaleLines(const KvSource& kv, int64_t batch, int64_t head, int64_t first, size_t keys,
                std::vector<const char*>& lines) {
  lines.clear();
  if constexpr (kScaledStorage<T>) {
    const char* last = nullptr;
    const auto add = [&](ScalePtr at, int64_t count) {  // count elements from `at`, contiguous
      const auto* p = static_cast<const char*>(at.data);
      const int64_t bytes = count * (at.half ? 2 : 4);
      for (int64_t b = 0; b < bytes; b += 64) {
        const char* line = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p + b) & ~uintptr_t{63});
        if (line != last) lines.push_back(last = line);
      }
      const char* end = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p + bytes - 1) & ~uintptr_t{63});
      if (bytes > 0 && end != last) lines.push_back(last = end);
    };
    // Per-row scales laid out [.., keys, heads] (int8's) are skipped: each line holds
    // several heads' scales, which the first head's unit brings in for the others, and a
    // line per key costs more to issue than it saves (measured: int8 rows 20% slower).
    const auto rows = [&](ScalePtr base, int64_t stride, int64_t run, int64_t width) {
      if (stride == width) add(base, run * width);
    };
    size_t j = 0;
    while (j < keys) {
      const int64_t key = first + static_cast<int64_t>(j);
      const auto run = std::min<int64_t>(static_cast<int64_t>(keys - j), kv.run_end(key) - key);
      rows(kv.k_scale + kv.offset(kv.k_scale_strides, batch, key, head), kv.k_scale_strides.row, run, 1);
      if constexpr (kRowScaledValues<T>)
        rows(kv.v_scale + kv.offset(kv.v_scale_strides, batch, key, head), kv.v_scale_strides.row, run, 1);
      if constexpr (kGroupedValues<T>)
        for (int64_t m = 0; m < 2 * kv.value_groups(); ++m)
          rows(kv.value_group_scales(batch, key, head) + m * kv.v_group_stride, kv.v_group_strides.row, run, 1);
      if (kv.channel_scaled())
        for (int64_t g = key / kv.key_group; g * kv.key_group < key + run; ++g) {
          const int64_t at = std::max(g * kv.key_group, key);
          add(kv.channel_scales(batch, at, head), kv.head_dim);
          if (!(kv.k_channel_zero == nullptr)) add(kv.channel_zeros(batch, at, head), kv.head_dim);
        }
      j += static_cast<size_t>(run);
    }
  }
}

// n scales in place as floats: float32 ones as they are, float16 ones widened into `to`
// (null stays null).
HWY_INLINE const float* AsFloats(ScalePtr scales, size_t n, float* to) {
  if (!scales.half) return scales.floats();
  WidenRows(scales.halves(), 0, 1, n, to, n);
  return to;
}

// Scores of `rows` query rows (scale·q, d_pad apart) against int8/int4 keys scaled per
// channel (qkv::KVCache's KeyScales::channel) read in place: key j of group γ holds
// level_j ⊙ c_γ + z_γ (channel-wise scales and zero points; its row scale, 1 or NaN, is
// applied after, as for every scaled row). The tile kernel maps each loaded key vector
// through (c_γ, z_γ) with one rounding (decode_tiles-inl.h's KeyAffine) before its dot
// products, so the scores are those of the stored keys within float32's dot-product error.
// A vector of keys that spans two groups (a group that is not whole vectors, or a block
// that does not start on one) is scored once per group, each lane taken from its own
// group's pass.
template <class T>
void ChannelScaledScores(const KvSource& kv, const DecodePlan& plan, int64_t batch, int64_t head, int64_t first,
                         size_t keys, size_t rows, const float* queries, const T* const* k_rows, size_t d,
                         Ahead<T> ahead, float* scores, size_t ld, DecodeScratch<T>& s) {
  const size_t lanes = VectorLanes(), d_pad = plan.d_pad;
  const int64_t group = kv.key_group;
  KeyAffine affine;
  int64_t affine_group = -1;  // the group whose scales and zero points `affine` points at
  const auto use_group = [&](int64_t g) {
    if (g == affine_group) return;
    affine_group = g;
    affine.scale = AsFloats(kv.channel_scales(batch, g * group, head), d, s.channel_floats.get());
    // No zero points: the scratch's zeros past the scales (DecodeScratch sizes it so).
    const ScalePtr zero = kv.channel_zeros(batch, g * group, head);
    affine.zero = zero == nullptr ? s.channel_floats.get() + 2 * d_pad
                                  : AsFloats(zero, d, s.channel_floats.get() + d_pad);
  };
  const size_t padded = round_up(keys, lanes);
  // The group of the vector's first key, and where the next one starts: followed key by
  // key (an integer division per vector costs as much as its dot products).
  int64_t key_group = first / group, next_group = (key_group + 1) * group;
  for (size_t j = 0; j < padded; j += lanes) {
    const int64_t key = first + static_cast<int64_t>(j);
    const int64_t last = first + static_cast<int64_t>(std::min(j + lanes, keys)) - 1;  // the vector's last key
    const Ahead<T> prefetch = ahead.offset(j);
    while (key >= next_group) {
      ++key_group;
      next_group += group;
    }
    if (last < next_group) {
      use_group(key_group);
      ScoreKeys<true>(rows, queries, d_pad, k_rows + j, d, prefetch, scores + j, ld, affine);
      continue;
    }
    for (int64_t g = key_group; g <= last / group; ++g) {
      use_group(g);
      ScoreKeys<true>(rows, queries, d_pad, k_rows + j, d, g == key_group ? prefetch : Ahead<T>{},
                      s.split_scores.get(), lanes, affine);
      const auto from = static_cast<size_t>(std::max<int64_t>(g * group - key, 0));
      const auto to = static_cast<size_t>(std::min<int64_t>((g + 1) * group - key, static_cast<int64_t>(lanes)));
      for (size_t r = 0; r < rows; ++r)
        std::copy(s.split_scores.get() + r * lanes + from, s.split_scores.get() + r * lanes + to,
                  scores + r * ld + j + from);
    }
  }
}

// int4 values' weights (GroupedWeights): w[r·row_ld + g·keys_ld + j] = P_rj·s_jg and
// bias[r·groups + g] = Σ_j P_rj·z_jg for keys j < padded, from the block's group scales
// as RowPointers lays them out (group g's scales at scales[g·t_ld + j], its zero points
// at scales[(groups + g)·t_ld + j]; P and both are 0 past the block's keys). A NaN scale
// of a visible key reaches its rows through both, as through a dequantized value.
HWY_INLINE void GroupWeights(size_t rows, const float* HWY_RESTRICT p, size_t p_ld, size_t padded,
                             const float* HWY_RESTRICT scales, size_t t_ld, size_t groups, float* HWY_RESTRICT w,
                             size_t row_ld, size_t keys_ld, float* HWY_RESTRICT bias) {
  const FloatTag df;
  const size_t lanes = hn::Lanes(df);
  for (size_t r = 0; r < rows; ++r)
    for (size_t g = 0; g < groups; ++g) {
      const float* scale = scales + g * t_ld;
      const float* zero = scales + (groups + g) * t_ld;
      float* to = w + r * row_ld + g * keys_ld;
      FloatVec sum = hn::Zero(df);
      for (size_t j = 0; j < padded; j += lanes) {
        const FloatVec pv = hn::LoadU(df, p + r * p_ld + j);
        hn::StoreU(hn::Mul(pv, hn::LoadU(df, scale + j)), df, to + j);
        sum = hn::MulAdd(pv, hn::LoadU(df, zero + j), sum);
      }
      bias[r * groups + g] = hn::GetLane(hn::SumOfLanes(df, sum));
    }
}

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // QKV_CPU_DECODE_ROWS_INL_H_
