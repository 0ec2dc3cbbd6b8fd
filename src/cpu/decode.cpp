// Decode: a few queries per sequence against a long key/value cache (flash-decoding).
//
// Decoding reads every cached key and value once and does ~1 flop per byte, so memory
// traffic sets its pace. The kernel therefore
//   - reads each K/V head once for all the query heads of its GQA group and all the
//     queries of a tile (up to 16): the rows r = (head of the group, query) share a pass;
//   - walks the keys of a sequence in chunks; a task is (sequence, query tile, chunk) and
//     does every kv head of each key block before moving on, so a task streams through
//     the cache in memory order (one key row holds all heads, in a contiguous or a paged
//     cache alike);
//   - vectorizes over keys: for a block of keys, scores S[r][j] come out as whole vectors
//     of keys (one dot product per key with lanes over d, L of them reduced together by a
//     transpose-add tree), then one vector exp pass per row, then P·V by the same
//     register-tiled micro-kernel as the forward (lanes over dv).
// Per chunk, each row keeps the online-softmax state (m, l, acc = Σ e^(s−m)·v); the chunks
// of a row are merged afterwards in chunk order:
//     m = max_c m_c,   l = Σ_c l_c·e^(m_c−m),   out = (Σ_c acc_c·e^(m_c−m)) / l,   lse = m + log l
// Chunk boundaries depend only on the sequence length, never on the thread count, and
// every task and merge is computed the same way on any thread: results are bitwise
// identical for any number of threads.
//
// Storage: K/V may be float32, bfloat16 or float16; a block of rows is widened to float
// as it is packed (float32 rows whose sizes fit whole vectors are read in place). All
// arithmetic is float32.
//
// Masks: each query row sees a prefix of its sequence's keys (key lengths and causal
// alignment), so a block is either fully visible to every row of the tile, or partly
// visible (scores of hidden keys set to -inf — overwritten, so a NaN key behind the
// mask never reaches a row); keys past the last visible key of the tile are never read.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/decode.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "cpu/block_ops-inl.h"
#include "cpu/gemm-inl.h"

#ifndef QKV_CPU_DECODE_ONCE_
#define QKV_CPU_DECODE_ONCE_
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/blocking.hpp"
#include "cpu/decode.hpp"
#include "cpu/decode_plan.hpp"
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {

namespace {

constexpr size_t kLanes = HWY_LANES(float);  // upper bound; equal on fixed-width targets

// ---------------------------------------------------------------------------------
// Widening loads: one vector of floats from float32, bfloat16 or float16 storage.

template <class T>
HWY_INLINE FloatVec LoadWidened(FloatTag df, const T* HWY_RESTRICT p) {
  if constexpr (std::is_same_v<T, float>) {
    return hn::LoadU(df, p);
  } else if constexpr (std::is_same_v<T, bfloat16>) {
    const hn::Rebind<hwy::bfloat16_t, FloatTag> dh;
    return hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::bfloat16_t*>(p)));
  } else {
    // float16 one value at a time through qkv/half.hpp (exact): Highway 1.0.3's PromoteTo
    // turns ±inf and NaN into finite numbers where it has no F16C path (seen in the
    // AVX2-only sanitizer build), which would hide a bad cache value.
    HWY_ALIGN float wide[hn::MaxLanes(FloatTag())];
    for (size_t i = 0; i < hn::Lanes(df); ++i) wide[i] = static_cast<float>(p[i]);
    return hn::Load(df, wide);
  }
}

// dst[0, cols) = float(src[0, cols)), dst[cols, padded) = 0.
template <class T>
HWY_INLINE void WidenRow(const T* HWY_RESTRICT src, size_t cols, float* HWY_RESTRICT dst,
                         size_t padded) {
  const FloatTag df;
  const size_t lanes = hn::Lanes(df);
  size_t c = 0;
  for (; c + lanes <= cols; c += lanes) hn::StoreU(LoadWidened(df, src + c), df, dst + c);
  for (; c < cols; ++c) dst[c] = static_cast<float>(src[c]);
  for (; c < padded; ++c) dst[c] = 0.0f;
}

// ---------------------------------------------------------------------------------
// Scores of one row against L consecutive keys, as one vector of L scores.
//
// Each key's dot product is first kept with lanes over d (Dot); the L vectors are then
// summed across lanes together by a transpose-add tree: a pair (lo, hi) becomes
// ConcatEven(hi, lo) + ConcatOdd(hi, lo), whose lower half holds lo's pairwise lane sums
// and upper half hi's. After log2 L levels lane t holds key t's score: L − 1 shuffle
// pairs for L keys instead of one full horizontal sum per key. The tree is built
// depth-first (ScoreTree<N> = combine(ScoreTree<N/2>, ScoreTree<N/2>)), so only
// log2 L partial vectors are live at a time and nothing spills.

