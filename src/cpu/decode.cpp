// Decode: a few queries per sequence against a long key/value cache (flash-decoding).
//
// Decoding reads every cached key and value once and does 4·G·d flops per cached key
// (G query heads per kv head) against 2·d·bytes of traffic, so memory bandwidth, or for
// large G with 16-bit caches the FMA peak, sets its pace. The kernel therefore
//   - reads each K/V head once for all the query heads of its GQA group and all the
//     queries of a tile (up to 16): the rows r = (head of the group, query) share a pass;
//   - walks the keys of a sequence in chunks; a task is (sequence, query tile, chunk[, part
//     of the kv heads in calls of few chunks]) and walks its keys in units of (block of
//     keys, kv head), heads inner, so it streams through the cache roughly in memory order
//     with few pages live at a time; the unit two ahead is prefetched key by key;
//   - reads K and V in place (contiguous or paged: a block is a list of row pointers),
//     widening bfloat16/float16 to float inside the kernels' loads — no packed copy;
//   - keeps the per-key work vectorized over keys: scores S[r][j] for a vector of L keys
//     come from one register tile (up to 4 rows × a few keys of accumulators with lanes
//     over d: each K vector loaded once for the rows, each Q vector once for the keys),
//     reduced across lanes by a transpose-add tree into one vector of L scores per row;
//     then one vector exp pass per row; then P·V by a register tile of rows × vectors of
//     dv (each V vector loaded once for the rows).
// Per chunk, each row keeps the online-softmax state (m, l, acc = Σ e^(s−m)·v); the chunks
// of a row are merged afterwards in chunk order:
//     m = max_c m_c,   l = Σ_c l_c·e^(m_c−m),   out = (Σ_c acc_c·e^(m_c−m)) / l,   lse = m + log l
// Chunk boundaries depend only on the sequence length, never on the thread count, and
// every task and merge is computed the same way on any thread: results are bitwise
// identical for any number of threads.
//
// Storage: K/V may be float32, bfloat16 or float16, widened exactly; all arithmetic is
// float32. int8 rows carry a scale each: the score tile is computed from the integers
// (converted exactly) and multiplied by each key's scale, and each weight by its value
// row's scale before P·V — the row's values are never dequantized into memory. Head
// sizes that are not whole vectors take a packed path: each block's rows are widened
// into zero-padded float rows first, then the same kernels run on those.
//
// Masks: each query row sees a range of its sequence's keys (key lengths, causal alignment,
// a sliding window), so a block is either fully visible to every row of the tile, or partly
// visible (scores of hidden keys set to -inf — overwritten, so a NaN key behind the mask
// never reaches a row); keys past the last visible key of the tile are never read.
// A draft tree (qkv::BatchPlan's tree_mask, MaskRule::tree) hides new tokens per row: the
// blocks holding a sequence's new tokens are partly visible, its prefix blocks fully.
//
// decode_tiles-inl.h holds the register tiles; decode_rows-inl.h the per-thread scratch,
// the row pointers and scales of a unit read in place, the channel-scaled scores and the
// int4 values' weights; decode_latent-inl.h the latent step (column step and spans).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/decode.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "cpu/block_ops-inl.h"
#include "cpu/decode_tiles-inl.h"
#include "cpu/decode_rows-inl.h"
#include "cpu/decode_latent-inl.h"
#include "cpu/score_pipeline-inl.h"

