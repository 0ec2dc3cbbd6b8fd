// Latent attention (qkv::mla_decode) over a bfloat16 cache on the bf16 dot products
// (AVX512-BF16's vdpbf16ps, or the AMX tiles where the call's precision picks them): the
// split-K schedule's block step for that one case, where the work per cached byte is
// large (H query heads, up to 16 queries, against one latent kv head: 128·(d + dv)
// multiply-adds per 2·(d + dv) bytes at DeepSeek's shape), so the FMA rate, not the
// memory, sets the pace, and vdpbf16ps doubles it (the tiles more: bench/RESULTS.md §13).
//
// Numerics (Precision::fast, the bf16 contract of docs/numerics.md): each query row is
// rounded to bfloat16 once per task, and each weight P once (bf16_dot.hpp); keys and
// values are the cache's bfloat16 values, products exact, every sum float32. The softmax
// state (m, l, acc) is the float kernel's, so blocks this step takes and blocks the float
// step takes (partly visible ones, a float window) mix in one row.
//
// Layout: the block's keys are gathered into whole bf16 rows (latent part then rotary
// part: the cache keeps them apart), scored transposed — Sᵀ[j][r], the tile's rows in
// the lanes — by bf16dot::ScoresTransposed (amx::ScoresTransposed); the online softmax
// runs down the columns (vectors of rows); bf16dot::AddWeightedPairs adds P·V from Pᵀ and
// the values' pairs (amx::RescaleAddWeighted, which adds it onto acc in the tiles).
//
// On the AMX tiles a bfloat16 cache takes LatentSpan instead (the bottom of this file):
// blocks of 512 keys in the row layout of the forward's row kernel (amx_rows.hpp), which
// loads and stores the rows' accumulators once per 512 keys instead of once per block of
// 32–96 (at 128 heads × 512 values those accumulators are 256 KiB: the column step's
// tiles spent much of their time moving them).
#if defined(QKV_CPU_DECODE_LATENT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_DECODE_LATENT_INL_H_
#undef QKV_CPU_DECODE_LATENT_INL_H_
#else
#define QKV_CPU_DECODE_LATENT_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstring>

#include "cpu/amx_dot.hpp"
#include "cpu/amx_rows.hpp"
#include "cpu/dot_products.hpp"
#include "hwy/highway.h"
#include "cpu/bf16_dot.hpp"
#include "cpu/block_ops-inl.h"
#include "cpu/decode_rows-inl.h"
#include "qkv/half.hpp"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {

// Whether a decode call takes LatentBlock: one kv head in bfloat16 — latent attention
// (qkv::mla_decode's c_kv / k_pe, or a combined [c_kv | k_pe] pool through qkv::decode or
// qkv::BatchPlan with v_cache=None) and multi-query attention — whose tiles have whole
// vectors of rows (≥ 16 query heads: the arithmetic per cached byte that makes the dot
// products pay, and no tail for the column softmax), no softcap (the transposed scores
// skip the score pipeline), and a bf16 unit (vdpbf16ps or the AMX tiles) the one the
// call's precision picks. Decided per call, so every row rounds its query alike.
// The storage types the step reads: bfloat16, and float8 (e4m3fn, e5m2), every value of
// which is a bfloat16 value (widened exactly, then its top 16 bits), its row scale applied
// to the block's scores and weights instead (FP8 latent caches, vLLM's layout).
template <class T>
inline constexpr bool kLatentStorage = std::is_same_v<T, bfloat16> || kIsFloat8<T>;

inline bool LatentDots(const detail::ForwardProblem<float>& p, const KvSource& kv, const DecodePlan& plan,
                       bool latent_storage, bool bf16_dots) {
  return latent_storage && bf16_dots && !kv.windowed() && p.extents.kv_heads == 1 && p.modifiers.softcap == 0.0f &&
         !p.modifiers.has_score_mod() && plan.group_rows() % 16 == 0 && p.extents.q_heads % 16 == 0;
}

// s.q_rows's first `rows` rows (d values each) packed for the step the scratch is for:
// LatentSpan's groups of up to 64 rows, each as the tiles load it, or the column step's
// pairs.
inline void PackLatentQueryRows(size_t rows, size_t d, LatentScratch& s) {
  if (s.spans) {
    auto* packed = reinterpret_cast<std::uint16_t*>(s.span_queries.data());
    for (size_t r = 0; r < rows; r += amx::kMaxQueries)
      amx::PackQueryRows(s.q_rows.data() + r * d, static_cast<std::int64_t>(d), std::min(amx::kMaxQueries, rows - r), d,
                         packed + r * amx::query_ld(d));
    return;
  }
  bf16dot::PackQueryPairs(s.q_rows.data(), static_cast<std::int64_t>(d), rows, d, s.q_pairs.data(), s.q_ld);
}