HWY_INLINE FloatVec Dot(const float* HWY_RESTRICT q, const float* HWY_RESTRICT k, size_t d_pad) {
  const FloatTag df;
  const size_t lanes = hn::Lanes(df);
  FloatVec even = hn::Mul(hn::LoadU(df, q), hn::LoadU(df, k)), odd = hn::Zero(df);
  size_t c = lanes;
  for (; c + 2 * lanes <= d_pad; c += 2 * lanes) {  // two chains: half the FMA latency
    odd = hn::MulAdd(hn::LoadU(df, q + c), hn::LoadU(df, k + c), odd);
    even = hn::MulAdd(hn::LoadU(df, q + c + lanes), hn::LoadU(df, k + c + lanes), even);
  }
  if (c < d_pad) odd = hn::MulAdd(hn::LoadU(df, q + c), hn::LoadU(df, k + c), odd);
  return hn::Add(even, odd);
}

#if HWY_TARGET != HWY_SCALAR  // one lane: nothing to reduce
template <size_t N>
HWY_INLINE FloatVec ScoreTree(const float* HWY_RESTRICT q, const float* HWY_RESTRICT k,
                              size_t k_stride, size_t d_pad) {
  if constexpr (N == 1) {
    return Dot(q, k, d_pad);
  } else {
    const FloatTag df;
    const FloatVec lo = ScoreTree<N / 2>(q, k, k_stride, d_pad);
    const FloatVec hi = ScoreTree<N / 2>(q, k + (N / 2) * k_stride, k_stride, d_pad);
    return hn::Add(hn::ConcatEven(df, hi, lo), hn::ConcatOdd(df, hi, lo));
  }
}
#endif

HWY_INLINE FloatVec ScoreGroup(const float* HWY_RESTRICT q, const float* HWY_RESTRICT k,
                               size_t k_stride, size_t d_pad) {
#if HWY_TARGET == HWY_SCALAR
  (void)k_stride;
  return Dot(q, k, d_pad);
#else
  return ScoreTree<kLanes>(q, k, k_stride, d_pad);
#endif
}

// ---------------------------------------------------------------------------------
// P·V for a single row: out[0:dv_pad] = Σ_j p[j]·v_j, even and odd keys in separate
// accumulators (a one-row register tile would otherwise wait on FMA latency per key).
template <size_t C>
HWY_INLINE void RowTimesValues(const float* HWY_RESTRICT p, size_t keys, const float* HWY_RESTRICT v,
                               size_t v_stride, float* HWY_RESTRICT out) {
  const FloatTag df;
  const size_t lanes = hn::Lanes(df);
  FloatVec even[C], odd[C];
  for (size_t c = 0; c < C; ++c) even[c] = odd[c] = hn::Zero(df);
  size_t j = 0;
  for (; j + 2 <= keys; j += 2) {
    const FloatVec pe = hn::Set(df, p[j]), po = hn::Set(df, p[j + 1]);
    const float* ve = v + j * v_stride;
    for (size_t c = 0; c < C; ++c) {
      even[c] = hn::MulAdd(pe, hn::LoadU(df, ve + c * lanes), even[c]);
      odd[c] = hn::MulAdd(po, hn::LoadU(df, ve + v_stride + c * lanes), odd[c]);
    }
  }
  if (j < keys) {
    const FloatVec pe = hn::Set(df, p[j]);
    for (size_t c = 0; c < C; ++c) even[c] = hn::MulAdd(pe, hn::LoadU(df, v + j * v_stride + c * lanes), even[c]);
  }
  for (size_t c = 0; c < C; ++c) hn::StoreU(hn::Add(even[c], odd[c]), df, out + c * lanes);
}

// product[r][0:dv_pad] = Σ_j P[r][j]·V[j][0:dv_pad] for r < rows.
HWY_INLINE void ScoresTimesValues(size_t rows, size_t keys, const float* HWY_RESTRICT p, size_t p_ld,
                                  const float* HWY_RESTRICT v, size_t v_stride, size_t dv_pad,
                                  float* HWY_RESTRICT product) {
  if (rows >= 3) {  // enough independent rows for the register-tiled kernel
    Gemm(rows, dv_pad, keys, StridedA{p, p_ld, 1}, v, v_stride, product, dv_pad, /*accumulate=*/false);
    return;
  }
  const size_t lanes = VectorLanes();
  constexpr size_t kPanel = 4;  // vectors per pass: 2·4 accumulators + loads fit in 16 registers
  for (size_t r = 0; r < rows; ++r) {
    size_t c = 0;
    for (; c + kPanel * lanes <= dv_pad; c += kPanel * lanes)
      RowTimesValues<kPanel>(p + r * p_ld, keys, v + c, v_stride, product + r * dv_pad + c);
    for (; c < dv_pad; c += lanes)
      RowTimesValues<1>(p + r * p_ld, keys, v + c, v_stride, product + r * dv_pad + c);
  }
}

