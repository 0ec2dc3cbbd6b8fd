#include "core/tile_plan.hpp"

#include <algorithm>
#include <limits>

#include "core/checked_size.hpp"

namespace qkv::detail {
namespace {

// Errors of the plan name what it was built for; its extents are the call's.
constexpr const char kPlanName[] = "qkv (the tile plan of an attention call)";

// What one key block of one mask row holds, as bits (summaries of the elementwise masks
// only; causality and key padding are applied on top).
constexpr std::uint8_t kAnyNormal = 1;  // a kept key whose bias is above kRemovalBias (or NaN)
constexpr std::uint8_t kAnySoft = 2;    // a kept key with a finite bias ≤ kRemovalBias
constexpr std::uint8_t kAllNeutral = 4; // every key kept with bias exactly 0
constexpr std::uint8_t kAllHard = 8;    // every key removed by keep = false or bias = −inf

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// Below this many mask bytes (or tiles) one thread plans faster than a parallel region.
constexpr double kParallelPlanWork = 1 << 20;

bool varies(const View4<const std::uint8_t>& keep, const View4<const float>& bias, int axis) {
  return (!keep.empty() && keep.strides[axis] != 0) || (!bias.empty() && bias.strides[axis] != 0);
}

}  // namespace

// Summary bits of keys [kb·block_k, (kb+1)·block_k) of mask row (b, h, i), for every kb.
void TilePlan::summarize(int64_t b, int64_t h, int64_t i, std::uint8_t* out) const {
  const MaskRule& m = *mask_;
  const int64_t k_len = m.sequences.k_len(b);
  const std::uint8_t* keep = m.keep.empty() ? nullptr : &m.keep(b, h, i, 0);
  const float* bias = m.bias.empty() ? nullptr : &m.bias(b, h, i, 0);
  const int64_t keep_step = m.keep.empty() ? 0 : m.keep.strides[3];
  const int64_t bias_step = m.bias.empty() ? 0 : m.bias.strides[3];
  for (int64_t kb = 0; kb * block_k_ < k_len; ++kb) {
    const int64_t start = kb * block_k_, end = std::min(start + block_k_, k_len);
    // Branch-free flags over the block so the compiler can vectorize the loop.
    bool any_normal = false, any_soft = false, all_neutral = true, all_hard = true;
    for (int64_t j = start; j < end; ++j) {
      const bool kept = keep == nullptr || keep[j * keep_step] != 0;
      const float value = bias == nullptr ? 0.0f : bias[j * bias_step];
      const bool removed_hard = !kept || value == kMinusInf;
      const bool soft = value <= MaskRule::kRemovalBias;  // −inf included; NaN not
      any_normal |= kept & !soft;
      any_soft |= !removed_hard & soft;
      all_neutral &= kept & (value == 0.0f);
      all_hard &= removed_hard;
    }
    out[kb] = static_cast<std::uint8_t>((any_normal ? kAnyNormal : 0) | (any_soft ? kAnySoft : 0) |
                                        (all_neutral ? kAllNeutral : 0) |
                                        (all_hard ? kAllHard : 0));
  }
}

// MaskRule::degenerate_row from the block summaries, exact on the block that key_end
// cuts; for a degenerate row, its largest bias (the shift the kernels subtract), else 0.
float TilePlan::degenerate_shift(int64_t b, int64_t h, int64_t i,
                                 const std::uint8_t* summary) const {
  const int64_t key_begin = mask_->key_begin(b, i), key_end = mask_->key_end(b, i);
  bool any_soft = false;
  for (int64_t kb = key_begin / block_k_; kb * block_k_ < key_end; ++kb) {
    const int64_t start = kb * block_k_, end = start + block_k_;
    if (start >= key_begin && end <= key_end) {  // the whole block: its summary
      if (summary[kb] & kAnyNormal) return 0.0f;
      any_soft = any_soft || (summary[kb] & kAnySoft);
      continue;
    }
    for (int64_t j = std::max(start, key_begin); j < std::min(end, key_end); ++j) {
      if (!mask_->keeps(b, h, i, j)) continue;
      const float value = mask_->bias_at(b, h, i, j);
      if (!(value <= MaskRule::kRemovalBias)) return 0.0f;
      any_soft = any_soft || value != kMinusInf;
    }
  }
  if (!any_soft) return 0.0f;
  // Rare (padding queries): one exact pass over the row for its largest bias.
  float shift = kMinusInf;
  for (int64_t j = key_begin; j < key_end; ++j)
    if (mask_->keeps(b, h, i, j)) shift = std::max(shift, mask_->bias_at(b, h, i, j));
  return shift;
}

TilePlan::TilePlan(const MaskRule& mask, const Extents& e, int64_t block_queries,
                   int64_t block_keys, int threads)
    : mask_(&mask),
      block_q_(block_queries),
      block_k_(block_keys),
      q_rows_(e.q_len),
      q_blocks_(ceil_div(e.q_len, block_queries)),
      k_blocks_(ceil_div(e.k_len, block_keys)),
      per_head_(varies(mask.keep, mask.bias, 1) ||
                (mask.has_mask_mod() && mask.mask_mod.varies_with_head)),
      plan_heads_(per_head_ ? static_cast<std::size_t>(e.q_heads) : 1),
      batch_(e.batch),
      q_heads_(e.q_heads),
      kv_heads_(e.kv_heads) {
  // The plan's sizes are products of the call's extents (a view may repeat one row over
  // 2^31 queries with stride 0): checked, and an allocation that fails is a qkv::Error.
  const auto heads = static_cast<int64_t>(plan_heads_);
  const std::size_t row_blocks = static_cast<std::size_t>(checked_product(
      kPlanName, "the tile plan's query blocks",
      {{"batch", batch_}, {"query heads", heads}, {"query blocks of 64", q_blocks_}}));
  const std::size_t tile_count = checked_bytes(
      kPlanName, "the tile plan",
      {{"batch", batch_}, {"query heads", heads}, {"query blocks of 64", q_blocks_}, {"key blocks of 64", k_blocks_}},
      sizeof(Tile));
  const std::size_t columns = checked_bytes(
      kPlanName, "the tile plan's key blocks", {{"batch", batch_}, {"kv heads", kv_heads_}, {"key blocks", k_blocks_}}, 1);
  allocate_or_throw(kPlanName, "the tile plan", tile_count + 3 * 4 * row_blocks + columns, [&] {
    classes_.assign(tile_count, Tile::empty);
    busy_.assign(row_blocks, 0);
    first_.assign(row_blocks, 0);
    last_.assign(row_blocks, -1);
    partial_columns_.assign(columns, 0);
  });
  const double tiles = static_cast<double>(classes_.size());

  if (mask.has_elementwise()) {
    classify_with_elementwise(e, threads);
  } else {
#pragma omp parallel for num_threads(tiles > kParallelPlanWork ? threads : 1) schedule(static)
    for (int64_t b = 0; b < batch_; ++b) classify_without_elementwise(b);
  }
  if (mask.has_mask_mod()) classify_with_mask_mod(threads);
  finish(e.group());
}

void TilePlan::classify_with_elementwise(const Extents& e, int threads) {
  const MaskRule& mask = *mask_;
  const double tiles = static_cast<double>(classes_.size());
  // Distinct mask rows: an axis the masks broadcast over is summarized once.
  const int64_t mask_batches = varies(mask.keep, mask.bias, 0) ? batch_ : 1;
  const int64_t mask_heads = varies(mask.keep, mask.bias, 1) ? q_heads_ : 1;
  const bool per_query = varies(mask.keep, mask.bias, 2);
  const int64_t mask_queries = per_query ? q_rows_ : 1;
  const std::size_t stride = static_cast<std::size_t>(k_blocks_);
  const int64_t mask_rows = mask_batches * mask_heads * mask_queries;  // ≤ the plan's rows
  const std::size_t summary_bytes = checked_bytes(
      kPlanName, "the mask summaries", {{"mask rows", mask_rows}, {"key blocks", k_blocks_}}, 1);
  std::vector<std::uint8_t> summaries;
  allocate_or_throw(kPlanName, "the mask summaries", summary_bytes, [&] { summaries.resize(summary_bytes); });
  const double mask_bytes = static_cast<double>(mask_rows) * static_cast<double>(e.k_len);
#pragma omp parallel for num_threads(mask_bytes > kParallelPlanWork ? threads : 1) schedule(static)
  for (int64_t row = 0; row < mask_rows; ++row) {
    const int64_t i = row % mask_queries, h = row / mask_queries % mask_heads,
                  b = row / (mask_queries * mask_heads);
    summarize(b, h, i, summaries.data() + static_cast<std::size_t>(row) * stride);
  }

  // Views into the summaries per batch entry and head; rows repeat along broadcast axes.
  auto summary_of = [&, mask_batches, mask_heads, mask_queries](int64_t b, int64_t h, int64_t i) {
    const int64_t row = ((mask_batches > 1 ? b : 0) * mask_heads + (mask_heads > 1 ? h : 0)) *
                            mask_queries +
                        (mask_queries > 1 ? i : 0);
    return summaries.data() + static_cast<std::size_t>(row) * stride;
  };

  if (!mask.bias.empty() && !mask.has_sinks) {
    const std::size_t shift_bytes = checked_bytes(
        kPlanName, "the degenerate-row shifts",
        {{"batch", batch_}, {"query heads", static_cast<int64_t>(plan_heads_)}, {"queries", q_rows_}}, sizeof(float));
    allocate_or_throw(kPlanName, "the degenerate-row shifts", shift_bytes,
                      [&] { degenerate_.assign(shift_bytes / sizeof(float), 0.0f); });
#pragma omp parallel for num_threads(mask_bytes > kParallelPlanWork ? threads : 1) schedule(static)
    for (int64_t bh = 0; bh < batch_ * static_cast<int64_t>(plan_heads_); ++bh) {
      const int64_t b = bh / static_cast<int64_t>(plan_heads_),
                    h = bh % static_cast<int64_t>(plan_heads_);
      float* shifts = degenerate_.data() + static_cast<std::size_t>(bh * q_rows_);
      for (int64_t i = 0; i < mask.q_len(b); ++i)
        shifts[i] = degenerate_shift(b, h, i, summary_of(b, h, i));
    }
  }

  const int64_t pairs = batch_ * static_cast<int64_t>(plan_heads_);
#pragma omp parallel for num_threads(tiles * static_cast<double>(block_q_) > kParallelPlanWork ? threads : 1) \
    schedule(dynamic, 1)
  for (int64_t bh = 0; bh < pairs; ++bh) {
    const int64_t b = bh / static_cast<int64_t>(plan_heads_),
                  h = bh % static_cast<int64_t>(plan_heads_);
    const float* shifts = degenerate_rows(b, h, 0);
    const int64_t q_len = mask.q_len(b), k_len = mask.sequences.k_len(b);
    for (int64_t qb = 0; qb * block_q_ < q_len; ++qb) {
      Tile* row = classes_.data() + tile_index(b, h, qb);
      const int64_t first = qb * block_q_, last = std::min(first + block_q_, q_len);
      for (int64_t kb = 0; kb * block_k_ < k_len; ++kb) {
        const int64_t start = kb * block_k_, end = std::min(start + block_k_, k_len);
        bool all_empty = true, all_full = true;
        for (int64_t i = first; i < last && (all_empty || all_full); ++i) {
          const int64_t key_begin = mask.key_begin(b, i), key_end = mask.key_end(b, i);
          if (start >= key_end || end <= key_begin) {
            all_full = false;
            continue;
          }
          const std::uint8_t s = summary_of(b, h, i)[kb];
          const bool literal = shifts != nullptr && shifts[i] != 0.0f;
          const bool removed = literal ? (s & kAllHard) != 0 : (s & kAnyNormal) == 0;
          if (removed) {
            all_full = false;
            continue;
          }
          all_empty = false;
          if (start < key_begin || end > key_end || !(s & kAllNeutral)) all_full = false;
        }
        row[kb] = all_empty ? Tile::empty : all_full ? Tile::full : Tile::partial;
      }
    }
  }
}

// mask_mod on top of the classes of the other masks: every tile they leave is evaluated
// over the pairs they leave (each row's [key_begin, key_end) within the tile), through one
// call of the user's tile loop. None kept: empty; all kept of a full tile: full; else
// partial. A tile mask.keep alone would empty may stay partial: still exact, as the kernel
// masks it elementwise.
void TilePlan::classify_with_mask_mod(int threads) {
  const MaskRule& m = *mask_;
  const MaskModHook& mod = m.mask_mod;
  const int64_t heads = static_cast<int64_t>(plan_heads_);
  const int64_t row_blocks = batch_ * heads * q_blocks_;
  const double pairs = static_cast<double>(classes_.size()) * static_cast<double>(block_q_ * block_k_);
#pragma omp parallel for num_threads(pairs > kParallelPlanWork ? threads : 1) schedule(dynamic, 1)
  for (int64_t index = 0; index < row_blocks; ++index) {
    const int64_t qb = index % q_blocks_, plan_head = index / q_blocks_ % heads,
                  b = index / (q_blocks_ * heads);
    const int64_t first = qb * block_q_, q_len = m.q_len(b), k_len = m.sequences.k_len(b);
    if (first >= q_len) continue;
    const int64_t count = std::min(block_q_, q_len - first);
    const auto n = static_cast<std::size_t>(count);
    std::vector<int32_t> row_begin(n), row_end(n), begin(n), end(n);
    for (std::size_t r = 0; r < n; ++r) {
      row_begin[r] = static_cast<int32_t>(m.key_begin(b, first + static_cast<int64_t>(r)));
      row_end[r] = static_cast<int32_t>(m.key_end(b, first + static_cast<int64_t>(r)));
    }
    Tile* row = classes_.data() + tile_index(b, plan_head, qb);
    for (int64_t kb = 0; kb * block_k_ < k_len; ++kb) {
      if (row[kb] == Tile::empty) continue;
      const auto start = static_cast<int32_t>(kb * block_k_);
      const auto stop = static_cast<int32_t>(std::min((kb + 1) * block_k_, k_len));
      int64_t visible = 0;
      for (std::size_t r = 0; r < n; ++r) {
        begin[r] = std::clamp(row_begin[r], start, stop);
        end[r] = std::max(begin[r], std::min(row_end[r], stop));
        visible += end[r] - begin[r];
      }
      const hooks::MaskCount rows{.batch = b, .head = plan_head, .first_query = first,
                                  .queries = count, .key_begin = begin.data(),
                                  .key_end = end.data()};
      const int64_t kept = visible == 0 ? 0 : mod.count(mod.context, rows);
      row[kb] = kept == 0                                    ? Tile::empty
                : row[kb] == Tile::full && kept == visible ? Tile::full
                                                           : Tile::partial;
    }
  }
}

// Causality, key padding and the window alone: a query block's rows see [begin, end)
// with both bounds never decreasing along the rows, so the first and last rows bound
// the block; a tile between those bounds is checked row by row (windows only).
void TilePlan::classify_without_elementwise(int64_t b) {
  const MaskRule& m = *mask_;
  const int64_t q_len = m.q_len(b), k_len = m.sequences.k_len(b);
  for (int64_t qb = 0; qb * block_q_ < q_len; ++qb) {
    const int64_t first = qb * block_q_, last = std::min(first + block_q_, q_len) - 1;
    const int64_t min_end = m.key_end(b, first), max_end = m.key_end(b, last);
    const int64_t min_begin = m.key_begin(b, first), max_begin = m.key_begin(b, last);
    Tile* row = classes_.data() + tile_index(b, 0, qb);
    for (int64_t kb = 0; kb * block_k_ < k_len; ++kb) {
      const int64_t start = kb * block_k_, end = std::min(start + block_k_, k_len);
      if (start >= max_end || end <= min_begin) {
        row[kb] = Tile::empty;
      } else if (start >= max_begin && end <= min_end) {
        row[kb] = Tile::full;
      } else {
        bool any = false;  // does some row's [begin, end) meet the tile?
        for (int64_t i = first; i <= last && !any; ++i)
          any = start < m.key_end(b, i) && end > m.key_begin(b, i) &&
                m.key_begin(b, i) < m.key_end(b, i);
        row[kb] = any ? Tile::partial : Tile::empty;
      }
    }
    // Per-head classes (a head-dependent mask_mod refines them next) start alike.
    for (std::size_t ph = 1; ph < plan_heads_; ++ph)
      std::copy(row, row + k_blocks_, classes_.data() + tile_index(b, static_cast<int64_t>(ph), qb));
  }
}

// Per query block: how many key blocks have work and where they lie; per key block:
// whether any tile reading it is partial (those key blocks get the non-finite scan).
void TilePlan::finish(int64_t group) {
  for (int64_t b = 0; b < batch_; ++b)
    for (std::size_t ph = 0; ph < plan_heads_; ++ph)
      for (int64_t qb = 0; qb < q_blocks_; ++qb) {
        const std::size_t index = row_block_index(b, static_cast<int64_t>(ph), qb);
        const Tile* row = classes_.data() + index * static_cast<std::size_t>(k_blocks_);
        int32_t busy = 0, first = static_cast<int32_t>(k_blocks_), last = -1;
        for (int64_t kb = 0; kb < k_blocks_; ++kb) {
          if (row[kb] == Tile::empty) continue;
          ++busy;
          first = std::min(first, static_cast<int32_t>(kb));
          last = static_cast<int32_t>(kb);
          if (row[kb] != Tile::partial) continue;
          // Without per-head classes, every kv head sees this tile.
          const int64_t kv_first = per_head_ ? static_cast<int64_t>(ph) / group : 0;
          const int64_t kv_last = per_head_ ? kv_first + 1 : kv_heads_;
          for (int64_t kv = kv_first; kv < kv_last; ++kv)
            partial_columns_[static_cast<std::size_t>((b * kv_heads_ + kv) * k_blocks_ + kb)] = 1;
        }
        busy_[index] = busy;
        first_[index] = first;
        last_[index] = last;
      }
}

}  // namespace qkv::detail