// The tile's query rows (unscaled: the products of two bf16 values are exact in float32,
// scale·q would not be), rounded to bfloat16 once and paired for ScoresTransposed.
template <class Rows>
void PackLatentQueries(const Rows& rows, int64_t batch, int64_t first_query, size_t tile, size_t q_heads, size_t d,
                       LatentScratch& s) {
  for (size_t h = 0; h < q_heads; ++h)
    for (size_t i = 0; i < tile; ++i) {
      const float* q = rows.q(batch, first_query + static_cast<int64_t>(i), static_cast<int64_t>(h));
      bfloat16* to = s.q_rows.data() + (h * tile + i) * d;
      for (size_t c = 0; c < d; ++c) to[c] = bfloat16(q[c]);
    }
  PackLatentQueryRows(q_heads * tile, d, s);
}

// The online-softmax step down the columns of Sᵀ (keys × rows, rows a multiple of the
// vector): m_new = max(m, max_j S[j]), alpha = e^(m − m_new), Pᵀ[j] = e^(S[j] − m_new),
// l = l·alpha + Σ_j P[j] — the float kernel's SoftmaxRows, transposed.
HWY_INLINE void SoftmaxColumns(size_t rows, size_t keys, float* HWY_RESTRICT st, size_t st_ld,
                               float* HWY_RESTRICT m, float* HWY_RESTRICT l, float* HWY_RESTRICT alpha) {
  const FloatTag df;
  const size_t lanes = hn::Lanes(df);
  const FloatVec minus_inf = hn::Set(df, kMinusInf);
  for (size_t r = 0; r < rows; r += lanes) {
    const FloatVec m_old = hn::LoadU(df, m + r);
    FloatVec m_new = m_old;
    for (size_t j = 0; j < keys; ++j) m_new = hn::Max(m_new, hn::LoadU(df, st + j * st_ld + r));
    const auto none = hn::Eq(m_new, minus_inf);  // no key yet: nothing to rescale or shift by
    const FloatVec shift = hn::IfThenZeroElse(none, m_new);
    hn::StoreU(hn::IfThenElse(none, hn::Set(df, 1.0f), ExpKeepNaN(df, hn::Sub(m_old, m_new))), df, alpha + r);
    FloatVec sum = hn::Zero(df);
    for (size_t j = 0; j < keys; ++j) {
      float* at = st + j * st_ld + r;
      const FloatVec pv = ExpKeepNaN(df, hn::Sub(hn::LoadU(df, at), shift));
      hn::StoreU(pv, df, at);
      sum = hn::Add(sum, pv);
    }
    hn::StoreU(hn::MulAdd(hn::LoadU(df, l + r), hn::LoadU(df, alpha + r), sum), df, l + r);
    hn::StoreU(m_new, df, m + r);
  }
}

// dst[0, n) = src[0, n) as bfloat16 rows: copied, or float8 widened into `widened` (n
// floats) and truncated to their top 16 bits, exact for every float8 value.
template <class S>
HWY_INLINE void LatentRow(const S* HWY_RESTRICT src, size_t n, float* HWY_RESTRICT widened, bfloat16* HWY_RESTRICT dst) {
  if constexpr (std::is_same_v<S, bfloat16>) {
    if (src != dst) std::memcpy(dst, src, n * sizeof(bfloat16));  // (FP8 records write their rows in place)
  } else {
    WidenRows(src, 0, 1, n, widened, n);
    for (size_t c = 0; c < n; ++c) {
      std::uint32_t bits;
      std::memcpy(&bits, widened + c, sizeof(bits));
      dst[c] = bfloat16::from_bits(static_cast<std::uint16_t>(bits >> 16));
    }
  }
}

// Row j of a keys × rows tile (ld apart) times factor[j].
HWY_INLINE void ScaleTileRows(float* HWY_RESTRICT tile, size_t ld, size_t keys, size_t rows,
                              const float* HWY_RESTRICT factor) {
  const FloatTag df;
  for (size_t j = 0; j < keys; ++j) {
    const FloatVec f = hn::Set(df, factor[j]);
    for (size_t r = 0; r < rows; r += hn::Lanes(df)) hn::StoreU(hn::Mul(hn::LoadU(df, tile + j * ld + r), f), df, tile + j * ld + r);
  }
}

