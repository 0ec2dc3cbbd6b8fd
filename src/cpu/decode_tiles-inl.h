// The split-K schedule's register tiles (decode.cpp): scores of a group of query rows
// against a vector of keys, and P·V, reading K and V rows in place through row pointers
// (contiguous or paged; any storage type, widened in the loads by storage-inl.h), with
// the next unit's rows prefetched key by key while these compute.
#if defined(QKV_CPU_DECODE_TILES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_DECODE_TILES_INL_H_
#undef QKV_CPU_DECODE_TILES_INL_H_
#else
#define QKV_CPU_DECODE_TILES_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "hwy/aligned_allocator.h"

#include "hwy/highway.h"
#include "cpu/block_ops-inl.h"
#include "cpu/blocking.hpp"
#include "cpu/storage-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {

// Starts moving a row of `bytes` bytes towards the core: the key block after the current
// one, so that its DRAM latency overlaps this block's arithmetic. Into L2 (locality 2):
// a block of one head is up to 64 KiB, more than L1 holds next to the current one.
HWY_INLINE void PrefetchRow(const void* row, size_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
  __builtin_prefetch(p + bytes - 1, 0, 2);  // a row that starts inside a cache line
}

// Rows of a unit of work ahead to prefetch while the kernels read the same-numbered rows
// of this one: spread over the arithmetic key by key, not issued in bursts that would
// fill the core's miss buffers and stall it (rows null: nothing to prefetch).
// Besides the rows, one cache line of `lines` per key (a later unit's scales and zero
// points, decode_rows-inl.h's ScaleLines), so that they too arrive spread over the arithmetic.
template <class S>
struct Ahead {
  const S* const* rows = nullptr;
  size_t count = 0;  // rows[0, count) exist
  size_t bytes = 0;
  const char* const* lines = nullptr;
  size_t line_count = 0;  // lines[0, line_count) exist

  HWY_INLINE void operator()(size_t j) const {
    if (j < count) PrefetchRow(rows[j], bytes);
    if (j < line_count) __builtin_prefetch(lines[j], 0, 2);
  }
  Ahead offset(size_t j) const {
    return Ahead{j < count ? rows + j : nullptr, j < count ? count - j : 0, bytes,
                 j < line_count ? lines + j : nullptr, j < line_count ? line_count - j : 0};
  }
};

// ---------------------------------------------------------------------------------
// Scores of R rows against L = lanes consecutive keys: R vectors, lane t of row r's
// vector = (scale·q_r)·k_t.
//
// Register tile: KL keys × R rows of accumulators with lanes over d; each K vector is
// loaded (and widened) once for all R rows, each Q vector once for KL keys. The KL·R
// accumulators are independent FMA chains (8 of them: FMA latency × ports). Each row's
// KL accumulators are then summed across lanes together by a transpose-add tree: a pair
// (lo, hi) becomes ConcatEven(hi, lo) + ConcatOdd(hi, lo), whose lower half holds lo's
// pairwise lane sums and upper half hi's; after log2 L levels lane t holds key t's dot
// product — L − 1 shuffle pairs per row for L keys instead of a horizontal sum per key.
// Above the leaf the tree runs depth-first (Tree<N> = combine(Tree<N/2>, Tree<N/2>)), so
// only log2 L partial vectors per row are live.

HWY_INLINE FloatVec Combine(FloatVec lo, FloatVec hi) {
#if HWY_TARGET == HWY_SCALAR
  (void)hi;
  return lo;  // one lane: never called with two keys
#else
  const FloatTag df;
  return hn::Add(hn::ConcatEven(df, hi, lo), hn::ConcatOdd(df, hi, lo));
#endif
}

constexpr size_t kLanes = HWY_LANES(float);  // upper bound; equal on fixed-width targets (not SVE)