#ifndef QKV_CPU_DECODE_ONCE_
#define QKV_CPU_DECODE_ONCE_
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu/blocking.hpp"
#include "cpu/cpu_backend.hpp"
#include "core/score_pipeline.hpp"
#include "cpu/decode.hpp"
#include "cpu/decode_plan.hpp"
#include "cpu/dot_products.hpp"
#include "cpu/int8_dot.hpp"
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {

namespace {

using Problem = detail::ForwardProblem<float>;

// The same prefetches for the VNNI kernels.
template <class T>
int8dot::Prefetch ToPrefetch(const Ahead<T>& ahead) {
  return {reinterpret_cast<const void* const*>(ahead.rows), ahead.count, ahead.bytes, ahead.lines, ahead.line_count};
}

// The rows of one kv head's query group in a chunk of a task, and their softmax state.
struct GroupRows {
  int64_t head = 0;   // the kv head g
  size_t count = 0;   // rows: the group's query heads × the tile's queries
  size_t tile = 0;    // queries in the tile (row r is head g·G + r / tile, query r % tile)
  const float* queries = nullptr;  // scale·q, d_pad apart
  int8dot::Queries quantized;      // int8 caches on VNNI: the same rows as int8 terms
  float* m = nullptr;
  float* l = nullptr;
  float* acc = nullptr;  // dv_pad apart
  const int64_t* key_begin = nullptr;  // per query of the tile: the keys it sees
  const int64_t* key_end = nullptr;
  int64_t max_begin = 0, min_end = 0;  // keys every query of the tile sees
};

// One block step of a chunk: keys [first, first + keys) of kv head gr.head against every
// row of its group — the rows' scores, the score pipeline, the online-softmax step, then
// acc = acc·alpha + P·V. The rows k_rows / v_rows (padded to whole vectors) are the
// storage's (S = T) or the float window's (S = float: no scales). Keys in two parts
// (kv.split_keys(): latent attention) have their second parts' rows in rope_rows.
template <class T, class S>
void BlockStep(const Problem& p, const KvSource& kv, const DecodePlan& plan, const DecodeTask& task,
               const GroupRows& gr, DecodeScratch<T>& s, int64_t first, size_t keys, const S* const* k_rows,
               const S* const* v_rows, const float* k_scale, const float* v_scale, const float* v_groups,
               Ahead<S> k_ahead, Ahead<S> v_ahead, const S* const* rope_rows = nullptr, Ahead<S> rope_ahead = {}) {
  static_assert(std::is_same_v<S, T> || std::is_same_v<S, float>);
  constexpr bool kStored = std::is_same_v<S, T>;  // else the float window's rows
  constexpr bool kScaled = kStored && kScaledStorage<T>;
  constexpr bool kGrouped = kStored && kGroupedValues<T>;
  const size_t lanes = VectorLanes();
  const detail::Extents& e = p.extents;
  const size_t d = static_cast<size_t>(e.head_dim), dv = static_cast<size_t>(e.v_dim);
  const size_t d_pad = plan.d_pad, dv_pad = plan.dv_pad;
  const size_t ld = task.block_keys;  // row length of the score tile
  const size_t t_ld = plan.block_keys;  // int4 values: a group's scales of the block (RowPointers)
  const size_t padded = round_up(keys, lanes);
  const size_t rows = gr.count;
  float* scores = s.scores.get();
  // Split keys: channels [0, d_first) from k_rows, the rest from rope_rows.
  const bool split = rope_rows != nullptr;
  const size_t d_first = split ? static_cast<size_t>(kv.rope_from) : d;

  // int8 caches on VNNI (int8_dot.hpp): both products in place for any head size.
  constexpr bool kInt8 = kStored && std::is_same_v<T, std::int8_t>;
  const bool vnni_scores = kInt8 && s.vnni && !kv.channel_scaled();
  const bool vnni_values = kInt8 && s.vnni;
  // Keys in two parts are widened into one row (both parts summed in one chain, whatever
  // the row count). Values are widened once per block too when many rows read them
  // (PackValuesFor): the same values in the same order, so the same bits as in place.
  const bool pack_keys = plan.packed || split;
  bool values_from_keys = false;  // (set below)
  const bool pack_values = plan.packed || (kStored && PackValuesFor<T>(rows));
  const auto widen_values = [&] {  // the V rows widened and padded, s.v_ld apart
    const size_t groups = kGrouped ? static_cast<size_t>(kv.value_groups()) : 0;
    for (size_t j = 0; j < keys; ++j) {
      v_ahead(j);  // (packing reads the rows here: the next unit's start on their way)
      float* value = s.values.get() + j * s.v_ld;
      WidenRows(v_rows[j], 0, 1, dv, value, dv_pad);
      if constexpr (kGrouped) {  // level · s + z of the channel's group
        for (size_t c = 0; c < dv; ++c) {
          const size_t g = c / static_cast<size_t>(kv.value_group);
          value[c] = value[c] * v_groups[g * t_ld + j] + v_groups[(groups + g) * t_ld + j];
        }
      }
    }
    for (size_t j = 0; j < padded; ++j) s.v_packed[j] = s.values.get() + std::min(j, keys - 1) * s.v_ld;
  };

  // S[r][j] = (scale·q_r)·k_j for the block's keys, one vector of keys at a time, while
  // the next unit's rows start on their way from memory.
  if (vnni_scores) {
    if constexpr (kInt8)
      int8dot::Scores(rows, gr.quantized, k_rows, d, padded, scores, ld,
                      ToPrefetch(k_ahead));
  } else if (kScaled && kv.channel_scaled() && !plan.packed) {
    if constexpr (kScaled) ChannelScaledScores<T>(kv, plan, task.batch, gr.head, first, keys, rows, gr.queries, k_rows, d,
                                                  k_ahead, scores, ld, s);
  } else if (!pack_keys) {
    for (size_t j = 0; j < padded; j += lanes)
      ScoreKeys(rows, gr.queries, d_pad, k_rows + j, d, k_ahead.offset(j), scores + j, ld);
  } else {
    for (size_t j = 0; j < keys; ++j) {
      float* key = s.keys.get() + j * d_pad;
      if (split) {
        k_ahead(j);
        rope_ahead(j);
        WidenRows(k_rows[j], 0, 1, d_first, key, d_first);
        WidenRows(rope_rows[j], 0, 1, d - d_first, key + d_first, d_pad - d_first);
      } else {
        WidenRows(k_rows[j], 0, 1, d, key, d_pad);
      }
      if (kScaled && kv.channel_scaled()) {  // level · channel scale + zero point
        const ScalePtr channel = kv.channel_scales(task.batch, first + static_cast<int64_t>(j), gr.head);
        const ScalePtr zero = kv.channel_zeros(task.batch, first + static_cast<int64_t>(j), gr.head);
        for (size_t c = 0; c < d; ++c) key[c] = std::fma(key[c], channel[c], zero != nullptr ? zero[c] : 0.0f);
      }
    }
    for (size_t j = 0; j < padded; ++j) s.k_packed[j] = s.keys.get() + std::min(j, keys - 1) * d_pad;
    // Latent values are the keys' first dv channels: read from the widened keys (the same
    // bits), d_pad apart, not from the cache rows' power-of-two stride that maps a panel onto
    // a few L1 sets (MLA fp32, 16 heads, 4k keys, 1 thread, Emerald Rapids: 1.44 → 1.17 ms).
    values_from_keys = split && !plan.packed && !kScaled && !kGrouped && dv <= d_first;
    for (size_t j = 0; j < keys && values_from_keys; ++j) values_from_keys = v_rows[j] == k_rows[j];
    if (plan.packed && !vnni_values) widen_values();
    for (size_t j = 0; j < padded; j += lanes)
      ScoreKeys(rows, gr.queries, d_pad, s.k_packed.data() + j, d_pad, Ahead<float>{}, scores + j, ld);
  }

  // Scaled rows: the dot products were of the stored integers; times each key's scale.
  if constexpr (kScaled)
    for (size_t r = 0; r < rows; ++r) MultiplyTile(scores + r * ld, k_scale, padded);

  // The score pipeline, row by row: the variants on the scaled logits, then the row's key
  // range — hidden keys and the padding past the block get -inf, overwriting the score,
  // so a NaN/Inf key that a row does not see cannot reach it.
  const auto block_keys = static_cast<int64_t>(keys);
  const detail::ScoreModifiers& mods = p.modifiers;
  for (size_t r = 0; r < rows; ++r) {
    const size_t i = r % gr.tile;
    detail::apply_score_pipeline(
        mods, RowStages{.rule = p.mask, .mods = mods, .batch = task.batch,
                        .head = gr.head * e.group() + static_cast<int64_t>(r / gr.tile),
                        .query = task.first_query + static_cast<int64_t>(i), .first_key = first,
                        .keys = keys, .padded = padded, .key_begin = gr.key_begin[i],
                        .key_end = gr.key_end[i], .s = scores + r * ld});
  }
  SoftmaxRows(rows, padded, scores, ld, gr.m, gr.l, s.alpha.get());

  // A value behind the mask that holds NaN/Inf: skip P = 0 terms so 0·Inf cannot leak.
  // Keys [seen_from, seen_to) of the block are visible to every row of the tile.
  const auto seen_from = static_cast<size_t>(std::clamp<int64_t>(gr.max_begin - first, 0, block_keys));
  const size_t seen_to = std::max(seen_from, static_cast<size_t>(std::clamp<int64_t>(gr.min_end - first, 0, block_keys)));
  // (int8 and int4 levels are finite; their scales may not be. float8 values and scales
  // may both be NaN or inf.)
  bool hidden_non_finite = false;
  for (size_t j = 0; j < keys && !hidden_non_finite; ++j) {
    if (j >= seen_from && j < seen_to) continue;
    if constexpr (kStored && kIsFloat8<T>) {
      hidden_non_finite = !std::isfinite(v_scale[j]) || !AllFinite(v_rows[j], 0, 1, dv);
    } else if constexpr (kStored && kRowScaledValues<T>) {
      hidden_non_finite = !std::isfinite(v_scale[j]);
    } else if constexpr (kGrouped) {
      hidden_non_finite = !std::isfinite(v_groups[j]);  // group 0's scale: all NaN for a non-finite row
    } else {
      hidden_non_finite = !AllFinite(v_rows[j], 0, 1, dv);
    }
  }
  if (hidden_non_finite) {
    const size_t groups = kGrouped ? static_cast<size_t>(kv.value_groups()) : 0;
    const auto value = [&](size_t j, size_t c) {  // as stored (int4: level · s + z of c's group)
      const float level = WidenAt(v_rows[j], c, dv);
      const size_t g = kGrouped ? c / static_cast<size_t>(kv.value_group) : 0;
      return kGrouped ? level * v_groups[g * t_ld + j] + v_groups[(groups + g) * t_ld + j] : level;
    };
    ScaleRows(gr.acc, rows, dv_pad, dv_pad, s.alpha.get());
    for (size_t r = 0; r < rows; ++r)
      for (size_t j = 0; j < keys; ++j) {
        float w = scores[r * ld + j];
        if (w == 0.0f) continue;
        if constexpr (kStored && kRowScaledValues<T>) w *= v_scale[j];
        for (size_t c = 0; c < dv; ++c) gr.acc[r * dv_pad + c] += w * value(j, c);
      }
    return;
  }
  // Scaled rows: each weight times its value row's scale (l was summed from the unscaled ones).
  if constexpr (kStored && kRowScaledValues<T>)
    for (size_t r = 0; r < rows; ++r) MultiplyTile(scores + r * ld, v_scale, padded);
  if (vnni_values) {
    if constexpr (kInt8) {
      if (int8dot::AddWeighted(rows, scores, ld, padded, v_rows, dv, s.alpha.get(), gr.acc, dv_pad,
                               s.weight_bytes.data(), s.value_bytes.data(),
                               ToPrefetch(v_ahead)))
        return;
    }
    if (plan.packed) widen_values();  // a NaN weight: the float arithmetic carries it
  }
  if (values_from_keys) {  // the widened keys' rows (keys were split, so packed)
    ValueBlock(rows, scores, ld, keys, s.k_packed.data(), dv, Ahead<float>{}, s.alpha.get(), gr.acc, dv_pad);
  } else if (pack_values) {
    if (!plan.packed) widen_values();
    ValueBlock(rows, scores, ld, keys, s.v_packed.data(), dv_pad, Ahead<float>{}, s.alpha.get(), gr.acc, dv_pad);
  } else if constexpr (kGrouped) {  // int4: levels times each group's weights, plus its bias
    const size_t groups = static_cast<size_t>(kv.value_groups());  // of kInt4Chunk channels here
    GroupWeights(rows, scores, ld, padded, v_groups, t_ld, groups, s.group_weights.get(), groups * ld, ld,
                 s.group_bias.get());
    const GroupedWeights weights{s.group_weights.get(), groups * ld, ld, s.group_bias.get(), groups};
    WeightedValues(rows, weights, keys, v_rows, dv, v_ahead, s.alpha.get(), gr.acc, dv_pad);
  } else {
    ValueBlock(rows, scores, ld, keys, v_rows, dv, v_ahead, s.alpha.get(), gr.acc, dv_pad);
  }
}

// One chunk of one task: its kv heads over the keys [task.first_key, task.end_key), head
// after head, so that each head is one stream through the cache, prefetched a block
// ahead. Per block: BlockStep over the block's stored keys, then (a cache with a float
// window) over its keys in the window. Writes the chunk's (m, l, acc) of its heads' rows
// of the tile into the chunk's state in `states`.
template <class T>
void DecodeChunk(const Problem& p, const KvSource& kv, const DecodePlan& plan, const DecodeTask& task,
                 DecodeScratch<T>& s, float* states) {
  const FloatTag df;
  const size_t lanes = hn::Lanes(df);
  const detail::Extents& e = p.extents;
  const detail::MaskRule& mask = p.mask;
  const size_t d = static_cast<size_t>(e.head_dim), dv = static_cast<size_t>(e.v_dim);
  const size_t d_pad = plan.d_pad, dv_pad = plan.dv_pad;
  const size_t tile = static_cast<size_t>(task.queries);  // queries in this tile
  const size_t group_rows = static_cast<size_t>(e.group()) * tile;
  const size_t all_rows = static_cast<size_t>(e.q_heads) * tile;
  const ChunkState chunk = plan.chunk_state(states, task);
  const amx::TileScope tile_scope(s.latent && s.lat.amx && !mask.mask_mod.active());  // amx_dot.hpp: hooks

  // Row (h, i) of the tile: scale·q(b, first_query + i, h, ·), zero-padded to d_pad.
  // Query i sees keys [key_begin[i], key_end[i]); both bounds grow with i.
  int64_t key_begin[kDecodeQueries] = {}, key_end[kDecodeQueries] = {};
  for (size_t i = 0; i < tile; ++i) {
    key_begin[i] = mask.key_begin(task.batch, task.first_query + static_cast<int64_t>(i));
    key_end[i] = mask.key_end(task.batch, task.first_query + static_cast<int64_t>(i));
  }
  // Keys every query of the tile sees end with the first query's; a tree's new tokens
  // are not seen by every query (so a non-finite value among them takes the safe path).
  const int64_t seen_by_all_end =
      mask.tree.has(task.batch) ? std::min(key_end[0], mask.tree_begin(task.batch)) : key_end[0];
  const float scale = static_cast<float>(p.scale);
  const auto rows = p.rows();  // varlen queries: through the sequence offsets
  for (int64_t h = 0; h < e.q_heads; ++h)
    for (size_t i = 0; i < tile; ++i) {
      const float* q = rows.q(task.batch, task.first_query + static_cast<int64_t>(i), h);
      float* row = s.queries.get() + (static_cast<size_t>(h) * tile + i) * d_pad;
      // (Latent blocks on vdpbf16ps: q rounded to bfloat16 once, for every block of the row.)
      if (s.latent)
        for (size_t c = 0; c < d; ++c) row[c] = scale * static_cast<float>(bfloat16(q[c]));
      else
        for (size_t c = 0; c < d; ++c) row[c] = scale * q[c];
      std::fill(row + d, row + d_pad, 0.0f);
    }
  if (s.vnni) int8dot::QuantizeQueries(s.queries.get(), all_rows, d_pad, d, s.quantized_queries());
  if constexpr (kLatentStorage<T>) {
    if (s.latent) PackLatentQueries(rows, task.batch, task.first_query, tile, static_cast<size_t>(e.q_heads), d, s.lat);
  }
  // This task's kv heads (a part of them, DecodePlan::split_by_heads): its rows of the state.
  const int64_t first_head = task.first_kv_head, end_head = task.end_kv_head;
  const size_t first_row = static_cast<size_t>(first_head) * group_rows;
  const size_t end_row = static_cast<size_t>(end_head) * group_rows;
  std::fill(chunk.m + first_row, chunk.m + end_row, kMinusInf);
  std::fill(chunk.l + first_row, chunk.l + end_row, 0.0f);
  std::fill(chunk.acc + first_row * dv_pad, chunk.acc + end_row * dv_pad, 0.0f);

  const size_t block = task.block_keys;  // the sequence's block (≤ plan.block_keys)
  const size_t slot_rows = plan.block_keys;  // rows of a ring slot
  const int64_t end = task.end_key;
  // Keys from here on are read from the float window (none: INT64_MAX).
  const int64_t stored_end = kv.quantized_length(task.batch);
  // Units of work in memory order: (block, head), heads inner, so that a block's rows
  // of every head (one contiguous region in a [keys, heads, d] cache or a page) are read
  // together and few pages are live at a time. The rows of the unit kUnitsAhead on are
  // computed ahead and prefetched while this unit computes.
  const size_t slots = kUnitsAhead + 1;
  const auto unit_keys = [&](int64_t first) {
    return static_cast<size_t>(std::clamp<int64_t>(std::min(end, stored_end) - first, 0, static_cast<int64_t>(block)));
  };
  // The unit after (first, g): the next head of the block, or the next block's first head.
  const auto following = [&](int64_t& first, int64_t& g) {
    if (++g == end_head) {
      g = first_head;
      first += static_cast<int64_t>(block);
    }
  };
  size_t slot_keys[kUnitsAhead + 1] = {};
  const auto scales_of = [&](const hwy::AlignedFreeUniquePtr<float[]>& scales, size_t slot) {
    return kScaledStorage<T> ? scales.get() + slot * slot_rows : nullptr;
  };
  const auto groups_of = [&](size_t slot) {
    return kGroupedValues<T> ? s.group_scales.get() + slot * 2 * static_cast<size_t>(kv.value_groups()) * slot_rows
                             : nullptr;
  };
  const auto fill_slot = [&](size_t u, int64_t first, int64_t g) {
    slot_keys[u] = unit_keys(first);
    if (slot_keys[u] > 0)
      RowPointers<T>(kv, task.batch, g, first, slot_keys[u], round_up(slot_keys[u], lanes),
                     s.k_ring.data() + u * slot_rows, s.v_ring.data() + u * slot_rows, scales_of(s.k_scales, u),
                     scales_of(s.v_scales, u), groups_of(u), slot_rows,
                     kv.split_keys() ? s.rope_ring.data() + u * slot_rows : nullptr);
  };
  // Fill the ring: units 0 .. kUnitsAhead.
  int64_t ahead_first = task.first_key, ahead_g = first_head;
  for (size_t u = 0; u < slots; ++u) {
    fill_slot(u, ahead_first, ahead_g);
    if (u + 1 < slots) following(ahead_first, ahead_g);
  }
  size_t unit = 0;
  for (int64_t first = task.first_key; first < end; first += static_cast<int64_t>(block)) {
    for (int64_t g = first_head; g < end_head; ++g, ++unit) {
      const size_t row0 = static_cast<size_t>(g) * group_rows;  // first row of the group
      const GroupRows gr{.head = g, .count = group_rows, .tile = tile, .queries = s.queries.get() + row0 * d_pad,
                         .quantized = s.vnni ? s.quantized_queries().rows_from(row0) : int8dot::Queries{},
                         .m = chunk.m + row0, .l = chunk.l + row0, .acc = chunk.acc + row0 * dv_pad,
                         .key_begin = key_begin, .key_end = key_end, .max_begin = key_begin[tile - 1],
                         .min_end = seen_by_all_end};
      // The ring holds units unit .. unit + kUnitsAhead: the farthest takes the slot the
      // previous unit left, and its rows are prefetched while this unit computes.
      const size_t slot = unit % slots, far_slot = (unit + kUnitsAhead) % slots;
      if (unit > 0) {
        following(ahead_first, ahead_g);
        fill_slot(far_slot, ahead_first, ahead_g);
      }
      const size_t far_keys = slot_keys[far_slot];
      if constexpr (kScaledStorage<T>) {  // the scales of the unit the next fill reads
        int64_t next_first = ahead_first, next_g = ahead_g;
        following(next_first, next_g);
        ScaleLines<T>(kv, task.batch, next_g, next_first, unit_keys(next_first), s.scale_lines);
      }
      // Its lines ride with the keys' prefetches, then the values' (one a key each).
      const size_t lines = s.scale_lines.size(), k_lines = std::min(lines, far_keys);
      const size_t keys = slot_keys[slot];  // the block's stored keys
      // Latent attention on a bf16 unit: blocks every row of the tile sees whole (the
      // column step), or on the tiles' spans also the last block of a causal step, which
      // each row sees up to its own key_end (not a tree's, whose rows see scattered keys).
      bool latent_block = false;
      if constexpr (kLatentStorage<T>) {
        const bool whole = first >= gr.max_begin && first + static_cast<int64_t>(keys) <= gr.min_end;
        if (s.latent && s.lat.spans) {
          if (keys > 0 && first >= gr.max_begin && (whole || !mask.tree.has(task.batch))) {
            size_t visible[kDecodeQueries];
            for (size_t i = 0; i < tile; ++i)
              visible[i] = static_cast<size_t>(std::clamp<int64_t>(key_end[i] - first, 0, static_cast<int64_t>(keys)));
            latent_block = LatentSpan<T>(group_rows, tile, visible, gr.m, gr.l, gr.acc, dv_pad, s.alpha.get(), s.lat,
                                         keys, d, kv.split_keys() ? static_cast<size_t>(kv.rope_from) : d, dv, scale,
                                         s.k_ring.data() + slot * slot_rows,
                                         kv.split_keys() ? s.rope_ring.data() + slot * slot_rows : nullptr,
                                         s.v_ring.data() + slot * slot_rows, scales_of(s.k_scales, slot), scales_of(s.v_scales, slot));
          }
        } else if (s.latent && keys > 0 && whole) {
          latent_block = true;
          LatentBlock<T>(group_rows, gr.m, gr.l, gr.acc, s.alpha.get(), s.lat, keys, d, kv.split_keys() ? static_cast<size_t>(kv.rope_from) : d,
                      dv, dv_pad, scale, s.k_ring.data() + slot * slot_rows,
                      kv.split_keys() ? s.rope_ring.data() + slot * slot_rows : nullptr, s.v_ring.data() + slot * slot_rows,
                      scales_of(s.k_scales, slot), scales_of(s.v_scales, slot),
                      Ahead<T>{s.k_ring.data() + far_slot * slot_rows, far_keys, RowBytes<T>(d), s.scale_lines.data(), k_lines},
                      kv.split_keys() ? Ahead<T>{s.rope_ring.data() + far_slot * slot_rows, far_keys,
                                                 RowBytes<T>(d - static_cast<size_t>(kv.rope_from))}
                                      : Ahead<T>{});
        }
      }
      if (keys > 0 && !latent_block)
        BlockStep<T, T>(p, kv, plan, task, gr, s, first, keys, s.k_ring.data() + slot * slot_rows,
                        s.v_ring.data() + slot * slot_rows, scales_of(s.k_scales, slot), scales_of(s.v_scales, slot),
                        groups_of(slot),
                        Ahead<T>{s.k_ring.data() + far_slot * slot_rows, far_keys, RowBytes<T>(d), s.scale_lines.data(), k_lines},
                        Ahead<T>{s.v_ring.data() + far_slot * slot_rows, far_keys, RowBytes<T>(dv),
                                 s.scale_lines.data() + k_lines, lines - k_lines},
                        kv.split_keys() ? s.rope_ring.data() + slot * slot_rows : nullptr,
                        kv.split_keys() ? Ahead<T>{s.rope_ring.data() + far_slot * slot_rows, far_keys,
                                                   RowBytes<T>(d - static_cast<size_t>(kv.rope_from))}
                                        : Ahead<T>{});
      // The block's keys in the float window, after its stored ones.
      const int64_t window_first = first + static_cast<int64_t>(keys);
      const auto window_keys = static_cast<size_t>(
          std::clamp<int64_t>(std::min(end, first + static_cast<int64_t>(block)) - window_first, 0, static_cast<int64_t>(block)));
      if (window_keys > 0) {
        for (size_t j = 0; j < round_up(window_keys, lanes); ++j) {
          const int64_t key = window_first + static_cast<int64_t>(std::min(j, window_keys - 1));
          s.window_k[j] = kv.window_key(task.batch, key, g);
          s.window_v[j] = kv.window_value(task.batch, key, g);
        }
        BlockStep<T, float>(p, kv, plan, task, gr, s, window_first, window_keys, s.window_k.data(), s.window_v.data(),
                            nullptr, nullptr, nullptr, Ahead<float>{}, Ahead<float>{});
      }
    }
  }
}

// out = Σ_c acc_c·e^(m_c−m) / Σ_c l_c·e^(m_c−m) over the chunks of one (batch, tile), in
// chunk order; a row that saw no key gets out 0 and lse -inf.
void MergeChunks(const Problem& p, const DecodePlan& plan, const DecodeUnit& unit,
                 float* states, float* sum) {
  const FloatTag df;
  const size_t lanes = hn::Lanes(df);
  const size_t dv = static_cast<size_t>(p.extents.v_dim), dv_pad = plan.dv_pad;
  const size_t tile = static_cast<size_t>(unit.queries);
  const detail::ScoreModifiers& mods = p.modifiers;
  const auto rows = p.rows();  // varlen queries: through the sequence offsets
  const auto state_of = [&](int64_t c) { return plan.chunk_state(states, plan.chunk_task(unit, c)); };
  for (int64_t h = 0; h < p.extents.q_heads; ++h)
    for (size_t i = 0; i < tile; ++i) {
      const size_t r = static_cast<size_t>(h) * tile + i;
      // A sink is one more logit in the row's softmax, with no value: it raises m and l.
      const float sink = mods.has_sinks() ? mods.sinks[h] : kMinusInf;
      float m = sink;
      for (int64_t c = 0; c < unit.chunks; ++c)
        m = std::max(m, state_of(c).m[r]);
      const int64_t query = unit.first_query + static_cast<int64_t>(i);
      float* out = rows.out(unit.batch, query, h);
      // A chunk that saw no key of this row has m = -inf and l = 0 and is skipped. A
      // NaN score leaves m at -inf but l NaN: weight 1 then, so the NaN reaches the row.
      float l = mods.has_sinks() ? std::exp(sink - m) : 0.0f;
      std::fill(sum, sum + dv_pad, 0.0f);
      for (int64_t c = 0; c < unit.chunks; ++c) {
        const ChunkState chunk = state_of(c);
        if (chunk.m[r] == kMinusInf && chunk.l[r] == 0.0f) continue;
        const float weight = chunk.m[r] == m ? 1.0f : std::exp(chunk.m[r] - m);
        l += chunk.l[r] * weight;
        const FloatVec w = hn::Set(df, weight);
        const float* acc = chunk.acc + r * dv_pad;
        for (size_t x = 0; x < dv_pad; x += lanes)
          hn::StoreU(hn::MulAdd(hn::LoadU(df, acc + x), w, hn::LoadU(df, sum + x)), df, sum + x);
      }
      if (l == 0.0f) {
        std::fill(out, out + dv, 0.0f);
      } else {
        for (size_t x = 0; x < dv; ++x) out[x] = sum[x] / l;  // one rounding
      }
      if (!p.args.lse.empty()) rows.lse(unit.batch, h, query) = l == 0.0f ? kMinusInf : m + std::log(l);
    }
}

template <class T>
void RunDecode(const Problem& p, const KvSource& kv, const DecodePlan& plan) {
  if (plan.units.empty()) return;
  hwy::AlignedFreeUniquePtr<float[]> states = AllocateFloats(plan.state_floats);
  const int threads = plan.threads(p.threads);
  // int8 caches: VNNI where the precision and the switch allow (this may throw: here, outside
  // the parallel region; the switch is asked before the target is, so forcing the unit on a CPU
  // without it is an error under every target, scalar included). Blocks: whole groups of 4 keys.
  const size_t d = static_cast<size_t>(p.extents.head_dim), dv = static_cast<size_t>(p.extents.v_dim);
  const bool int8_dots = std::is_same_v<T, std::int8_t> && int8_dot_products(p.precision) && VectorLanes() % 4 == 0;
  const Bf16Unit bf16 = kLatentStorage<T> && p.extents.kv_heads == 1 ? bf16_unit(p.precision) : Bf16Unit::fp32_fma;
  const bool latent_dots = LatentDots(p, kv, plan, kLatentStorage<T>, bf16 != Bf16Unit::fp32_fma);
  // The row-layout spans where the plan made blocks for them and the tiles run the call
  // (a BatchPlan made earlier may meet another unit: its 512-key blocks then take the
  // column step on vdpbf16ps, which any block length suits).
  const bool latent_spans =
      latent_dots && plan.latent_spans && bf16 == Bf16Unit::amx && kLatentStorage<T>;
  if (threads <= 1) {  // no parallel region for work one thread does best
    DecodeScratch<T> scratch(plan, kv, int8_dots, d, dv, latent_dots, bf16 == Bf16Unit::amx, latent_spans);
    for (const DecodeTask& task : plan.tasks) DecodeChunk<T>(p, kv, plan, task, scratch, states.get());
    for (const DecodeUnit& unit : plan.units) MergeChunks(p, plan, unit, states.get(), scratch.merged.get());
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    DecodeScratch<T> scratch(plan, kv, int8_dots, d, dv, latent_dots, bf16 == Bf16Unit::amx, latent_spans);
#pragma omp for schedule(dynamic, 1)
    for (size_t t = 0; t < plan.order.size(); ++t)
      DecodeChunk<T>(p, kv, plan, plan.tasks[plan.order[t]], scratch, states.get());
#pragma omp for schedule(static)
    for (size_t u = 0; u < plan.units.size(); ++u)
      MergeChunks(p, plan, plan.units[u], states.get(), scratch.merged.get());
  }
}

}  // namespace

size_t DecodeLanes() { return VectorLanes(); }

// `planned`: the problem's plan made earlier (qkv::BatchPlan), used when it was made for
// this target's vector length; else (or null) planned here.
void DecodeImpl(const Problem& p, const DecodePlan* planned) {
  const KvSource kv = p.key_values();
  std::optional<DecodePlan> local;
  if (planned == nullptr || planned->lanes != VectorLanes()) {  // planned again, leaving out what it left out
    const std::vector<bool>* skip = planned != nullptr && !planned->skipped.empty() ? &planned->skipped : nullptr;
    planned = &local.emplace(p.extents, p.mask, kv.type, VectorLanes(), p.fixed_key_split, skip,
                             latent_blocks(p, kv.type));
  }
  // int4 rows are read in place in full chunks of 32 channels (storage-inl.h's
  // LoadValues), values a group of 32 channels at a time: else widened into scratch.
  if (kv.type == StorageType::int4 && !planned->packed &&
      (p.extents.head_dim % static_cast<int64_t>(kInt4Chunk) != 0 || p.extents.v_dim % kv.value_group != 0 ||
       kv.value_group != static_cast<int64_t>(kInt4Chunk) || !Int4Vectors(FloatTag()))) {
    if (!local) local.emplace(*planned);  // else planned is local already
    local->packed = true;
    planned = &*local;
  }
  // Gathered keys scaled per channel (decode with key lists): consecutive keys of a block need
  // not share a channel group, as the in-place channel-scaled scores assume; packing widens
  // each key with its own group's scales.
  if (kv.gathered() && kv.channel_scaled() && !planned->packed) {
    if (!local) local.emplace(*planned);
    local->packed = true;
    planned = &*local;
  }
  switch (kv.type) {
    case StorageType::float32: return RunDecode<float>(p, kv, *planned);
    case StorageType::bfloat16: return RunDecode<bfloat16>(p, kv, *planned);
    case StorageType::float16: return RunDecode<float16>(p, kv, *planned);
    case StorageType::int8: return RunDecode<std::int8_t>(p, kv, *planned);
    case StorageType::int4: return RunDecode<uint4x2>(p, kv, *planned);
    case StorageType::float8_e4m3fn: return RunDecode<float8_e4m3fn>(p, kv, *planned);
    case StorageType::float8_e5m2: return RunDecode<float8_e5m2>(p, kv, *planned);
  }
}

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::cpu {
HWY_EXPORT(DecodeImpl);
HWY_EXPORT(DecodeLanes);

void decode(const detail::ForwardProblem<float>& problem, const DecodePlan* planned) {
  apply_simd_target_override();  // QKV_SIMD_TARGET (cpu_backend.hpp)
  HWY_DYNAMIC_DISPATCH(DecodeImpl)(problem, planned);
}

std::size_t decode_vector_lanes() {
  apply_simd_target_override();
  return HWY_DYNAMIC_DISPATCH(DecodeLanes)();
}
}  // namespace qkv::cpu
#endif