// One block of keys visible to every row of the tile: K rows (the first d_first channels
// from k_rows, the rest from rope_rows; rope_rows null: d_first = d) and V rows (v_rows; the keys' own first channels
// in latent attention) read from the cache, then the products on vdpbf16ps.
// rows: the tile's (one kv head), their softmax state m, l and acc (dv_pad apart), and
// alpha, scratch of one float per row. The next unit's rows are prefetched key by key,
// as the float step does.
// Float8 storage: k_scales / v_scales, the keys' and values' row scales (null for bfloat16),
// multiply each key's scores before the softmax and its weights after it (P·s_v, rounded
// to bfloat16 once, as P alone is otherwise).
template <class S>
void LatentBlock(size_t rows, float* m, float* l, float* acc, float* alpha, LatentScratch& s, size_t keys, size_t d,
                 size_t d_first, size_t dv, size_t dv_pad, float scale, const S* const* k_rows, const S* const* rope_rows,
                 const S* const* v_rows, const float* k_scales, const float* v_scales, Ahead<S> k_ahead,
                 Ahead<S> rope_ahead) {
  bfloat16* key = s.keys.data();
  bool values_in_keys = true;
  for (size_t j = 0; j < keys; ++j) {
    k_ahead(j);
    LatentRow(k_rows[j], d_first, s.widened.get(), key + j * d);
    if (rope_rows != nullptr) {  // keys in two parts (mla_decode): the rotary part after
      rope_ahead(j);
      LatentRow(rope_rows[j], d - d_first, s.widened.get(), key + j * d + d_first);
    }
    values_in_keys = values_in_keys && v_rows[j] == k_rows[j] && dv <= d_first;
  }
  // One kv head: the group's rows are the whole tile's, the query pairs' every column.
  (s.amx ? amx::ScoresTransposed : bf16dot::ScoresTransposed)(key, static_cast<std::int64_t>(d), keys, d,
                                                              s.q_pairs.data(), s.q_ld, rows, scale, s.st.get(),
                                                              s.st_ld);
  if (k_scales != nullptr) ScaleTileRows(s.st.get(), s.st_ld, keys, rows, k_scales);
  const size_t v_ld = bf16dot::pair_ld(dv);
  if (s.amx) {  // the values' pairs packed there, from the bf16 rows
    const bfloat16* values = key;
    if (!values_in_keys) {
      for (size_t j = 0; j < keys; ++j) LatentRow(v_rows[j], dv, s.widened.get(), s.values.data() + j * dv);
      values = s.values.data();
    }
    SoftmaxColumns(rows, keys, s.st.get(), s.st_ld, m, l, alpha);
    if (v_scales != nullptr) ScaleTileRows(s.st.get(), s.st_ld, keys, rows, v_scales);
    amx::RescaleAddWeighted(s.st.get(), s.st_ld, rows, keys, values, static_cast<std::int64_t>(values_in_keys ? d : dv),
                            dv, {s.p_pairs.data(), s.v_pairs.data()}, acc, dv_pad, alpha);
    return;
  }
  if (values_in_keys) {
    bf16dot::PackRowPairs(key, static_cast<std::int64_t>(d), keys, dv, s.v_pairs.data(), v_ld);
  } else {
    for (size_t j = 0; j < keys; ++j) LatentRow(v_rows[j], dv, s.widened.get(), s.values.data() + j * dv);
    bf16dot::PackRowPairs(s.values.data(), static_cast<std::int64_t>(dv), keys, dv, s.v_pairs.data(), v_ld);
  }
  SoftmaxColumns(rows, keys, s.st.get(), s.st_ld, m, l, alpha);
  if (v_scales != nullptr) ScaleTileRows(s.st.get(), s.st_ld, keys, rows, v_scales);
  bf16dot::AddWeightedPairs(s.st.get(), s.st_ld, rows, keys, s.v_pairs.data(), v_ld, dv, s.p_pairs.data(), acc, dv_pad,
                            alpha);
}

