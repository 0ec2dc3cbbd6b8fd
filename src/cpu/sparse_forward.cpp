// Sparse attention forward on the cpu backend.
//
// A unit of work is (batch entry b, a tile of consecutive query rows, kv head
// g). Each row's G = Hq/Hkv query heads share one attended set A (in the [B, Nq, topk]
// mode every kv head's units read the same list, and the set is computed once for all of
// them, a wave of tiles at a time: SharedSets) and so one gathered copy of those K/V
// rows: the G heads are the rows of the decode schedule's register tiles
// (decode_tiles-inl.h), or of the bf16 unit's products (the pair step's on vdpbf16ps:
// sparse_pair_step; latent decode's column step on the AMX tiles: sparse_dot_unit), so each
// gathered K and V vector is loaded once for all G heads. The tile's rows sweep the keys
// together, range by range (ForwardRangeKeys), so that rows listed by several of them are read
// from memory once (ForwardTile). Over blocks of ≤ kGatherKeys attended keys, in key
// order, online softmax per head r:
//   S[r][t] = (scale·q_r)·k_(A_t)  → soft-cap      (the dense score pipeline, RowStages)
//   m' = max(m, max_t S),  alpha = e^(m − m'),  P = e^(S − m'),  l' = l·alpha + Σ_t P,
//   acc' = acc·alpha + P·V_A
// then with a sink logit σ_h (one more softmax entry without a value):
//   m_f = max(m, σ),  l_f = l·e^(m − m_f) + e^(σ − m_f),  out = acc·e^(m − m_f) / l_f,
//   lse = m_f + log l_f
// and without one m_f = m, l_f = l. A row with no attended key and no sink: out 0, lse −inf.
// Each unit writes its own rows of out and lse, computed the same way on any thread: the
// results do not depend on the thread count. Nothing Nq × Nk exists: per thread, one
// tile's sets (tile rows × topk), queries and softmax states (tile rows × G × (d + dv))
// and one score block (G × 64).
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
#include <utility>
#include <vector>

