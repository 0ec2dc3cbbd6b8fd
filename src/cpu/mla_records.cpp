// Latent attention over FlashMLA's FP8 records (qkv::MlaRecordArgs) on the cpu backend.
//
// A record holds a token's c_kv as float8_e4m3fn with one float32 scale per 128 values,
// and its k_pe as bfloat16. The scales vary along the latent row, so they cannot be
// applied to a whole score or weight afterwards as a per-row scale is (qkv::decode's
// int8 and float8 rows); instead each block of 64 records is widened into float32 rows
// in L1 — the stored values e4m3 · scale, then k_pe — and the split-K schedule's
// register tiles (decode_tiles-inl.h) run on those rows: the H query heads of a query
// are the tile's rows, each widened row serves them all as key and (its first dc
// values) as value. H·(2·d + 2·dc) flops per 656 bytes widened once: at DeepSeek's 16 to
// 128 heads the widening is a few percent of the block's arithmetic.
//
// On a bf16 unit (vdpbf16ps or the AMX tiles, as the call's precision picks; options.precision
// fast, H a multiple of 16, no soft-cap) a block whose
// stored values are all bfloat16 values — every value when the scales are powers of two,
// as DeepSeek's UE8M0 scales are — takes the latent step (decode_latent-inl.h) on those
// values instead: the same values, products exact, q and each weight P rounded to
// bfloat16 once (the bf16 contract). Other blocks take the float step; both update the
// same online-softmax state.
//
// Work: a row is (sequence b, query i) with its keys — every key the causal rule allows,
// or its attended set from the key lists (core/key_selection.hpp) — cut into chunks whose
// size depends only on the row's key count; a task is one chunk of one row, with the
// online softmax over its blocks, normalised into (out, lse) per head; the chunks of a row
// are merged in chunk order afterwards (core/lse_merge.hpp), then the sinks. Nothing
// depends on which thread ran a task: the bits are the same for any thread count.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/mla_records.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "cpu/block_ops-inl.h"
#include "cpu/decode_latent-inl.h"
#include "cpu/decode_tiles-inl.h"
#include "cpu/score_pipeline-inl.h"
#include "cpu/storage-inl.h"

#ifndef QKV_CPU_MLA_RECORDS_ONCE_
#define QKV_CPU_MLA_RECORDS_ONCE_
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <span>
#include <vector>

#include "core/lse_merge.hpp"
#include "qkv/mla.hpp"
#include "core/score_pipeline.hpp"
#include "cpu/blocking.hpp"
#include "cpu/decode_plan.hpp"
#include "cpu/dot_products.hpp"
#include "cpu/mla_records.hpp"