// ---------------------------------------------------------------------------------
// Per-thread scratch, laid out once per call (sizes in floats).
struct DecodeScratch {
  hwy::AlignedFreeUniquePtr<float[]> queries;  // Hq·tile rows × d_pad: scale·q, zero-padded
  hwy::AlignedFreeUniquePtr<float[]> keys;     // block × d_pad: widened K rows of one head
  hwy::AlignedFreeUniquePtr<float[]> values;   // block × dv_pad: widened V rows of one head
  hwy::AlignedFreeUniquePtr<float[]> scores;   // group rows × block: S, then P
  hwy::AlignedFreeUniquePtr<float[]> product;  // group rows × dv_pad: one block's P·V
  hwy::AlignedFreeUniquePtr<float[]> alpha;    // group rows: e^(m_old − m_new)

  explicit DecodeScratch(const DecodePlan& plan)
      : queries(AllocateFloats(plan.tile_rows() * plan.d_pad)),
        keys(AllocateFloats(plan.block_keys * plan.d_pad)),
        values(AllocateFloats(plan.block_keys * plan.dv_pad)),
        scores(AllocateFloats(plan.group_rows() * plan.block_keys)),
        product(AllocateFloats(plan.group_rows() * plan.dv_pad)),
        alpha(AllocateFloats(plan.group_rows())) {}
};

// A block of rows of one head as the kernels read it: `rows` float rows `stride` apart.
struct RowsOperand {
  const float* data;
  size_t stride;
};

// K or V rows [first, first + count) of (batch, head), as floats: in place when the
// storage is float32, the block lies in one run of the source and its sizes are whole
// vectors; otherwise widened into `buffer` (ld floats per row, zero rows up to
// padded_count).
template <class T>
RowsOperand BlockRows(const DecodeProblem& p, bool is_key, int64_t batch, int64_t head,
                      int64_t first, size_t count, size_t padded_count, size_t cols,
                      size_t ld, float* buffer) {
  const KvSource& kv = p.kv;
  const T* base = static_cast<const T*>(is_key ? kv.k : kv.v);
  const int64_t row_stride = is_key ? kv.k_row_stride : kv.v_row_stride;
  auto offset = [&](int64_t key) { return is_key ? kv.k_offset(batch, key, head) : kv.v_offset(batch, key, head); };
  const bool one_run = kv.run_end(first) >= first + static_cast<int64_t>(count);
  if constexpr (std::is_same_v<T, float>) {
    if (one_run && cols == ld && count == padded_count)
      return {base + offset(first), static_cast<size_t>(row_stride)};
  }
  size_t j = 0;
  while (j < count) {  // one run of evenly strided rows at a time
    const int64_t key = first + static_cast<int64_t>(j);
    const size_t run =
        static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(count - j), kv.run_end(key) - key));
    const T* src = base + offset(key);
    for (size_t r = 0; r < run; ++r)
      WidenRow(src + static_cast<int64_t>(r) * row_stride, cols, buffer + (j + r) * ld, ld);
    j += run;
  }
  std::fill(buffer + count * ld, buffer + padded_count * ld, 0.0f);
  return {buffer, ld};
}