// Keys per leaf for R rows: 8 accumulator chains on 16-register targets; 16 where there
// are 32 registers (AVX-512, NEON, SVE), so that each loaded query vector feeds 4 keys' FMAs and
// the loads stay below the FMAs (4 rows × 2 keys took 6 loads per 8 FMAs, Zen 4's one
// 512-bit load a cycle then holding the FMAs below 60%: 32/8 d 128 decode from L3). The
// leaf only groups the same per-key sums (each key's chain over d, then the same tree of
// lane sums): any leaf gives the same bits.
#if (HWY_ARCH_X86 && HWY_TARGET >= HWY_AVX2) || HWY_TARGET == HWY_EMU128 || HWY_TARGET == HWY_SCALAR
inline constexpr size_t kScoreChains = 8;
#else
inline constexpr size_t kScoreChains = 16;
#endif
template <size_t R>
constexpr size_t kLeafKeys = std::min<size_t>(kLanes, R >= 4 ? kScoreChains / 4 : R >= 2 ? 4 : 8);

template <size_t N, class Vectors>  // const FloatVec* (a VecSpan on SVE: vec_array-inl.h)
HWY_INLINE FloatVec CombineKeys(Vectors v) {
  if constexpr (N == 1) {
    return v[0];
  } else {
    return Combine(CombineKeys<N / 2>(v), CombineKeys<N / 2>(v + N / 2));
  }
}

// Keys scaled per channel (qkv::KVCache's KeyScales::channel): key_c = level_c·scale_c +
// zero_c, the group's scales and zero points [dim] as floats. The map is applied to every
// loaded key vector with one rounding, so the scores are those of the stored keys up to
// float32's dot-product error relative to Σ|q_c·key_c|. (Summing q·(scale⊙level) and q·zero
// apart instead cancels on a channel with a wide range: a key entry of 1e8 gave zero points
// of 5e7 and moved the scores of rows that never saw it by units, issue 45.)
struct KeyAffine {
  const float* HWY_RESTRICT scale = nullptr;
  const float* HWY_RESTRICT zero = nullptr;
};

// level · scale + zero with one rounding. hn::MulAdd is fused on every target but the
// emulated ones (EMU128, SCALAR: a product then a sum), which take std::fma lane by lane.
HWY_INLINE FloatVec AffineKey(FloatVec level, FloatVec scale, FloatVec zero) {
#if HWY_TARGET == HWY_EMU128 || HWY_TARGET == HWY_SCALAR
  const FloatTag df;
  HWY_ALIGN float l[hn::MaxLanes(df)], s[hn::MaxLanes(df)], z[hn::MaxLanes(df)];
  hn::Store(level, df, l);
  hn::Store(scale, df, s);
  hn::Store(zero, df, z);
  for (size_t t = 0; t < hn::Lanes(df); ++t) l[t] = std::fma(l[t], s[t], z[t]);
  return hn::Load(df, l);
#else
  return hn::MulAdd(level, scale, zero);
#endif
}

// Keeps a loaded vector in a register. On x86 GCC folds a query vector's load into each
// of the N FMAs that use it (a memory operand each): a 6 × 2 score leaf then issues 14
// loads per 12 FMAs, more than Zen's two load ports serve in the FMAs' 6 cycles; on
// AVX-512 a 4 × 2 leaf issued 10 per 8, where Zen 4 loads one 512-bit vector a cycle. An
// empty asm that claims to change the register makes the load happen once (MLA's latent
// decode, 128 heads, 4096 keys, 1 thread on a Zen 2 EPYC: 19.6 ms against 20.2–20.3).
// The same arithmetic, the same bits. ("v": any of AVX-512's 32 vector registers.)
HWY_INLINE void KeepInRegister(FloatVec& v) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
  asm("" : "+v"(v.raw));
#else
  (void)v;
#endif
}