namespace qkv::cpu::records {

inline constexpr std::size_t kBlockKeys = 64;  // records widened per online-softmax block
inline constexpr int64_t kMinChunkKeys = 512;  // a task's keys: at least this many ...
inline constexpr int64_t kMaxChunks = 16;      // ... and at most this many tasks per row
// On the AMX spans (decode_latent-inl.h's LatentSpan): a task's partial state is its
// heads' 512-wide rows (256 KiB at 128 heads), zeroed, written and merged, against 656
// bytes a record: at 512 keys it was 45% of the bytes the chunk reads in qkv::decode's
// latent step, and 2048 measured 8–12% faster there (bench/RESULTS.md §13g).
inline constexpr int64_t kMinSpanChunkKeys = 2048;

// Keys per chunk of a row with `count` keys: a function of the count (and of the call's
// step, spans or not) alone.
inline int64_t chunk_keys(int64_t count, bool spans) {
  const int64_t even = (count + kMaxChunks - 1) / kMaxChunks;
  const int64_t whole_blocks = (even + static_cast<int64_t>(kBlockKeys) - 1) / static_cast<int64_t>(kBlockKeys);
  return std::max(spans ? kMinSpanChunkKeys : kMinChunkKeys, whole_blocks * static_cast<int64_t>(kBlockKeys));
}

// One chunk of one row: keys [first, first + count) of row `row`'s keys; its partial
// results go to slot `slot`.
struct Task {
  int64_t row = 0, first = 0, count = 0, slot = 0;
};

// Every row's keys: explicit positions (key lists) or 0..count − 1. Rows in packed order
// — sequence by sequence, its queries in order — each with its (sequence, query): the
// sequences may have different query counts (a qkv::BatchPlan step).
struct RowKeys {
  std::vector<int64_t> sequence, query;  // per row
  std::vector<int64_t> count;     // per row
  std::vector<int32_t> position;  // rows × topk with key lists, else empty
  int64_t topk = 0;
  int64_t at(int64_t row, int64_t t) const {
    return position.empty() ? t : position[static_cast<std::size_t>(row * topk + t)];
  }
};

}  // namespace qkv::cpu::records
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {
namespace {

using records::kBlockKeys;

// Whether the call's blocks may take the latent step (see the top): decided per call.
// Its unit: vdpbf16ps or the AMX tiles, as bf16_unit picks for the call's precision (None:
// the float kernel).
std::optional<Bf16Unit> RecordLatentUnit(const detail::ForwardProblem<float>& p) {
  if (p.extents.q_heads % 16 != 0 || p.modifiers.softcap != 0.0f || p.modifiers.has_score_mod() ||
      p.modifiers.has_alibi())
    return std::nullopt;
  const Bf16Unit unit = bf16_unit(p.precision);
  if (unit == Bf16Unit::fp32_fma) return std::nullopt;
  return unit;
}

// One thread's scratch.
struct Scratch {
  Scratch(size_t heads, size_t d, size_t dc, std::optional<Bf16Unit> latent_unit, bool spans)
      : latent(latent_unit.has_value()),
        lat(latent ? LatentScratch(heads, heads, spans ? amx::kSpanKeys : kBlockKeys, d, dc,
                                   latent_unit == Bf16Unit::amx, spans)
                   : LatentScratch()),
        d_pad(round_up(d, VectorLanes())),
        dc_pad(round_up(dc, VectorLanes())),
        queries(AllocateFloats(heads * d_pad)),
        rows(AllocateFloats(kBlockKeys * d_pad)),
        scores(AllocateFloats(heads * kBlockKeys)),
        acc(AllocateFloats(heads * dc_pad)),
        row_ptrs(kBlockKeys),
        half_ptrs(latent ? kBlockKeys : 0),
        m(heads),
        l(heads),
        alpha(heads) {}

  bool latent;
  LatentScratch lat;
  size_t d_pad, dc_pad;
  hwy::AlignedFreeUniquePtr<float[]> queries;  // heads × d_pad: scale·q
  hwy::AlignedFreeUniquePtr<float[]> rows;     // the block's stored values, d_pad apart
  hwy::AlignedFreeUniquePtr<float[]> scores;   // heads × kBlockKeys
  hwy::AlignedFreeUniquePtr<float[]> acc;      // heads × dc_pad
  std::vector<const float*> row_ptrs;
  std::vector<const bfloat16*> half_ptrs;      // the block's rows in lat.keys (lat.span_rows on spans)
  std::vector<float> m, l, alpha;
};

// dst[0, d_pad) = the stored values of one record as float32: e4m3 · its group's scale,
// k_pe widened, zeros.
HWY_INLINE void WidenRecord(const detail::LatentRecords& rec, const std::uint8_t* record, float* HWY_RESTRICT dst,
                            size_t d_pad) {
  const FloatTag df;
  const size_t lanes = hn::Lanes(df), dc = static_cast<size_t>(rec.dc), dr = static_cast<size_t>(rec.dr);
  constexpr size_t kGroup = detail::LatentRecords::kScaleGroup;
  WidenRows(reinterpret_cast<const float8_e4m3fn*>(record), 0, 1, dc, dst, dc);
  for (size_t g = 0; g < dc / kGroup; ++g) {
    const float scale = rec.scale(record, static_cast<int64_t>(g));
    size_t c = g * kGroup;
    for (; c + lanes <= (g + 1) * kGroup; c += lanes)
      hn::StoreU(hn::Mul(hn::LoadU(df, dst + c), hn::Set(df, scale)), df, dst + c);
    for (; c < (g + 1) * kGroup; ++c) dst[c] *= scale;  // (vectors wider than a group)
  }
  WidenRows(reinterpret_cast<const bfloat16*>(rec.rope(record)), 0, 1, dr, dst + dc, d_pad - dc);
}

// dst[0, d) = the stored values of one record as bfloat16, if every one is a bfloat16
// value (returns false otherwise, dst then partly written): e4m3 · scale computed in
// float32 (exact when it is a bfloat16 value) and its top 16 bits kept — the latent
// step's rows without a float32 row in between (power-of-two scales: every block).
HWY_INLINE bool RecordHalves(const detail::LatentRecords& rec, const std::uint8_t* record, bfloat16* HWY_RESTRICT dst) {
  const FloatTag df;
  const hn::RebindToUnsigned<FloatTag> du;
  const hn::RebindToSigned<FloatTag> di;
  const hn::Rebind<std::uint16_t, decltype(di)> dh;
  const size_t lanes = hn::Lanes(df), dc = static_cast<size_t>(rec.dc), dr = static_cast<size_t>(rec.dr);
  constexpr size_t kGroup = detail::LatentRecords::kScaleGroup;
  if (kGroup % lanes != 0) return false;  // (vectors wider than a group: none on x86 or Arm)
  auto* out = reinterpret_cast<std::uint16_t*>(dst);
  const auto* latent = reinterpret_cast<const float8_e4m3fn*>(record);
  const auto low_mask = hn::Set(du, 0xFFFFu);
  for (size_t g = 0; g < dc / kGroup; ++g) {
    const FloatVec scale = hn::Set(df, rec.scale(record, static_cast<int64_t>(g)));
    auto low_bits = hn::Zero(du);
    for (size_t c = g * kGroup; c < (g + 1) * kGroup; c += lanes) {
      const auto bits = hn::BitCast(du, hn::Mul(LoadWidened(df, latent + c), scale));
      low_bits = hn::Or(low_bits, hn::And(bits, low_mask));
      hn::StoreU(hn::DemoteTo(dh, hn::BitCast(di, hn::ShiftRight<16>(bits))), dh, out + c);
    }
    if (!hn::AllTrue(du, hn::Eq(low_bits, hn::Zero(du)))) return false;
  }
  std::memcpy(dst + dc, rec.rope(record), dr * sizeof(bfloat16));  // k_pe: bfloat16 already
  return true;
}

void RunTask(const detail::RecordsProblem& problem, const records::RowKeys& keys, const records::Task& task,
             Scratch& s, float* part_out, float* part_lse) {
  const auto& dense = *problem.dense;
  const auto& rec = problem.records;
  const detail::Extents& e = dense.extents;
  const auto rows = dense.rows();
  const int64_t b = keys.sequence[static_cast<std::size_t>(task.row)], i = keys.query[static_cast<std::size_t>(task.row)];
  const size_t heads = static_cast<size_t>(e.q_heads), d = static_cast<size_t>(e.head_dim);
  const size_t dc = static_cast<size_t>(rec.dc), lanes = VectorLanes();
  // The latent step's products on the AMX tiles: one configuration for the task (no hook
  // runs here: score_mod is refused above).
  const amx::TileScope tile_scope(s.latent && s.lat.amx);
  const float scale = static_cast<float>(dense.scale);
  const size_t record_bytes = static_cast<size_t>(mla_record_bytes(rec.dc, rec.dr));
  for (size_t h = 0; h < heads; ++h) {
    const float* q = rows.q(b, i, static_cast<int64_t>(h));
    float* to = s.queries.get() + h * s.d_pad;
    for (size_t c = 0; c < d; ++c) to[c] = scale * q[c];
    std::fill(to + d, to + s.d_pad, 0.0f);
  }
  if (s.latent) {  // unscaled, rounded to bfloat16 once (the products are exact then)
    for (size_t h = 0; h < heads; ++h) {
      const float* q = rows.q(b, i, static_cast<int64_t>(h));
      for (size_t c = 0; c < d; ++c) s.lat.q_rows[h * d + c] = bfloat16(q[c]);
    }
    PackLatentQueryRows(heads, d, s.lat);
  }
  std::fill(s.m.begin(), s.m.end(), kMinusInf);
  std::fill(s.l.begin(), s.l.end(), 0.0f);
  std::fill(s.acc.get(), s.acc.get() + heads * s.dc_pad, 0.0f);

  for (int64_t t = 0; t < std::min<int64_t>(kBlockKeys, task.count); ++t)
    PrefetchRow(rec.row(b, keys.at(task.row, task.first + t)), record_bytes);
  // On spans: the bf16-exact blocks packed so far into the span not yet attended (whole
  // blocks of 64 = amx::kKeyBlock records, then at most one partial: the task's last).
  // A block the float step takes in between goes first: the online softmax's result does
  // not depend on the order of its blocks.
  size_t span_keys = 0;
  const auto attend_span = [&] {
    if (span_keys == 0) return;
    AttendPackedSpan(heads, 1, &span_keys, s.m.data(), s.l.data(), s.acc.get(), s.dc_pad, s.alpha.data(), s.lat,
                     span_keys, d, dc, scale);
    span_keys = 0;
  };
  for (int64_t start = 0; start < task.count; start += static_cast<int64_t>(kBlockKeys)) {
    const size_t n = static_cast<size_t>(std::min<int64_t>(kBlockKeys, task.count - start));
    const size_t padded = round_up(n, lanes);
    const auto record_of = [&](size_t j) {
      return rec.row(b, keys.at(task.row, task.first + start + static_cast<int64_t>(j)));
    };
    // Record j of the next block is prefetched (decode_tiles-inl.h's PrefetchRow, the
    // split-K schedule's hint and partial last line) after record j of this one: spread
    // over the block, a few lines in flight at a time.
    const int64_t next = task.first + start + static_cast<int64_t>(n);
    const size_t ahead = static_cast<size_t>(std::min<int64_t>(kBlockKeys, task.first + task.count - next));
    const auto prefetch = [&](size_t j) {
      if (j < ahead) PrefetchRow(rec.row(b, keys.at(task.row, next + static_cast<int64_t>(j))), record_bytes);
    };
    // The latent step's bfloat16 rows straight from the records, written where
    // LatentBlock gathers its keys (on spans: where PackSpanPart gathers a part's); the
    // first record that is not bf16-exact sends the block to the float step.
    bool halves = s.latent;
    size_t converted = 0;
    bfloat16* const half_rows = s.lat.spans ? reinterpret_cast<bfloat16*>(s.lat.span_rows.data()) : s.lat.keys.data();
    for (; halves && converted < n; ++converted) {
      bfloat16* row = half_rows + converted * d;
      halves = RecordHalves(rec, record_of(converted), row);
      s.half_ptrs[converted] = row;
      prefetch(converted);
    }
    if (halves && s.lat.spans) {  // into the span; attended when it is whole
      PackSpanPart(s.lat, span_keys, n, d, d, dc, s.half_ptrs.data(), static_cast<const bfloat16* const*>(nullptr),
                   s.half_ptrs.data());
      span_keys += n;
      if (span_keys == amx::kSpanKeys) attend_span();
      continue;
    }
    if (!halves)
      for (size_t j = 0; j < n; ++j) {
        WidenRecord(rec, record_of(j), s.rows.get() + j * s.d_pad, s.d_pad);
        if (j >= converted) prefetch(j);
      }
    if (halves) {
      LatentBlock<bfloat16>(heads, s.m.data(), s.l.data(), s.acc.get(), s.alpha.data(), s.lat, n, d, d, dc, s.dc_pad,
                            scale, s.half_ptrs.data(), nullptr, s.half_ptrs.data(), nullptr, nullptr,
                            Ahead<bfloat16>{}, Ahead<bfloat16>{});
      continue;
    }
    for (size_t j = 0; j < padded; ++j) s.row_ptrs[j] = s.rows.get() + std::min(j, n - 1) * s.d_pad;
    for (size_t j = 0; j < padded; j += lanes)
      ScoreKeys(heads, s.queries.get(), s.d_pad, s.row_ptrs.data() + j, s.d_pad, Ahead<float>{}, s.scores.get() + j,
                kBlockKeys);
    // The score pipeline per head (soft-cap); its mask stage removes the padding.
    for (size_t h = 0; h < heads; ++h)
      detail::apply_score_pipeline(
          dense.modifiers,
          RowStages{.rule = dense.mask, .mods = dense.modifiers, .batch = b, .head = static_cast<int64_t>(h),
                    .query = i, .first_key = 0, .keys = n, .padded = padded, .key_begin = 0,
                    .key_end = static_cast<int64_t>(n), .s = s.scores.get() + h * kBlockKeys});
    SoftmaxRows(heads, padded, s.scores.get(), kBlockKeys, s.m.data(), s.l.data(), s.alpha.data());
    ValueBlock(heads, s.scores.get(), kBlockKeys, n, s.row_ptrs.data(), dc, Ahead<float>{}, s.alpha.data(),
               s.acc.get(), s.dc_pad);
  }
  attend_span();

  for (size_t h = 0; h < heads; ++h) {
    float* out = part_out + h * dc;
    const float* acc = s.acc.get() + h * s.dc_pad;
    if (s.l[h] == 0.0f) {  // every score of the chunk −inf: no weight
      std::fill(out, out + dc, 0.0f);
      part_lse[h] = kMinusInf;
      continue;
    }
    const float factor = 1.0f / s.l[h];
    for (size_t c = 0; c < dc; ++c) out[c] = acc[c] * factor;
    part_lse[h] = s.m[h] + std::log(s.l[h]);
  }
}

void RecordsDecodeImpl(const detail::RecordsProblem& problem) {
  const auto& dense = *problem.dense;
  const detail::Extents& e = dense.extents;
  const int64_t heads = e.q_heads, dc = problem.records.dc;

  // Every row, its keys, then its chunks.
  records::RowKeys keys;
  for (int64_t b = 0; b < e.batch; ++b)
    for (int64_t i = 0; i < dense.mask.q_len(b); ++i) {
      keys.sequence.push_back(b);
      keys.query.push_back(i);
    }
  const auto row_count = static_cast<int64_t>(keys.sequence.size());
  if (row_count == 0) {
    if (problem.before_reading) problem.before_reading();
    return;
  }
  keys.count.resize(static_cast<std::size_t>(row_count));
  if (problem.keys != nullptr) {
    keys.topk = problem.keys->topk;
    keys.position.resize(static_cast<std::size_t>(row_count * keys.topk));
    std::vector<uint64_t> marks = problem.keys->marks_for(e.k_len);
    for (int64_t row = 0; row < row_count; ++row)
      keys.count[static_cast<std::size_t>(row)] = problem.keys->attended_keys(
          dense.mask, keys.sequence[static_cast<std::size_t>(row)], 0, keys.query[static_cast<std::size_t>(row)],
          keys.position.data() + row * keys.topk, marks);
  } else {
    for (int64_t row = 0; row < row_count; ++row)
      keys.count[static_cast<std::size_t>(row)] =
          dense.mask.key_end(keys.sequence[static_cast<std::size_t>(row)], keys.query[static_cast<std::size_t>(row)]);
  }
  const std::optional<Bf16Unit> latent_unit = RecordLatentUnit(dense);
  // The bf16-exact blocks on the AMX spans (512 records a span, the heads its rows) where
  // qkv::decode's latent step would take them, else the column step.
  const bool spans = latent_unit.has_value() && latent_spans_pay(*latent_unit, heads);
  std::vector<records::Task> tasks;
  std::vector<int64_t> first_slot(static_cast<std::size_t>(row_count + 1), 0);
  for (int64_t row = 0; row < row_count; ++row) {
    const int64_t count = keys.count[static_cast<std::size_t>(row)];
    const int64_t step = records::chunk_keys(count, spans);
    for (int64_t first = 0; first < count; first += step)
      tasks.push_back({row, first, std::min(step, count - first), static_cast<int64_t>(tasks.size())});
    first_slot[static_cast<std::size_t>(row + 1)] = static_cast<int64_t>(tasks.size());
  }

  // Workspace before the parallel region (a failed allocation throws here, not in a thread,
  // and before before_reading).
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(dense.threads, static_cast<int64_t>(tasks.size()))));
  std::vector<float> part_out(tasks.size() * static_cast<std::size_t>(heads * dc));
  std::vector<float> part_lse(tasks.size() * static_cast<std::size_t>(heads));
  std::vector<Scratch> scratch;
  scratch.reserve(static_cast<std::size_t>(threads));
  for (int t = 0; t < threads; ++t)
    scratch.emplace_back(static_cast<size_t>(heads), static_cast<size_t>(e.head_dim), static_cast<size_t>(dc),
                         latent_unit, spans);
  std::vector<float> merged_rows(static_cast<std::size_t>(threads * dc));  // one row per thread, for the merge
  if (problem.before_reading) problem.before_reading();
  const auto task_count = static_cast<int64_t>(tasks.size());
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t t = 0; t < task_count; ++t) {
    const records::Task& task = tasks[static_cast<std::size_t>(t)];
    RunTask(problem, keys, task, scratch[static_cast<std::size_t>(omp_get_thread_num())],
            part_out.data() + task.slot * heads * dc, part_lse.data() + task.slot * heads);
  }

  // Each row's chunks merged in order, then its sink; written once.
  const auto rows = dense.rows();
  const auto& sinks = dense.modifiers.sinks;
  const bool want_lse = !dense.args.lse.empty();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t row = 0; row < row_count; ++row) {
    const int64_t b = keys.sequence[static_cast<std::size_t>(row)], i = keys.query[static_cast<std::size_t>(row)];
    const std::span<float> merged(merged_rows.data() + omp_get_thread_num() * dc, static_cast<std::size_t>(dc));
    for (int64_t h = 0; h < heads; ++h) {
      std::fill(merged.begin(), merged.end(), 0.0f);
      float lse = kMinusInf;
      for (int64_t slot = first_slot[static_cast<std::size_t>(row)]; slot < first_slot[static_cast<std::size_t>(row + 1)]; ++slot)
        detail::merge_lse_row(merged.data(), 1, lse, part_out.data() + (slot * heads + h) * dc, 1,
                              part_lse[static_cast<std::size_t>(slot * heads + h)], dc);
      float factor = 1.0f;
      if (!sinks.empty()) {  // one more softmax entry without a value
        const double sink = sinks[static_cast<std::size_t>(h)];
        if (lse == kMinusInf) {
          factor = 0.0f;
          lse = static_cast<float>(sink);
        } else {
          const double top = std::max<double>(lse, sink);
          const double keep = std::exp(static_cast<double>(lse) - top), total = keep + std::exp(sink - top);
          factor = static_cast<float>(keep / total);
          lse = static_cast<float>(top + std::log(total));
        }
      }
      float* out = rows.out(b, i, h);
      for (int64_t c = 0; c < dc; ++c) out[c] = merged[static_cast<std::size_t>(c)] * factor;
      if (want_lse) rows.lse(b, h, i) = lse;
    }
  }
}

}  // namespace

void MlaRecordsDecode(const detail::RecordsProblem& problem) { RecordsDecodeImpl(problem); }

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::cpu {
HWY_EXPORT(MlaRecordsDecode);

void mla_records_decode(const detail::RecordsProblem& problem) {
  apply_simd_target_override();
  HWY_DYNAMIC_DISPATCH(MlaRecordsDecode)(problem);
}
}  // namespace qkv::cpu
#endif