// ---------------------------------------------------------------------------------
// The latent step on the AMX tiles in the row layout (amx_rows.hpp, the forward's row
// kernel): a block of up to amx::kSpanKeys keys is one span — its keys packed into the
// tiles' order and its values into pairs once, then for each group of up to 64 query rows
// S = Q·Kᵀ a row per query, the online softmax along the rows, and bf16(P)·V onto the
// rows' accumulators, loaded into the tiles and stored once per span. The column step
// (LatentBlock on the tiles) stored and reloaded the 128 heads' 512-wide accumulators
// for every 32–96 keys.

// Whether rows[0, n) are equally spaced in memory (one stride; n ≤ 1 always): a
// contiguous cache, or a page of a paged one, packed straight from the cache.
template <class S>
HWY_INLINE bool EquallySpaced(const S* const* rows, size_t n, std::int64_t& stride) {
  stride = n > 1 ? rows[1] - rows[0] : 0;
  for (size_t j = 2; j < n; ++j)
    if (rows[j] - rows[j - 1] != stride) return false;
  return true;
}

// Keys [j0, j0 + n) of a span (n ≤ amx::kKeyBlock, j0 a multiple of it) into the span's
// buffers: K's rows in the tiles' order — the first d_first channels from k_rows, the
// rest from rope_rows (null: d_first = d) — and V's rows (v_rows) as pairs. The row
// pointers are the part's own (k_rows[0] is key j0's). bfloat16 rows are read in place
// where the part's rows are equally spaced, else gathered into whole rows first; float8
// rows are gathered as their bfloat16 values (LatentRow: exact).
template <class S>
void PackSpanPart(LatentScratch& s, size_t j0, size_t n, size_t d, size_t d_first, size_t dv,
                  const S* const* k_rows, const S* const* rope_rows, const S* const* v_rows) {
  const size_t v_ld = bf16dot::pair_ld(dv);
  auto* gathered = reinterpret_cast<bfloat16*>(s.span_rows.data());
  std::uint32_t* k_out = s.span_keys.data() + j0 / amx::kKeyBlock * amx::key_block_words(d);
  if constexpr (!std::is_same_v<S, bfloat16>) {
    for (size_t j = 0; j < n; ++j) {
      LatentRow(k_rows[j], rope_rows != nullptr ? d_first : d, s.widened.get(), gathered + j * d);
      if (rope_rows != nullptr) LatentRow(rope_rows[j], d - d_first, s.widened.get(), gathered + j * d + d_first);
    }
    amx::PackKeyPairs(gathered, static_cast<std::int64_t>(d), n, d, k_out);
    for (size_t j = 0; j < n; ++j) LatentRow(v_rows[j], dv, s.widened.get(), gathered + j * dv);
    bf16dot::PackRowPairs(gathered, static_cast<std::int64_t>(dv), n, dv, s.span_values.data() + j0 / 2 * v_ld, v_ld);
  } else {
    const bool split = rope_rows != nullptr && d_first % 32 == 0;  // the parts' tiles apart
    std::uint32_t* v_out = s.span_values.data() + j0 / 2 * v_ld;
    std::int64_t k_stride = 0, rope_stride = 0, v_stride = 0;
    const bool k_direct =
        EquallySpaced(k_rows, n, k_stride) && (rope_rows == nullptr || (split && EquallySpaced(rope_rows, n, rope_stride)));
    if (k_direct) {
      amx::PackKeyPairs(k_rows[0], k_stride, n, rope_rows != nullptr ? d_first : d, k_out);
      if (rope_rows != nullptr)
        amx::PackKeyPairs(rope_rows[0], rope_stride, n, d - d_first, k_out + amx::key_block_words(d_first));
    } else {
      for (size_t j = 0; j < n; ++j) {
        std::memcpy(gathered + j * d, k_rows[j], (rope_rows != nullptr ? d_first : d) * sizeof(bfloat16));
        if (rope_rows != nullptr) std::memcpy(gathered + j * d + d_first, rope_rows[j], (d - d_first) * sizeof(bfloat16));
      }
      amx::PackKeyPairs(gathered, static_cast<std::int64_t>(d), n, d, k_out);
    }
    if (EquallySpaced(v_rows, n, v_stride)) {
      bf16dot::PackRowPairs(v_rows[0], v_stride, n, dv, v_out, v_ld);
    } else {
      for (size_t j = 0; j < n; ++j) std::memcpy(gathered + j * dv, v_rows[j], dv * sizeof(bfloat16));
      bf16dot::PackRowPairs(gathered, static_cast<std::int64_t>(dv), n, dv, v_out, v_ld);
    }
  }
}