// out[r] (N keys' partial sums, as the tree above) for keys k[0, N), rows q + r·q_ld;
// with kAffine, of the keys `affine` maps their stored levels to.
template <size_t N, size_t R, bool kAffine, class S>
HWY_INLINE void ScoreTree(const float* HWY_RESTRICT q, size_t q_ld, const S* const* k, size_t dim,
                          Ahead<S> ahead, const KeyAffine& affine, VecArray<FloatTag, R>& out) {
  const FloatTag df;
  constexpr size_t kLeaf = kLeafKeys<R>;
  if constexpr (N <= kLeaf) {
    const size_t lanes = hn::Lanes(df);
    for (size_t j = 0; j < N; ++j) ahead(j);
    VecArray2<FloatTag, R, N> acc;
    for (size_t r = 0; r < R; ++r)
      for (size_t j = 0; j < N; ++j) acc[r][j] = hn::Zero(df);
    if constexpr (std::is_same_v<S, uint4x2>) {
      // int4 (dim whole chunks): the vectors at c and c + 16 from one widening of their
      // bytes, both into the key's accumulator.
      constexpr size_t kHalf = kInt4Chunk / 2;
      for (size_t c = 0; c < dim; c += lanes) {
        if (c % kInt4Chunk >= kHalf) continue;  // taken with c − 16
        VecArray<FloatTag, R> q_low, q_high;
        for (size_t r = 0; r < R; ++r) {
          q_low[r] = hn::LoadU(df, q + r * q_ld + c);
          q_high[r] = hn::LoadU(df, q + r * q_ld + c + kHalf);
        }
        for (size_t j = 0; j < N; ++j) {
          FloatVec low, high;
          LoadLevelPair(df, k[j], c, low, high);
          if constexpr (kAffine) {
            low = AffineKey(low, hn::LoadU(df, affine.scale + c), hn::LoadU(df, affine.zero + c));
            high = AffineKey(high, hn::LoadU(df, affine.scale + c + kHalf), hn::LoadU(df, affine.zero + c + kHalf));
          }
          for (size_t r = 0; r < R; ++r) acc[r][j] = hn::MulAdd(q_high[r], high, hn::MulAdd(q_low[r], low, acc[r][j]));
        }
      }
    } else {
      for (size_t c = 0; c < dim; c += lanes) {
        VecArray<FloatTag, N> kv;
        for (size_t j = 0; j < N; ++j) kv[j] = LoadValues(df, k[j], c);
        if constexpr (kAffine) {
          const FloatVec scale = hn::LoadU(df, affine.scale + c), zero = hn::LoadU(df, affine.zero + c);
          for (size_t j = 0; j < N; ++j) kv[j] = AffineKey(kv[j], scale, zero);
        }
        for (size_t r = 0; r < R; ++r) {
          FloatVec qv = hn::LoadU(df, q + r * q_ld + c);
          if constexpr (N > 1) KeepInRegister(qv);
          for (size_t j = 0; j < N; ++j) acc[r][j] = hn::MulAdd(qv, kv[j], acc[r][j]);
        }
      }
    }
    for (size_t r = 0; r < R; ++r) out[r] = CombineKeys<N>(acc[r]);
  } else {
    VecArray<FloatTag, R> lo, hi;
    ScoreTree<N / 2, R, kAffine>(q, q_ld, k, dim, ahead, affine, lo);
    ScoreTree<N / 2, R, kAffine>(q, q_ld, k + N / 2, dim, ahead.offset(N / 2), affine, hi);
    for (size_t r = 0; r < R; ++r) out[r] = Combine(lo[r], hi[r]);
  }
}

// scores[r·ld + t] for rows r < R and the L keys k[0, L).
template <size_t R, bool kAffine, class S>
HWY_INLINE void ScoreRows(const float* HWY_RESTRICT q, size_t q_ld, const S* const* k, size_t dim,
                          Ahead<S> ahead, const KeyAffine& affine, float* HWY_RESTRICT scores, size_t ld) {
  const FloatTag df;
  VecArray<FloatTag, R> s;
  if constexpr (kSizelessVectors) {
    // SVE: the tree needs the number of lanes, which is the CPU's vector length (for
    // Highway a power of two, 4 to 64 floats), known only at run time.
    switch (hn::Lanes(df)) {
      case 4: ScoreTree<4, R, kAffine>(q, q_ld, k, dim, ahead, affine, s); break;
      case 8: ScoreTree<8, R, kAffine>(q, q_ld, k, dim, ahead, affine, s); break;
      case 16: ScoreTree<16, R, kAffine>(q, q_ld, k, dim, ahead, affine, s); break;
      case 32: ScoreTree<32, R, kAffine>(q, q_ld, k, dim, ahead, affine, s); break;
      default: ScoreTree<kLanes, R, kAffine>(q, q_ld, k, dim, ahead, affine, s); break;
    }
  } else {
    ScoreTree<kLanes, R, kAffine>(q, q_ld, k, dim, ahead, affine, s);
  }
  for (size_t r = 0; r < R; ++r) hn::StoreU(s[r], df, scores + r * ld);
}

