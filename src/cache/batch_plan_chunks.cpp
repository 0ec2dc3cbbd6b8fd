// qkv::BatchPlan's prefill chunks (qkv/batch_plan.hpp, "Schedules"): a chunk of more than
// 32 queries runs on the tiled schedule over its keys and values gathered into float32
// rows — widened exactly from the caches, whatever their storage — once per run.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cache/batch_plan_state.hpp"
#include "core/checked_size.hpp"
#include "core/dispatch.hpp"
#include "qkv/float8.hpp"
#include "reference/key_values.hpp"

namespace qkv {
namespace {

// Row (b, j, h) of a key/value source's keys (or values), widened to float into `to`
// (exactly; int8 and float8: value · the row's scale, one rounding, as the kernel's).
template <class T>
void widen_row(const T* row, int64_t dim, float scale, float* to) {
  for (int64_t c = 0; c < dim; ++c) {
    if constexpr (std::is_same_v<T, std::int8_t> || is_float8(storage_type_of<T>)) to[c] = static_cast<float>(row[c]) * scale;
    else to[c] = static_cast<float>(row[c]);
  }
}

// `dim` elements of a float32, bfloat16 or float16 row at `base` + `at`, widened into `to`.
void widen_float_row(StorageType type, const void* base, int64_t at, int64_t dim, float* to) {
  switch (type) {
    case StorageType::bfloat16: return widen_row(static_cast<const bfloat16*>(base) + at, dim, 1.0f, to);
    case StorageType::float16: return widen_row(static_cast<const float16*>(base) + at, dim, 1.0f, to);
    default: return widen_row(static_cast<const float*>(base) + at, dim, 1.0f, to);
  }
}

void widen_row(const detail::KvSource& kv, bool keys, int64_t b, int64_t j, int64_t h, int64_t dim, float* to) {
  if (keys && kv.split_keys()) {  // keys in two parts (float types only: planned_problem)
    widen_float_row(kv.type, kv.k, kv.offset(kv.k_strides, b, j, h), kv.rope_from, to);
    widen_float_row(kv.type, kv.k_rope, kv.offset(kv.k_rope_strides, b, j, h), dim - kv.rope_from, to + kv.rope_from);
    return;
  }
  if (j >= kv.quantized_length(b)) {  // a cache's float window
    const float* row = keys ? kv.window_key(b, j, h) : kv.window_value(b, j, h);
    std::copy(row, row + dim, to);
    return;
  }
  const int64_t at = kv.offset(keys ? kv.k_strides : kv.v_strides, b, j, h);
  const void* base = keys ? kv.k : kv.v;
  switch (kv.type) {
    case StorageType::float32: return widen_row(static_cast<const float*>(base) + at, dim, 1.0f, to);
    case StorageType::bfloat16: return widen_row(static_cast<const bfloat16*>(base) + at, dim, 1.0f, to);
    case StorageType::float16: return widen_row(static_cast<const float16*>(base) + at, dim, 1.0f, to);
    case StorageType::int8: {
      const detail::ScalePtr scales = keys ? kv.k_scale : kv.v_scale;
      const float scale = scales[kv.offset(keys ? kv.k_scale_strides : kv.v_scale_strides, b, j, h)];
      const auto* row = static_cast<const std::int8_t*>(base) + at;
      if (keys && kv.channel_scaled()) {  // row scale · (int8 · channel scale + zero point), one rounding inside
        const detail::ScalePtr channel = kv.channel_scales(b, j, h);
        const detail::ScalePtr zero = kv.channel_zeros(b, j, h);
        for (int64_t c = 0; c < dim; ++c)
          to[c] = std::fma(static_cast<float>(row[c]), channel[c], zero != nullptr ? zero[c] : 0.0f) * scale;
        return;
      }
      return widen_row(row, dim, scale, to);
    }
    case StorageType::float8_e4m3fn:
    case StorageType::float8_e5m2: {
      const detail::ScalePtr scales = keys ? kv.k_scale : kv.v_scale;
      const float scale = scales[kv.offset(keys ? kv.k_scale_strides : kv.v_scale_strides, b, j, h)];
      if (kv.type == StorageType::float8_e5m2) return widen_row(static_cast<const float8_e5m2*>(base) + at, dim, scale, to);
      return widen_row(static_cast<const float8_e4m3fn*>(base) + at, dim, scale, to);
    }
    case StorageType::int4: {  // (a KVCache's) read as the reference reads it
      const reference::SourceKeyValues read{kv};
      for (int64_t c = 0; c < dim; ++c) to[c] = static_cast<float>(keys ? read.key(b, j, h, c) : read.value(b, j, h, c));
      return;
    }
  }
}

}  // namespace

// A prefill chunk (sequence b of the step) as a dense problem of its own: its queries
// and output rows in place, its keys and values gathered (widened exactly; int8 as
// value · scale) into float32 [1, L, Hkv, d] rows — a copy of L·Hkv·(d + dv) elements
// against the chunk's n·L·Hq·(d + dv) multiply-adds — so the tiled schedule reads them.
// Allocated by prepare_step, filled by finish_step (after run_appending's writes).
detail::GatheredChunk detail::allocate_chunk(const detail::ForwardProblem<float>& step, int64_t b) {
  const detail::Extents& e = step.extents;
  const int64_t length = step.mask.sequences.k_len(b);
  const auto floats = [&](int64_t dim) {
    return static_cast<std::size_t>(detail::checked_product("qkv::BatchPlan::run", "a prefill chunk's gathered keys",
                                                            {{"cache length", length}, {"kv heads", e.kv_heads}, {"dim", dim}}));
  };
  detail::GatheredChunk gathered{.sequence = b, .keys = {}, .values = {}};
  detail::allocate_or_throw("qkv::BatchPlan::run", "a prefill chunk's gathered keys",
                            (floats(e.head_dim) + floats(e.v_dim)) * sizeof(float), [&] {
                              gathered.keys.resize(floats(e.head_dim));
                              gathered.values.resize(floats(e.v_dim));
                            });
  return gathered;
}

void detail::fill_chunk(const detail::ForwardProblem<float>& step, detail::GatheredChunk& gathered) {
  const detail::Extents& e = step.extents;
  const int64_t b = gathered.sequence, length = step.mask.sequences.k_len(b);
  for (int64_t j = 0; j < length; ++j)
    for (int64_t h = 0; h < e.kv_heads; ++h) {
      widen_row(step.kv, true, b, j, h, e.head_dim, gathered.keys.data() + (j * e.kv_heads + h) * e.head_dim);
      widen_row(step.kv, false, b, j, h, e.v_dim, gathered.values.data() + (j * e.kv_heads + h) * e.v_dim);
    }
}

void detail::run_chunk(const detail::ForwardProblem<float>& step, const detail::GatheredChunk& gathered) {
  const detail::Extents& e = step.extents;
  const int64_t b = gathered.sequence;
  const int64_t n = step.mask.q_len(b), length = step.mask.sequences.k_len(b), first = step.mask.sequences.q_begin(b);
  const std::vector<float>& keys = gathered.keys;
  const std::vector<float>& values = gathered.values;
  detail::ForwardProblem<float> chunk;
  chunk.extents = e;
  chunk.extents.batch = 1;
  chunk.extents.q_len = n;
  chunk.extents.k_len = length;
  chunk.scale = step.scale;
  chunk.mask.causal = step.mask.causal;
  chunk.mask.window = step.mask.window;
  chunk.mask.has_sinks = step.mask.has_sinks;
  chunk.mask.sequences = {.count = 1, .dense_q_len = n, .dense_k_len = length, .cu_q = {}, .cu_k = {}};
  chunk.modifiers = step.modifiers;
  chunk.threads = step.threads;
  const auto& q = step.args.q;
  const auto& out = step.args.out;
  chunk.args.q = View4<const float>(&q(0, first, 0, 0), {1, n, e.q_heads, e.head_dim},
                                    {n * q.strides[1], q.strides[1], q.strides[2], q.strides[3]});
  chunk.args.k = View4<const float>(keys.data(), {1, length, e.kv_heads, e.head_dim},
                                    {length * e.kv_heads * e.head_dim, e.kv_heads * e.head_dim, e.head_dim, 1});
  chunk.args.v = View4<const float>(values.data(), {1, length, e.kv_heads, e.v_dim},
                                    {length * e.kv_heads * e.v_dim, e.kv_heads * e.v_dim, e.v_dim, 1});
  chunk.args.out = View4<float>(&out(0, first, 0, 0), {1, n, e.q_heads, e.v_dim},
                                {n * out.strides[1], out.strides[1], out.strides[2], out.strides[3]});
  if (!step.args.lse.empty()) {
    const auto& lse = step.args.lse;
    chunk.args.lse = View3<float>(&lse(0, 0, first), {1, e.q_heads, n}, {0, lse.strides[1], lse.strides[2]});
  }
  detail::run_forward(chunk, Backend::cpu);  // > 16 queries: the tiled schedule
}

}  // namespace qkv