#include "core/score_pipeline.hpp"
#include "cpu/bf16_group_block.hpp"
#include "cpu/dot_products.hpp"
#include "cpu/sparse.hpp"
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {
namespace {

// One query row of a tile (SweepTileRows, sparse_gather-inl.h): its attended set, its softmax
// state (m, l and acc per head of the group) and its queries (the float step's scaled
// rows, the bf16 unit's pairs, or the pair step's stored rows).
template <class T>
struct TileRow {
  std::vector<int32_t> keys;
  const int32_t* set = nullptr;  // the attended set: keys, or the wave's (SharedSets)
  size_t count = 0;
  std::vector<float> m, l;
  hwy::AlignedFreeUniquePtr<float[]> acc, queries;
  std::vector<std::uint32_t> q_pairs;
  std::vector<T> q_rows;  // the pair step: the group's query rows as stored, G × d
};

// One thread's scratch, reused by its units.
template <class T>
struct ForwardScratch {
  ForwardScratch(const detail::Extents& e, const detail::KeySelection& selection, Bf16Unit latent_unit,
                 bool pair_step, size_t tile_rows, int64_t range_keys_of_call)
      : latent(latent_unit != Bf16Unit::fp32_fma),
        pairs(pair_step),
        lat(latent ? LatentScratch(static_cast<size_t>(e.group()), static_cast<size_t>(e.group()), kGatherKeys,
                                   static_cast<size_t>(e.head_dim), static_cast<size_t>(e.v_dim),
                                   latent_unit == Bf16Unit::amx)
                   : LatentScratch()),
        k_rows(latent ? kGatherKeys : 0),
        v_rows(latent ? kGatherKeys : 0),
        k_next(latent ? kGatherKeys : 0),
        marks(selection.marks_for(e.k_len)),
        range_keys(range_keys_of_call),
        range(!latent && !pairs, static_cast<size_t>(e.head_dim), static_cast<size_t>(e.v_dim), range_keys_of_call),
        stored(pairs, static_cast<size_t>(e.head_dim), static_cast<size_t>(e.v_dim), range_keys_of_call),
        value_words(pairs ? bf16dot::group_value_words(static_cast<size_t>(e.group()), kGatherKeys) : 0),
        scores(AllocateFloats(static_cast<size_t>(e.group()) * kGatherKeys)),
        alpha(static_cast<size_t>(e.group())),
        rows(tile_rows),
        group(static_cast<size_t>(e.group())) {
    for (TileRow<T>& row : rows) {
      row.keys.resize(static_cast<size_t>(selection.topk));
      row.m.resize(group);
      row.l.resize(group);
      row.acc = AllocateFloats(group * range.dv_pad());
      row.queries = AllocateFloats(latent || pairs ? 0 : group * range.d_pad());
      row.q_pairs.resize(latent ? lat.q_pairs.size() : 0);
      row.q_rows.resize(pairs ? group * static_cast<size_t>(e.head_dim) : 0);
    }
  }

  bool latent;                   // sparse_dot_unit: the latent step, its scratch and row pointers
  bool pairs;                    // sparse_pair_step: the pair step
  LatentScratch lat;
  std::vector<const T*> k_rows, v_rows, k_next;
  std::vector<uint64_t> marks;   // attended_keys's bit set
  int64_t range_keys;            // the sweep's key range (ForwardRangeKeys; the latent step: one)
  // The float step: each range's K and V rows of the unit's kv head copied (widened) to
  // float once for every row of the tile (ForwardTile's on_range).
  WidenedRange range;
  StoredRange<T> stored;         // the pair step's copy of the range, as stored
  std::vector<std::uint32_t> value_words;  // the pair step's weights in bf16 pairs
  hwy::AlignedFreeUniquePtr<float[]> scores;  // G × 64
  std::vector<float> alpha;      // one block's rescaling per head
  std::vector<TileRow<T>> rows;  // the unit's query rows
  size_t group;                  // query heads per kv head
  bool plain_scores = false;     // no soft-cap, ALiBi or score_mod (SparseForwardImpl sets it)
};

// The attended sets of a wave of tiles, computed once for every kv head where they share
// one list per query ([B, Nq, topk] with Hkv > 1): each kv head's unit computed its rows'
// sets again (GQA 32/8, N 8192: attended_keys 5.6% of the forward, each row's 2048 keys
// marked and read back 8 times). A wave holds a bounded number of tiles, so the sets take
// at most ~64 MiB, not Nq × topk.
struct SharedSets {
  int64_t first_tile = 0;  // the wave's first (batch entry, tile), as b·tiles + tile
  size_t tile_rows = 0, topk = 0;
  std::vector<int32_t> keys;  // per row of the wave: topk entries
  std::vector<size_t> counts;

  const int32_t* row(int64_t bt, size_t t) const {
    return keys.data() + (static_cast<size_t>(bt - first_tile) * tile_rows + t) * topk;
  }
  size_t count(int64_t bt, size_t t) const { return counts[static_cast<size_t>(bt - first_tile) * tile_rows + t]; }
};

// Row i's set (shared: the wave's, computed already), zero state and queries.
template <class T>
void BeginRow(const detail::SparseForwardProblem<T>& problem, int64_t b, int64_t i, int64_t g, ForwardScratch<T>& s,
              TileRow<T>& row, const int32_t* shared = nullptr, size_t shared_count = 0) {
  const auto& dense = problem.dense;
  const detail::Extents& e = dense.extents;
  const auto rows = dense.rows();
  const size_t group = static_cast<size_t>(e.group()), d = static_cast<size_t>(e.head_dim);
  if (shared != nullptr) {
    row.set = shared;
    row.count = shared_count;
  } else {
    row.set = row.keys.data();
    row.count = static_cast<size_t>(
        problem.keys.attended_keys(dense.mask, b, problem.keys.list_of(g), i, row.keys.data(), s.marks));
  }
  std::fill(row.m.begin(), row.m.end(), kMinusInf);
  std::fill(row.l.begin(), row.l.end(), 0.0f);
  std::fill(row.acc.get(), row.acc.get() + group * s.range.dv_pad(), 0.0f);
  if (s.latent) {  // the group's query rows (bf16 already) paired once
    if constexpr (std::is_same_v<T, bfloat16>) {
      for (size_t r = 0; r < group; ++r)
        std::copy_n(rows.q(b, i, g * e.group() + static_cast<int64_t>(r)), d, s.lat.q_rows.data() + r * d);
      bf16dot::PackQueryPairs(s.lat.q_rows.data(), static_cast<std::int64_t>(d), group, d, row.q_pairs.data(),
                              s.lat.q_ld);
    }
    return;
  }
  if (s.pairs) {  // the stored rows: their products are exact, the scale applied to the sums
    for (size_t r = 0; r < group; ++r)
      std::copy_n(rows.q(b, i, g * e.group() + static_cast<int64_t>(r)), d, row.q_rows.data() + r * d);
    return;
  }
  const float scale = static_cast<float>(dense.scale);
  for (size_t r = 0; r < group; ++r)
    ScaledRow(rows.q(b, i, g * e.group() + static_cast<int64_t>(r)), d, s.range.d_pad(), scale,
              row.queries.get() + r * s.range.d_pad());
}

// The latent step's block (sparse_dot_unit): keys[0, n) of row i, the next block's keys
// (next[0, ahead)) prefetched.
inline void LatentRowBlock(const detail::SparseForwardProblem<bfloat16>& problem, int64_t b, int64_t g,
                           ForwardScratch<bfloat16>& s, TileRow<bfloat16>& row, const int32_t* keys, size_t n,
                           const int32_t* next, size_t ahead) {
  const auto& dense = problem.dense;
  const detail::Extents& e = dense.extents;
  const auto rows = dense.rows();
  const size_t group = static_cast<size_t>(e.group());
  const size_t d = static_cast<size_t>(e.head_dim), dv = static_cast<size_t>(e.v_dim), dv_pad = s.range.dv_pad();
  for (size_t j = 0; j < n; ++j) {
    s.k_rows[j] = rows.k(b, keys[j], g);
    s.v_rows[j] = rows.v(b, keys[j], g);
  }
  for (size_t j = 0; j < ahead; ++j) s.k_next[j] = rows.k(b, next[j], g);
  std::swap(s.lat.q_pairs, row.q_pairs);  // LatentBlock reads the row's pairs from the scratch
  LatentBlock<bfloat16>(group, row.m.data(), row.l.data(), row.acc.get(), s.alpha.data(), s.lat, n, d, d, dv, dv_pad,
                        static_cast<float>(dense.scale), s.k_rows.data(), nullptr, s.v_rows.data(), nullptr, nullptr,
                        Ahead<bfloat16>{s.k_next.data(), ahead, RowBytes<bfloat16>(d)}, Ahead<bfloat16>{});
  std::swap(s.lat.q_pairs, row.q_pairs);
}

// A block's scaled logits (G × padded in s.scores) through the score pipeline, then the
// online softmax: P in s.scores, the rescaling in s.alpha.
template <class T>
void SoftmaxBlock(const detail::SparseForwardProblem<T>& problem, int64_t b, int64_t i, int64_t g,
                  ForwardScratch<T>& s, TileRow<T>& row, size_t n, size_t padded) {
  const auto& dense = problem.dense;
  const size_t group = s.group;
  if (s.plain_scores && !dense.mask.tree.has(b)) {
    // No modifier: the pipeline's one stage, the mask, only hides the padding.
    for (size_t r = 0; r < group; ++r)
      std::fill(s.scores.get() + r * kGatherKeys + n, s.scores.get() + r * kGatherKeys + padded, kMinusInf);
  } else {  // the score pipeline per head; its mask stage removes the padding past the block
    for (size_t r = 0; r < group; ++r)
      detail::apply_score_pipeline(
          dense.modifiers,
          RowStages{.rule = dense.mask, .mods = dense.modifiers, .batch = b,
                    .head = g * static_cast<int64_t>(group) + static_cast<int64_t>(r), .query = i, .first_key = 0,
                    .keys = n, .padded = padded, .key_begin = 0, .key_end = static_cast<int64_t>(n),
                    .s = s.scores.get() + r * kGatherKeys});
  }
  SoftmaxRows(group, padded, s.scores.get(), kGatherKeys, row.m.data(), row.l.data(), s.alpha.data());
}

// The pair step's block (sparse_pair_step): keys[0, n) of row i from the tile's stored
// copy of the range, the products on vdpbf16ps (bf16_group_block.hpp). The scores are
// padded to whole vectors of 16 keys (the kernel's tree), whatever the target's lanes.
inline void PairRowBlock(const detail::SparseForwardProblem<bfloat16>& problem, int64_t b, int64_t i, int64_t g,
                         ForwardScratch<bfloat16>& s, TileRow<bfloat16>& row, const int32_t* keys, size_t n) {
  const detail::Extents& e = problem.dense.extents;
  const size_t padded = round_up(n, size_t{16});
  s.stored.Point(keys, n, padded);
  bf16dot::GroupScores(row.q_rows.data(), s.group, s.stored.k_rows(), padded, static_cast<size_t>(e.head_dim),
                       static_cast<float>(problem.dense.scale), s.scores.get(), kGatherKeys);
  SoftmaxBlock(problem, b, i, g, s, row, n, padded);
  bf16dot::GroupValues(s.scores.get(), kGatherKeys, s.group, n, s.stored.v_rows(), static_cast<size_t>(e.v_dim),
                       s.value_words.data(), row.acc.get(), s.range.dv_pad(), s.alpha.data());
}

// The float step's block: keys[0, n) of row i, read from the tile's copied range.
template <class T>
void FloatRowBlock(const detail::SparseForwardProblem<T>& problem, int64_t b, int64_t i, int64_t g,
                   ForwardScratch<T>& s, TileRow<T>& row, const int32_t* keys, size_t n) {
  const size_t group = s.group;  // (Extents::group() divides: once per call, not per block)
  const size_t lanes = VectorLanes(), padded = round_up(n, lanes);
  const auto step = [&](auto k_rows, auto v_rows, size_t k_dim, size_t v_dim, auto k_ahead, auto v_ahead) {
    // (The copied range's rows are in L2: nothing to prefetch, so the range's empty Ahead
    // is passed unshifted.)
    static_assert(std::is_same_v<decltype(k_ahead), Ahead<float>>);
    for (size_t j = 0; j < padded; j += lanes)
      ScoreKeys(group, row.queries.get(), s.range.d_pad(), k_rows + j, k_dim, k_ahead, s.scores.get() + j,
                kGatherKeys);
    SoftmaxBlock(problem, b, i, g, s, row, n, padded);
    ValueBlock(group, s.scores.get(), kGatherKeys, n, v_rows, v_dim, v_ahead, s.alpha.data(), row.acc.get(),
               s.range.dv_pad());
  };
  s.range.Point(keys, n, padded);  // the rows copied once for the tile (ForwardTile), in L2
  s.range.Visit(step);
}

// The row's outputs from its softmax state (m, l, acc): out and lse of the group's heads.
template <class T>
void FinishRow(const detail::SparseForwardProblem<T>& problem, int64_t b, int64_t i, int64_t g,
               const ForwardScratch<T>& s, const TileRow<T>& row) {
  const auto& dense = problem.dense;
  const detail::Extents& e = dense.extents;
  const auto rows = dense.rows();
  const size_t group = static_cast<size_t>(e.group()), dv = static_cast<size_t>(e.v_dim), dv_pad = s.range.dv_pad();
  const auto& sinks = dense.modifiers.sinks;
  for (size_t r = 0; r < group; ++r) {
    const int64_t h = g * e.group() + static_cast<int64_t>(r);
    float m_final = row.m[r], l_final = row.l[r], carry = 1.0f;  // carry = e^(m − m_f)
    if (!sinks.empty()) {
      m_final = std::max(row.m[r], sinks[h]);
      carry = row.m[r] == kMinusInf ? 0.0f : std::exp(row.m[r] - m_final);
      l_final = row.l[r] * carry + std::exp(sinks[h] - m_final);
    }
    T* out = rows.out(b, i, h);
    const float* acc = row.acc.get() + r * dv_pad;
    const bool empty = l_final == 0.0f;  // no key and no sink
    const float factor = empty ? 0.0f : carry / l_final;
    for (size_t c = 0; c < dv; ++c) out[c] = StoreAs<T>(empty ? 0.0f : acc[c] * factor);
    if (!dense.args.lse.empty()) rows.lse(b, h, i) = empty ? kMinusInf : m_final + std::log(l_final);
  }
}

// Query rows [i0, i0 + tile) of batch entry b, kv head g, swept together (SweepTile).
// sets: the wave's (the tile is its tile bt), or null: each row's computed here.
template <class T>
void ForwardTile(const detail::SparseForwardProblem<T>& problem, int64_t b, int64_t i0, size_t tile, int64_t g,
                 ForwardScratch<T>& s, const SharedSets* sets = nullptr, int64_t bt = 0) {
  for (size_t t = 0; t < tile; ++t)
    BeginRow(problem, b, i0 + static_cast<int64_t>(t), g, s, s.rows[t], sets != nullptr ? sets->row(bt, t) : nullptr,
             sets != nullptr ? sets->count(bt, t) : 0);
  const amx::TileScope tile_scope(s.latent && s.lat.amx);  // one configuration for the unit's blocks (no hook runs)
  SweepTile(
      tile, s.range_keys, [&](size_t t) { return std::pair{s.rows[t].set, s.rows[t].count}; },
      [&](size_t t, const int32_t* keys, size_t n, const int32_t* next, size_t ahead) {
        if constexpr (std::is_same_v<T, bfloat16>) {
          if (s.latent) return LatentRowBlock(problem, b, g, s, s.rows[t], keys, n, next, ahead);
          if (s.pairs) return PairRowBlock(problem, b, i0 + static_cast<int64_t>(t), g, s, s.rows[t], keys, n);
        }
        FloatRowBlock(problem, b, i0 + static_cast<int64_t>(t), g, s, s.rows[t], keys, n);
      },
      [&](int64_t begin, int64_t end) {
        const auto rows = problem.dense.rows();
        if (s.stored.active())
          s.stored.Copy(begin, end, [&](int64_t j) { return rows.k(b, j, g); }, [&](int64_t j) { return rows.v(b, j, g); });
        if (!s.range.active()) return;
        s.range.Widen(begin, end, [&](int64_t j) { return rows.k(b, j, g); }, [&](int64_t j) { return rows.v(b, j, g); });
      });
  for (size_t t = 0; t < tile; ++t) FinishRow(problem, b, i0 + static_cast<int64_t>(t), g, s, s.rows[t]);
}

template <class T>
void SparseForwardImpl(const detail::SparseForwardProblem<T>& problem) {
  const detail::Extents& e = problem.dense.extents;
  if (e.batch * e.q_len * e.kv_heads == 0) return;
  const bool pair_step = sparse_pair_step<T>(e, problem.dense.precision);
  const Bf16Unit latent_unit =
      pair_step ? Bf16Unit::fp32_fma : sparse_dot_unit<T>(e, problem.dense.modifiers, problem.dense.precision);
  // The bf16 unit's rows keep their own blocks of 64 listed keys, one row a unit: split at
  // the ranges, a row of N 32768 lists ~16 keys a range, and the unit's per-block cost (the
  // 16+ heads' accumulators, 50 KiB a row at the MLA shape, loaded and stored by the tiles)
  // made the forward 1.35× slower there (9.2–9.7 → 12.1–13.8 s, 2 threads, Emerald Rapids),
  // where the GQA shape's float step, 2 KiB a row, still gained (18.3 → 15.0 s).
  const int64_t kTile = latent_unit != Bf16Unit::fp32_fma
                            ? 1
                            : static_cast<int64_t>(SweepTileRows(e, problem.keys.topk));
  const int64_t tiles = (e.q_len + kTile - 1) / kTile;
  const int64_t units = e.batch * tiles * e.kv_heads;
  // Scratch allocated before the parallel region: a workspace the system cannot give is
  // a qkv::Error from here, not an exception escaping an OpenMP thread.
  const int threads = static_cast<int>(std::min<int64_t>(problem.dense.threads, units));
  // The latent step's unit (decode_latent-inl.h's column step, as latent decode takes; on
  // the AMX tiles the float step ran until 2026-12-06: bench/RESULTS.md §15b). The queries
  // and keys are bf16 already, their products exact in float32: the logits, and so the lse
  // the backward divides by, are the float step's up to the order of the float32 sums; each
  // weight P is rounded to bfloat16 once for P·V (the bf16 contract, docs/numerics.md).
  std::vector<ForwardScratch<T>> scratch;
  scratch.reserve(static_cast<size_t>(threads));
  const auto& mods = problem.dense.modifiers;
  const size_t lanes = VectorLanes();
  const bool values_in_keys = e.k_len > 0 && e.v_dim <= e.head_dim &&
                              problem.dense.rows().v(0, 0, 0) == problem.dense.rows().k(0, 0, 0);  // v = k[..., :dv]
  const int64_t range_keys =
      latent_unit != Bf16Unit::fp32_fma
          ? kWholeRange
          : ForwardRangeKeys(round_up(static_cast<size_t>(e.head_dim), lanes), round_up(static_cast<size_t>(e.v_dim), lanes),
                             values_in_keys);
  for (int t = 0; t < threads; ++t) {
    scratch.emplace_back(e, problem.keys, latent_unit, pair_step, static_cast<size_t>(kTile), range_keys);
    scratch.back().plain_scores = mods.softcap == 0.0f && !mods.has_alibi() && !mods.has_score_mod();
  }
  const auto rows_of = [&](int64_t tile) { return static_cast<size_t>(std::min(kTile, e.q_len - tile * kTile)); };
  if (problem.keys.lists != 1 || e.kv_heads == 1) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      // Tiles innermost: consecutive units read one kv head's K and V, which then stay in
      // the last-level cache (all kv heads' rows at 8192 keys are 64 MiB in float at d 128).
      const int64_t tile = u % tiles, g = (u / tiles) % e.kv_heads, b = u / (e.kv_heads * tiles);
      ForwardTile(problem, b, tile * kTile, rows_of(tile), g, scratch[static_cast<size_t>(omp_get_thread_num())]);
    }
    return;
  }
  // One list per query for every kv head: waves of tiles, each wave's sets computed once,
  // then its units (tiles innermost, as above).
  SharedSets sets;
  sets.tile_rows = static_cast<size_t>(kTile);
  sets.topk = static_cast<size_t>(problem.keys.topk);
  const int64_t tile_bytes = kTile * std::max<int64_t>(problem.keys.topk, 1) * 4;
  const int64_t wave = std::min(std::max<int64_t>(4 * threads, 16),
                                std::max<int64_t>(threads, (int64_t{64} << 20) / tile_bytes));
  const int64_t all_tiles = e.batch * tiles;
  sets.keys.resize(static_cast<size_t>(std::min(wave, all_tiles) * kTile) * sets.topk);
  sets.counts.resize(static_cast<size_t>(std::min(wave, all_tiles) * kTile));
#pragma omp parallel num_threads(threads)
  {
    ForwardScratch<T>& s = scratch[static_cast<size_t>(omp_get_thread_num())];
    for (int64_t first = 0; first < all_tiles; first += wave) {
      const int64_t count = std::min(wave, all_tiles - first);
#pragma omp single
      sets.first_tile = first;
#pragma omp for schedule(static)
      for (int64_t r = 0; r < count * kTile; ++r) {
        const int64_t bt = first + r / kTile, b = bt / tiles, i = (bt % tiles) * kTile + r % kTile;
        if (i < e.q_len)
          sets.counts[static_cast<size_t>(r)] = static_cast<size_t>(problem.keys.attended_keys(
              problem.dense.mask, b, 0, i, sets.keys.data() + static_cast<size_t>(r) * sets.topk, s.marks));
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t u = 0; u < count * e.kv_heads; ++u) {
        const int64_t bt = first + u % count, g = u / count, b = bt / tiles, tile = bt % tiles;
        ForwardTile(problem, b, tile * kTile, rows_of(tile), g, s, &sets, bt);
      }
    }
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