// Rows per register tile when there are many (GQA groups, MLA's stacked heads). AVX2's 16
// registers hold 6 rows × 2 keys of score accumulators (or 6 rows × 2 vectors of P·V)
// plus the loads: 12 independent FMA chains, enough to keep both FMA ports busy through
// Zen 2's 5-cycle latency, where 4 rows' 8 chains cap the tiles at 80% (measured on MLA's
// latent decode, 128 heads, 4096 keys, 1 thread on a Zen 2 EPYC: 19.6 ms against 20.3–21.0
// with 4 rows). Wider targets keep 4 rows (their panels are wider instead).
#if HWY_TARGET == HWY_AVX2
inline constexpr size_t kRowTile = 6;
#else
inline constexpr size_t kRowTile = 4;
#endif

// One vector of keys against every row, rows in tiles of kRowTile (then up to 5 more): the keys'
// rows are read from memory by the first tile (which also prefetches) and from L1 by the
// others. With kAffine, the keys are the levels `affine` maps (keys scaled per channel).
template <bool kAffine = false, class S>
void ScoreKeys(size_t rows, const float* HWY_RESTRICT q, size_t q_ld, const S* const* k, size_t dim,
               Ahead<S> ahead, float* HWY_RESTRICT scores, size_t ld, const KeyAffine& affine = {}) {
  size_t r = 0;
  for (; r + kRowTile <= rows; r += kRowTile) {
    ScoreRows<kRowTile, kAffine>(q + r * q_ld, q_ld, k, dim, ahead, affine, scores + r * ld, ld);
    ahead = Ahead<S>{};
  }
  if (kRowTile > 4 && rows - r >= 4) {
    ScoreRows<4, kAffine>(q + r * q_ld, q_ld, k, dim, ahead, affine, scores + r * ld, ld);
    ahead = Ahead<S>{};
    r += 4;
  }
  switch (rows - r) {
    case 3: return ScoreRows<3, kAffine>(q + r * q_ld, q_ld, k, dim, ahead, affine, scores + r * ld, ld);
    case 2: return ScoreRows<2, kAffine>(q + r * q_ld, q_ld, k, dim, ahead, affine, scores + r * ld, ld);
    case 1: return ScoreRows<1, kAffine>(q + r * q_ld, q_ld, k, dim, ahead, affine, scores + r * ld, ld);
    default: return;
  }
}

// ---------------------------------------------------------------------------------
// Online softmax per row over one block of scores (rows × padded, ld apart), for the
// split-K schedule and sparse attention's gathered blocks:
// m' = max(m, max_j S), alpha = e^(m − m'), P = e^(S − m') in place, l' = l·alpha + Σ_j P.
// A row with no visible key so far keeps m' = -inf, P = 0, alpha = 1.
HWY_INLINE void SoftmaxRows(size_t rows, size_t padded, float* HWY_RESTRICT scores, size_t ld,
                            float* HWY_RESTRICT m, float* HWY_RESTRICT l, float* HWY_RESTRICT alpha) {
  const FloatTag df;
  const size_t lanes = hn::Lanes(df);
  for (size_t r = 0; r < rows; ++r) {
    float* row = scores + r * ld;
    FloatVec block_max = hn::Set(df, kMinusInf);
    for (size_t j = 0; j < padded; j += lanes) block_max = hn::Max(block_max, hn::LoadU(df, row + j));
    const float m_new = std::max(m[r], hn::GetLane(hn::MaxOfLanes(df, block_max)));
    const float shift = m_new == kMinusInf ? 0.0f : m_new;
    alpha[r] = m_new == kMinusInf ? 1.0f : std::exp(m[r] - m_new);
    const FloatVec shift_v = hn::Set(df, shift);
    FloatVec sum = hn::Zero(df);
    for (size_t j = 0; j < padded; j += lanes) {
      const FloatVec pv = ExpKeepNaN(df, hn::Sub(hn::LoadU(df, row + j), shift_v));
      hn::StoreU(pv, df, row + j);
      sum = hn::Add(sum, pv);
    }
    l[r] = l[r] * alpha[r] + hn::GetLane(hn::SumOfLanes(df, sum));
    m[r] = m_new;
  }
}