// One chunk of one task: every kv head over the keys [task.first_key, task.end_key).
// Writes the chunk's (m, l, acc) of every row of the tile into `state`.
template <class T>
void DecodeChunk(const DecodeProblem& p, const DecodePlan& plan, const DecodeTask& task,
                 DecodeScratch& s, float* state) {
  const FloatTag df;
  const size_t lanes = hn::Lanes(df);
  const size_t d = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.v_dim);
  const size_t d_pad = plan.d_pad, dv_pad = plan.dv_pad;
  const size_t tile = static_cast<size_t>(task.queries);  // queries in this tile
  const size_t group_rows = static_cast<size_t>(p.group()) * tile;
  const size_t all_rows = static_cast<size_t>(p.q_heads) * tile;
  ChunkState chunk = plan.chunk_state(state, tile);

  // Row (h, i) of the tile: scale·q(b, first_query + i, h, ·), zero-padded to d_pad.
  int64_t key_end[kDecodeQueries];
  int64_t min_end = INT64_MAX;
  for (size_t i = 0; i < tile; ++i) {
    key_end[i] = p.key_end(task.batch, task.first_query + static_cast<int64_t>(i));
    min_end = std::min(min_end, key_end[i]);
  }
  const float scale = static_cast<float>(p.scale);
  for (int64_t h = 0; h < p.q_heads; ++h)
    for (size_t i = 0; i < tile; ++i) {
      const float* q = p.q + task.batch * p.q_batch +
                       (task.first_query + static_cast<int64_t>(i)) * p.q_row + h * p.q_head;
      float* row = s.queries.get() + (static_cast<size_t>(h) * tile + i) * d_pad;
      for (size_t c = 0; c < d; ++c) row[c] = scale * q[c];
      std::fill(row + d, row + d_pad, 0.0f);
    }
  std::fill(chunk.m, chunk.m + all_rows, kMinusInf);
  std::fill(chunk.l, chunk.l + all_rows, 0.0f);
  std::fill(chunk.acc, chunk.acc + all_rows * dv_pad, 0.0f);

  const size_t ld = plan.block_keys;  // row length of the score tile
  for (int64_t first = task.first_key; first < task.end_key;
       first += static_cast<int64_t>(plan.block_keys)) {
    const size_t keys = static_cast<size_t>(std::min<int64_t>(plan.block_keys, task.end_key - first));
    const size_t padded = round_up(keys, lanes);
    const bool masked = first + static_cast<int64_t>(keys) > min_end;
    for (int64_t g = 0; g < p.kv_heads; ++g) {
      const size_t row0 = static_cast<size_t>(g) * group_rows;  // first row of the group
      const float* queries = s.queries.get() + row0 * d_pad;
      float* m = chunk.m + row0;
      float* l = chunk.l + row0;
      float* acc = chunk.acc + row0 * dv_pad;

      // S[r][j] = (scale·q_r)·k_j for the block's keys, lanes over keys.
      const RowsOperand k = BlockRows<T>(p, true, task.batch, g, first, keys, padded, d,
                                         d_pad, s.keys.get());
      for (size_t r = 0; r < group_rows; ++r)
        for (size_t j = 0; j < padded; j += lanes)
          hn::StoreU(ScoreGroup(queries + r * d_pad, k.data + j * k.stride, k.stride, d_pad), df,
                     s.scores.get() + r * ld + j);

      // Hidden keys (and the zero padding past the block) get -inf, overwriting the
      // score: a NaN/Inf key that a row does not see cannot reach it.
      for (size_t r = 0; r < group_rows; ++r) {
        const int64_t visible = std::clamp<int64_t>(key_end[r % tile] - first, 0,
                                                    static_cast<int64_t>(keys));
        std::fill(s.scores.get() + r * ld + visible, s.scores.get() + r * ld + padded, kMinusInf);
      }

      // Online softmax per row: m' = max(m, max_j S), alpha = e^(m − m'),
      // P = e^(S − m'), l' = l·alpha + Σ_j P. A row with no visible key so far keeps
      // m' = -inf, P = 0, alpha = 1.
      for (size_t r = 0; r < group_rows; ++r) {
        float* row = s.scores.get() + r * ld;
        FloatVec block_max = hn::Set(df, kMinusInf);
        for (size_t j = 0; j < padded; j += lanes) block_max = hn::Max(block_max, hn::LoadU(df, row + j));
        const float m_new = std::max(m[r], hn::GetLane(hn::MaxOfLanes(df, block_max)));
        const float shift = m_new == kMinusInf ? 0.0f : m_new;
        s.alpha[r] = m_new == kMinusInf ? 1.0f : std::exp(m[r] - m_new);
        const FloatVec shift_v = hn::Set(df, shift);
        FloatVec sum = hn::Zero(df);
        for (size_t j = 0; j < padded; j += lanes) {
          const FloatVec pv = ExpKeepNaN(df, hn::Sub(hn::LoadU(df, row + j), shift_v));
          hn::StoreU(pv, df, row + j);
          sum = hn::Add(sum, pv);
        }
        l[r] = l[r] * s.alpha[r] + hn::GetLane(hn::SumOfLanes(df, sum));
        m[r] = m_new;
      }

      // acc = acc·alpha + P·V_blk, the block's product summed from zero first (its
      // rounding then grows with the block, not with the sequence).
      const RowsOperand v = BlockRows<T>(p, false, task.batch, g, first, keys, keys, dv, dv_pad,
                                         s.values.get());
      const size_t partly_visible = masked ? static_cast<size_t>(std::max<int64_t>(min_end - first, 0)) : keys;
      if (partly_visible < keys &&
          !AllFinite(v.data + partly_visible * v.stride, static_cast<int64_t>(v.stride),
                     keys - partly_visible, dv)) {
        // A hidden value holds NaN/Inf: skip P = 0 terms so 0·Inf cannot leak.
        ScaleRows(acc, group_rows, dv_pad, dv_pad, s.alpha.get());
        for (size_t r = 0; r < group_rows; ++r)
          for (size_t j = 0; j < keys; ++j) {
            const float w = s.scores[r * ld + j];
            if (w == 0.0f) continue;
            const float* vr = v.data + j * v.stride;
            for (size_t c = 0; c < dv; ++c) acc[r * dv_pad + c] += w * vr[c];
          }
        continue;
      }
      ScoresTimesValues(group_rows, keys, s.scores.get(), ld, v.data, v.stride, dv_pad,
                        s.product.get());
      RescaleAdd(acc, group_rows, dv_pad, s.alpha.get(), s.product.get());
    }
  }
}