// The packed span of `keys` keys (PackSpanPart's) for the rows of the tile (rows r =
// h·tile + i, query i seeing the span's keys [0, visible[i])): for each group of up to
// 64 rows, amx::AttendSpan onto their softmax state m, l and acc (dv_pad apart); alpha,
// scratch of 64 floats. The queries: PackLatentQueryRows's. k_scales / v_scales: a
// float8 cache's row scales of the span's keys (null for bfloat16), on each key's scores
// and on its weights before their rounding, as LatentBlock applies them.
inline void AttendPackedSpan(size_t rows, size_t tile, const size_t* visible, float* m, float* l, float* acc,
                             size_t dv_pad, float* alpha, LatentScratch& s, size_t keys, size_t d, size_t dv,
                             float scale, const float* k_scales = nullptr, const float* v_scales = nullptr) {
  const size_t v_ld = bf16dot::pair_ld(dv);
  // The pair rows the tiles read past the keys (up to whole 32-key steps): zero.
  std::fill(s.span_values.data() + (keys + 1) / 2 * v_ld, s.span_values.data() + round_up(keys, 32) / 2 * v_ld, 0u);
  const auto* queries = reinterpret_cast<const std::uint16_t*>(s.span_queries.data());
  for (size_t r0 = 0; r0 < rows; r0 += amx::kMaxQueries) {
    const size_t count = std::min(amx::kMaxQueries, rows - r0);
    for (size_t r = 0; r < count; ++r) {
      s.span_lo[r] = 0;
      s.span_hi[r] = static_cast<std::int32_t>(visible[(r0 + r) % tile]);
    }
    const amx::Span span{.q = queries + r0 * amx::query_ld(d), .count = count, .d = d, .k_blocks = s.span_keys.data(),
                         .keys = keys, .v_pairs = s.span_values.data(), .v_ld = v_ld, .dv = dv,
                         .lo = s.span_lo.data(), .hi = s.span_hi.data(), .scale = scale,
                         .key_scales = k_scales, .value_scales = v_scales};
    amx::AttendSpan(span,
                    {s.span_scores.get(), LatentScratch::kSpanScoreLd,
                     reinterpret_cast<std::uint16_t*>(s.span_weights.data()), amx::kSpanKeys},
                    {m + r0, l + r0, alpha, acc + r0 * dv_pad, dv_pad});
  }
  count_amx_latent_span();
}

// One block of `keys` keys for the rows of the tile (rows r = h·tile + i, query i seeing
// the block's keys [0, visible[i]) — all of them but in a bottom-right causal step's last
// block): packed (PackSpanPart) and attended (AttendPackedSpan) as one span; float8
// rows with their row scales k_scales / v_scales (null for bfloat16).
// Returns false, having changed nothing, when a key some row must not see has a
// non-finite value (the tiles would add 0·NaN): the float step then takes the block.
template <class S>
bool LatentSpan(size_t rows, size_t tile, const size_t* visible, float* m, float* l, float* acc, size_t dv_pad,
                float* alpha, LatentScratch& s, size_t keys, size_t d, size_t d_first, size_t dv, float scale,
                const S* const* k_rows, const S* const* rope_rows, const S* const* v_rows, const float* k_scales,
                const float* v_scales) {
  if constexpr (!kLatentStorage<S>) {
    (void)rows, (void)tile, (void)visible, (void)m, (void)l, (void)acc, (void)dv_pad, (void)alpha, (void)s, (void)keys,
        (void)d, (void)d_first, (void)dv, (void)scale, (void)k_rows, (void)rope_rows, (void)v_rows, (void)k_scales,
        (void)v_scales;
    return false;
  } else {
    const size_t seen_by_all = *std::min_element(visible, visible + tile);
    for (size_t j = seen_by_all; j < keys; ++j)  // values some row must not see
      if (!AllFinite(v_rows[j], 0, 1, dv)) return false;
    for (size_t j0 = 0; j0 < keys; j0 += amx::kKeyBlock)
      PackSpanPart(s, j0, std::min(amx::kKeyBlock, keys - j0), d, d_first, dv, k_rows + j0,
                   rope_rows != nullptr ? rope_rows + j0 : nullptr, v_rows + j0);
    AttendPackedSpan(rows, tile, visible, m, l, acc, dv_pad, alpha, s, keys, d, dv, scale, k_scales, v_scales);
    return true;
  }
}

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // QKV_CPU_DECODE_LATENT_INL_H_