// ---------------------------------------------------------------------------------
// P·V: acc[r][0:dim] = acc[r]·alpha[r] + Σ_j P[r][j]·v_j for R rows, C vectors of columns.
// Register tile R × C (each V vector loaded and widened once for R rows, each P entry
// broadcast once for C vectors); the block's product is summed from zero first, so its
// rounding grows with the block, not with the sequence.

#if HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_EMU128 || HWY_TARGET == HWY_SCALAR
inline constexpr size_t kValueTileVectors = 8;  // 16 registers: R·C accumulators + C loads
#else
inline constexpr size_t kValueTileVectors = 16;  // 32 registers
#endif

// The weight each key's V vector is multiplied by: P[r][j] for every storage but int4...
struct RowWeights {
  const float* HWY_RESTRICT p = nullptr;
  size_t p_ld = 0;
  static constexpr bool kGrouped = false;
  HWY_INLINE FloatVec operator()(size_t r, size_t key, size_t /*col*/) const {
    return hn::Set(FloatTag(), p[r * p_ld + key]);
  }
};

// ... and for int4 values, whose channel c of key j is u·s_jg + z_jg with the scale and
// zero point of c's group g of kInt4Chunk channels: Σ_j P_rj·(u·s_jg + z_jg) =
// Σ_j (P_rj·s_jg)·u + Σ_j P_rj·z_jg, so each key's levels are multiplied by a weight per
// (row, group), w[r·row_ld + g·keys_ld + j] = P_rj·s_jg, and each group's Σ_j P_rj·z_jg,
// bias[r·groups + g], is added to its channels once per block — one FMA per vector, as
// for the other storage types, instead of a dequantizing FMA more (GroupWeights, decode.cpp).
struct GroupedWeights {
  const float* HWY_RESTRICT w = nullptr;
  size_t row_ld = 0, keys_ld = 0;
  const float* HWY_RESTRICT bias = nullptr;
  size_t groups = 0;
  static constexpr bool kGrouped = true;
  HWY_INLINE FloatVec operator()(size_t r, size_t key, size_t col) const {
    return hn::Set(FloatTag(), w[r * row_ld + (col / kInt4Chunk) * keys_ld + key]);
  }
  HWY_INLINE FloatVec Bias(size_t r, size_t col) const { return hn::Set(FloatTag(), bias[r * groups + col / kInt4Chunk]); }
};