// out = Σ_c acc_c·e^(m_c−m) / Σ_c l_c·e^(m_c−m) over the chunks of one (batch, tile), in
// chunk order; a row that saw no key gets out 0 and lse -inf.
void MergeChunks(const DecodeProblem& p, const DecodePlan& plan, const DecodeUnit& unit,
                 float* states, float* sum) {
  const FloatTag df;
  const size_t lanes = hn::Lanes(df);
  const size_t dv = static_cast<size_t>(p.v_dim), dv_pad = plan.dv_pad;
  const size_t tile = static_cast<size_t>(unit.queries);
  for (int64_t h = 0; h < p.q_heads; ++h)
    for (size_t i = 0; i < tile; ++i) {
      const size_t r = static_cast<size_t>(h) * tile + i;
      float m = kMinusInf;
      for (int64_t c = 0; c < unit.chunks; ++c)
        m = std::max(m, plan.chunk_state(states + (unit.first_task + c) * plan.state_floats, tile).m[r]);
      const int64_t query = unit.first_query + static_cast<int64_t>(i);
      float* out = p.out + unit.batch * p.out_batch + query * p.out_row + h * p.out_head;
      // A chunk that saw no key of this row has m = -inf and l = 0 and is skipped. A
      // NaN score leaves m at -inf but l NaN: weight 1 then, so the NaN reaches the row.
      float l = 0.0f;
      std::fill(sum, sum + dv_pad, 0.0f);
      for (int64_t c = 0; c < unit.chunks; ++c) {
        const ChunkState chunk = plan.chunk_state(states + (unit.first_task + c) * plan.state_floats, tile);
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
      if (p.lse != nullptr) {
        p.lse[unit.batch * p.lse_batch + h * p.lse_head + query * p.lse_row] =
            l == 0.0f ? kMinusInf : m + std::log(l);
      }
    }
}

template <class T>
void RunDecode(const DecodeProblem& p) {
  const DecodePlan plan(p, VectorLanes());
  if (plan.units.empty()) return;
  hwy::AlignedFreeUniquePtr<float[]> states =
      AllocateFloats(plan.tasks.size() * plan.state_floats);
  const int threads = plan.threads(p.threads);
  if (threads <= 1) {  // no parallel region for work one thread does best
    DecodeScratch scratch(plan);
    for (const DecodeTask& task : plan.tasks)
      DecodeChunk<T>(p, plan, task, scratch, states.get() + task.index * plan.state_floats);
    for (const DecodeUnit& unit : plan.units) MergeChunks(p, plan, unit, states.get(), scratch.product.get());
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    DecodeScratch scratch(plan);
#pragma omp for schedule(dynamic, 1)
    for (size_t t = 0; t < plan.order.size(); ++t) {
      const DecodeTask& task = plan.tasks[plan.order[t]];
      DecodeChunk<T>(p, plan, task, scratch, states.get() + task.index * plan.state_floats);
    }
#pragma omp for schedule(static)
    for (size_t u = 0; u < plan.units.size(); ++u)
      MergeChunks(p, plan, plan.units[u], states.get(), scratch.product.get());
  }
}

}  // namespace

void DecodeImpl(const DecodeProblem& p) {
  switch (p.kv.type) {
    case StorageType::float32: return RunDecode<float>(p);
    case StorageType::bfloat16: return RunDecode<bfloat16>(p);
    case StorageType::float16: return RunDecode<float16>(p);
  }
}

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::cpu {
HWY_EXPORT(DecodeImpl);

void decode(const DecodeProblem& problem) { HWY_DYNAMIC_DISPATCH(DecodeImpl)(problem); }
}  // namespace qkv::cpu
#endif