template <size_t R, size_t C, class S, class Weights>
HWY_INLINE void ValueTile(const Weights& weight, size_t keys, const S* const* v, size_t col, Ahead<S> ahead,
                          const float* HWY_RESTRICT alpha, float* HWY_RESTRICT acc, size_t acc_ld) {
  const FloatTag df;
  const size_t lanes = hn::Lanes(df);
  // Grouped weights: vectors of one group share a broadcast (a vector never spans two
  // groups: Int4Vectors, at most kInt4Chunk / 2 lanes).
  const size_t per_group = Weights::kGrouped ? std::max<size_t>(kInt4Chunk / lanes, 1) : C;
  VecArray2<FloatTag, R, C> sum;
  for (size_t r = 0; r < R; ++r)
    for (size_t c = 0; c < C; ++c) sum[r][c] = hn::Zero(df);
  // int4 panels of whole chunks: the vectors at c and c + 16 from one widening (a panel
  // of half a chunk loads vector by vector).
  constexpr bool kInt4 = std::is_same_v<S, uint4x2>;
  const size_t half = kInt4Chunk / 2, pair = half / lanes;  // vectors from c to c + 16
  const bool paired = kInt4 && (C * lanes) % kInt4Chunk == 0 && col % kInt4Chunk == 0;
  for (size_t j = 0; j < keys; ++j) {
    ahead(j);
    VecArray<FloatTag, C> vv;
    for (size_t c = 0; c < C; ++c) {
      if constexpr (kInt4) {
        if (paired) {
          if ((c * lanes) % kInt4Chunk < half) {
            FloatVec low, high;  // (on SVE vv's entries are proxies, not vectors to bind)
            LoadLevelPair(df, v[j], col + c * lanes, low, high);
            vv[c] = low;
            vv[c + pair] = high;
          }
          continue;
        }
      }
      vv[c] = LoadValues(df, v[j], col + c * lanes);
    }
    for (size_t r = 0; r < R; ++r) {
      FloatVec w = weight(r, j, col);
      for (size_t c = 0; c < C; ++c) {
        if (Weights::kGrouped && c > 0 && c % per_group == 0) w = weight(r, j, col + c * lanes);
        sum[r][c] = hn::MulAdd(w, vv[c], sum[r][c]);
      }
    }
  }
  for (size_t r = 0; r < R; ++r) {
    const FloatVec a = hn::Set(df, alpha[r]);
    float* out = acc + r * acc_ld + col;
    for (size_t c = 0; c < C; ++c) {
      FloatVec block = sum[r][c];
      if constexpr (Weights::kGrouped) block = hn::Add(block, weight.Bias(r, col + c * lanes));
      hn::StoreU(hn::MulAdd(hn::LoadU(df, out + c * lanes), a, block), df, out + c * lanes);
    }
  }
}

// All columns [0, dim) of R rows: panels of C vectors, C as wide as the registers allow.
template <size_t R, class S, class Weights>
HWY_INLINE void ValueRows(const Weights& weight, size_t keys, const S* const* v, size_t dim, Ahead<S> ahead,
                          const float* HWY_RESTRICT alpha, float* HWY_RESTRICT acc, size_t acc_ld) {
  const size_t lanes = VectorLanes();
  // The widest power-of-two panel whose accumulators and loads fit the registers.
  constexpr size_t kFit = kValueTileVectors / (R < 2 ? 2 : R);
  constexpr size_t kC = kFit >= 8 ? 8 : kFit >= 4 ? 4 : kFit >= 2 ? 2 : 1;
  size_t col = 0;
  for (; col + kC * lanes <= dim; col += kC * lanes) {
    ValueTile<R, kC>(weight, keys, v, col, ahead, alpha, acc, acc_ld);
    ahead = Ahead<S>{};  // the first panel prefetches
  }
  for (; col + 4 * lanes <= dim; col += 4 * lanes) {  // the rest in narrower panels
    ValueTile<R, 4>(weight, keys, v, col, ahead, alpha, acc, acc_ld);
    ahead = Ahead<S>{};
  }
  for (; col + 2 * lanes <= dim; col += 2 * lanes) {
    ValueTile<R, 2>(weight, keys, v, col, ahead, alpha, acc, acc_ld);
    ahead = Ahead<S>{};
  }
  for (; col < dim; col += lanes) {
    ValueTile<R, 1>(weight, keys, v, col, ahead, alpha, acc, acc_ld);
    ahead = Ahead<S>{};
  }
}

// Weights rows from row r on (each policy's row 0 is then the tile's first).
HWY_INLINE RowWeights RowsFrom(const RowWeights& w, size_t r) { return {w.p + r * w.p_ld, w.p_ld}; }
HWY_INLINE GroupedWeights RowsFrom(const GroupedWeights& w, size_t r) {
  return {w.w + r * w.row_ld, w.row_ld, w.keys_ld, w.bias + r * w.groups, w.groups};
}

// Every row tile over columns [col, col + C·lanes) (the row tiles of 4, then the rest).
template <size_t C, class S, class Weights>
HWY_INLINE void ValuePanel(size_t rows, const Weights& weights, size_t keys, const S* const* v, size_t col,
                           Ahead<S>& ahead, const float* HWY_RESTRICT alpha, float* HWY_RESTRICT acc, size_t acc_ld) {
  size_t r = 0;
  constexpr size_t kTile = C <= 2 ? kRowTile : 4;  // (6 × 2 vectors of accumulators on AVX2)
  for (; r + kTile <= rows; r += kTile) {
    ValueTile<kTile, C>(RowsFrom(weights, r), keys, v, col, ahead, alpha + r, acc + r * acc_ld, acc_ld);
    ahead = Ahead<S>{};  // the first tile prefetches
  }
  if (kTile > 4 && rows - r >= 4) {
    ValueTile<4, C>(RowsFrom(weights, r), keys, v, col, ahead, alpha + r, acc + r * acc_ld, acc_ld);
    ahead = Ahead<S>{};
    r += 4;
  }
  switch (rows - r) {
    case 3: ValueTile<3, C>(RowsFrom(weights, r), keys, v, col, ahead, alpha + r, acc + r * acc_ld, acc_ld); break;
    case 2: ValueTile<2, C>(RowsFrom(weights, r), keys, v, col, ahead, alpha + r, acc + r * acc_ld, acc_ld); break;
    case 1: ValueTile<1, C>(RowsFrom(weights, r), keys, v, col, ahead, alpha + r, acc + r * acc_ld, acc_ld); break;
    default: return;
  }
  ahead = Ahead<S>{};
}

// Rows beyond one tile (GQA groups, MLA's heads stacked: 16 to 128 rows): column panels
// outer, row tiles inner, so that a panel's slice of the block's values (keys × the
// panel's width) comes from memory or L2 once and from L1 for every other row tile.
// Rows inner or outer, each accumulator entry sums the same terms in the same order:
// the same bits. (Rows outer re-read every value row from L2 for each row tile: MLA's
// latent decode, 128 heads × 512 columns, 4096 keys, 1 thread on a Zen 2 EPYC, took
// 30.6 ms so and 22.1 ms panels outer.)
template <class S, class Weights>
void WeightedValues(size_t rows, const Weights& weights, size_t keys, const S* const* v, size_t dim, Ahead<S> ahead,
                    const float* HWY_RESTRICT alpha, float* HWY_RESTRICT acc, size_t acc_ld) {
  if (rows > 4) {
    const size_t lanes = VectorLanes();
    constexpr size_t kFit = kValueTileVectors / 4;  // the widest panel a tile of 4 rows holds
    constexpr size_t kC = kFit >= 8 ? 8 : kFit >= 4 ? 4 : kFit >= 2 ? 2 : 1;
    size_t col = 0;
    for (; col + kC * lanes <= dim; col += kC * lanes) ValuePanel<kC>(rows, weights, keys, v, col, ahead, alpha, acc, acc_ld);
    for (; col + 2 * lanes <= dim; col += 2 * lanes) ValuePanel<2>(rows, weights, keys, v, col, ahead, alpha, acc, acc_ld);
    for (; col < dim; col += lanes) ValuePanel<1>(rows, weights, keys, v, col, ahead, alpha, acc, acc_ld);
    return;
  }
  size_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    ValueRows<4>(RowsFrom(weights, r), keys, v, dim, ahead, alpha + r, acc + r * acc_ld, acc_ld);
    ahead = Ahead<S>{};
  }
  switch (rows - r) {
    case 3: return ValueRows<3>(RowsFrom(weights, r), keys, v, dim, ahead, alpha + r, acc + r * acc_ld, acc_ld);
    case 2: return ValueRows<2>(RowsFrom(weights, r), keys, v, dim, ahead, alpha + r, acc + r * acc_ld, acc_ld);
    case 1: return ValueRows<1>(RowsFrom(weights, r), keys, v, dim, ahead, alpha + r, acc + r * acc_ld, acc_ld);
    default: return;
  }
}

// acc[r] = acc[r]·alpha[r] + Σ_j P[r][j]·v_j (P row r at p + r·p_ld).
template <class S>
void ValueBlock(size_t rows, const float* HWY_RESTRICT p, size_t p_ld, size_t keys, const S* const* v, size_t dim,
                Ahead<S> ahead, const float* HWY_RESTRICT alpha, float* HWY_RESTRICT acc, size_t acc_ld) {
  WeightedValues(rows, RowWeights{p, p_ld}, keys, v, dim, ahead, alpha, acc, acc_ld);
}

// ---------------------------------------------------------------------------------
// The split-K schedule's logits inside a tiled pass. A problem the forward runs split-K
// (cpu::split_k_shape) has its LSE from logits summed as ScoreKeys sums them (lanes over
// d, then the tree of lane sums); its backward computes P = exp(S − lse), which sums to 1
// only if S is that very sum — one FMA chain over d (the tiled GEMM) differs by up to
// |S|·ε·√d, far above the gradient's error bound at large logits. So the tiled backward
// (and the tiled forward, when it runs such a problem to collect statistics) takes its
// logits from here: bit for bit the split-K schedule's, as every (row, key) logit of
// ScoreKeys depends only on q_row and k_key (the tree pairs adjacent lanes the same way
// whatever the tile), and the queries are scaled in float as the split-K schedule does.
class SplitKLogits {
 public:
  // Nothing allocated when `active` is false (every other problem).
  SplitKLogits(size_t head_dim, size_t block_queries, size_t block_keys, bool active)
      : d_(head_dim),
        d_pad_(round_up(head_dim, VectorLanes())),
        block_keys_(round_up(block_keys, VectorLanes())),
        queries_(AllocateFloats(active ? block_queries * d_pad_ : 0)),
        keys_(AllocateFloats(active && d_pad_ != d_ ? block_keys_ * d_pad_ : 0)),
        rows_(AllocateFloats(active ? block_queries * block_keys_ : 0)),
        key_rows_(active ? block_keys_ : 0) {}

  // st[j·width + i] = (scale·q_i)·k_j for queries q_i = q + i·q_row (i < count) and keys
  // k_j = k + j·k_row (j < keys), float rows; st's columns count..width are zero (as the
  // GEMM gives them from zero-padded queries).
  void Tile(const float* q, int64_t q_row, size_t count, float scale, const float* k, int64_t k_row,
            size_t keys, float* HWY_RESTRICT st, size_t width) {
    const size_t lanes = VectorLanes(), padded = round_up(keys, lanes);
    for (size_t i = 0; i < count; ++i) {
      const float* in = q + static_cast<int64_t>(i) * q_row;
      float* row = queries_.get() + i * d_pad_;
      for (size_t c = 0; c < d_; ++c) row[c] = scale * in[c];
      std::fill(row + d_, row + d_pad_, 0.0f);
    }
    for (size_t j = 0; j < padded; ++j) {  // past `keys`: the last row again, never stored
      const float* key = k + static_cast<int64_t>(std::min(j, keys - 1)) * k_row;
      if (d_pad_ == d_) {
        key_rows_[j] = key;
      } else {
        if (j < keys) WidenRows(key, 0, 1, d_, keys_.get() + j * d_pad_, d_pad_);
        key_rows_[j] = keys_.get() + std::min(j, keys - 1) * d_pad_;
      }
    }
    for (size_t j = 0; j < padded; j += lanes)
      ScoreKeys(count, queries_.get(), d_pad_, key_rows_.data() + j, d_pad_, Ahead<float>{}, rows_.get() + j, padded);
    for (size_t j = 0; j < keys; ++j) {
      float* out = st + j * width;
      for (size_t i = 0; i < count; ++i) out[i] = rows_[i * padded + j];
      std::fill(out + count, out + width, 0.0f);
    }
  }

 private:
  size_t d_, d_pad_, block_keys_;
  hwy::AlignedFreeUniquePtr<float[]> queries_;  // count × d_pad: scale·q, zero-padded
  hwy::AlignedFreeUniquePtr<float[]> keys_;     // keys × d_pad: K rows zero-padded (d not whole vectors)
  hwy::AlignedFreeUniquePtr<float[]> rows_;     // count × padded keys: the logits, row-major
  std::vector<const float*> key_rows_;
};

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
