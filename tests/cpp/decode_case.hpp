// A decode problem for the tests: random q/k/v (attention_cases.hpp), the cache in its
// storage type, contiguous or as a shuffled paged pool, NaN wherever no key lives; the
// variants (window, soft-cap, ALiBi, sinks) set alike for qkv::decode and the
// reference's AttentionOptions. Shared by test_decode.cpp and test_decode_variants.cpp;
// the comparisons (widen, error, max_abs) are cpu_check.hpp's.
#pragma once

#include <qkv/decode.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attention_cases.hpp"
#include "cpu_check.hpp"  // widen, error, max_abs

namespace qkv::test {

struct DecodeSpec {
  std::string name;
  int64_t batch = 1, q_len = 1, capacity = 64, q_heads = 1, kv_heads = 1, head_dim = 64, v_dim = 64;
  std::vector<int64_t> lengths;  // empty: every sequence full
  StorageType type = StorageType::float32;
  int64_t block_size = 0;  // 0: contiguous cache
  Causal causal = Causal::bottom_right;
  int threads = 2;
  // Variants (all off by default): per-head ALiBi slopes and sinks are drawn from the
  // seed when switched on.
  Window window;
  float softcap = 0.0f;
  bool alibi = false;
  bool sinks = false;

  bool has_variants() const { return window.active() || softcap > 0.0f || alibi || sinks; }
};

template <class T>
T to_storage(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return T(x);
}

// int8 storage: each row (b, j, h) of x quantized with its own scale max|row|/127 (as
// KVCache does); x becomes the values the int8 cache holds, q · scale.
inline void quantize_rows(Tensor<float, 4>& x, Tensor<std::int8_t, 4>& q, Tensor<float, 3>& scales) {
  const auto shape = x.shape();
  q = Tensor<std::int8_t, 4>(shape);
  scales = Tensor<float, 3>({shape[0], shape[1], shape[2]});
  for (int64_t b = 0; b < shape[0]; ++b)
    for (int64_t j = 0; j < shape[1]; ++j)
      for (int64_t h = 0; h < shape[2]; ++h) {
        float largest = 0.0f;
        for (int64_t c = 0; c < shape[3]; ++c) largest = std::max(largest, std::abs(x(b, j, h, c)));
        const float scale = largest / 127.0f;
        scales(b, j, h) = scale;
        for (int64_t c = 0; c < shape[3]; ++c) {
          const float v = scale == 0.0f ? 0.0f : std::clamp(std::nearbyint(x(b, j, h, c) / scale), -127.0f, 127.0f);
          q(b, j, h, c) = static_cast<std::int8_t>(v);
          x(b, j, h, c) = v * scale;
        }
      }
}

// float8 storage: one scale per kv head, max |x| of the head / the format's largest
// finite value (as KVCache sets them at its first append); x becomes float8(x / s) · s.
template <class T>
std::vector<float> quantize_float8(Tensor<float, 4>& x) {
  const auto shape = x.shape();
  std::vector<float> scales(static_cast<std::size_t>(shape[2]), 0.0f);
  for (std::size_t i = 0; i < x.size(); ++i) {
    float& s = scales[i / static_cast<std::size_t>(shape[3]) % static_cast<std::size_t>(shape[2])];
    s = std::max(s, std::abs(x[i]));
  }
  for (float& s : scales) s = s > 0.0f ? s / T::kMax : 1.0f;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const float s = scales[i / static_cast<std::size_t>(shape[3]) % static_cast<std::size_t>(shape[2])];
    x[i] = static_cast<float>(T(x[i] / s)) * s;
  }
  return scales;
}

// One decode problem: the case's values rounded to the storage type, the cache in
// storage (contiguous or a shuffled paged pool) with NaN everywhere no key lives (int8:
// NaN scales there). float8: one scale per kv head, handed to decode as a per-row view
// with strides {0, 0, 1}.
template <class T>
struct DecodeCase {
  static constexpr bool kInt8 = std::is_same_v<T, std::int8_t>;
  static constexpr bool kFloat8 = is_float8(storage_type_of<T>);
  std::vector<float> k_head_scale, v_head_scale;  // float8
  test::Case<float> c;
  Tensor<T, 4> k_cache, v_cache;
  Tensor<float, 3> k_scale, v_scale;  // int8: the cache rows' scales, shaped like its first axes
  Tensor<int32_t, 2> table;
  std::vector<int64_t> lengths;
  std::vector<float> alibi_slopes, sinks;  // per query head, when the spec asks

  explicit DecodeCase(const DecodeSpec& s, std::uint64_t seed = 7)
      : c(test::CaseSpec{.name = s.name, .batch = s.batch, .q_len = s.q_len, .k_len = s.capacity,
                         .q_heads = s.q_heads, .kv_heads = s.kv_heads, .head_dim = s.head_dim,
                         .v_dim = s.v_dim, .causal = s.causal},
          seed) {
    lengths = s.lengths.empty() ? std::vector<int64_t>(static_cast<std::size_t>(s.batch), s.capacity) : s.lengths;
    c.key_lengths = lengths;
    c.options.key_lengths = c.key_lengths;
    std::mt19937 variant_rng(static_cast<unsigned>(seed) + 1);
    for (int64_t h = 0; h < s.q_heads; ++h) {
      // ALiBi's geometric slopes 2^(−8(h+1)/H); sinks of the size of typical logits.
      if (s.alibi) alibi_slopes.push_back(std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(s.q_heads)));
      if (s.sinks) sinks.push_back(std::uniform_real_distribution<float>(-2.0f, 3.0f)(variant_rng));
    }
    c.options.window = s.window;
    c.options.softcap = s.softcap;
    c.options.alibi_slopes = alibi_slopes;
    c.options.sinks = sinks;
    Tensor<std::int8_t, 4> kq, vq;  // int8: the quantized rows
    Tensor<float, 3> kq_scale, vq_scale;
    if constexpr (kInt8) {
      quantize_rows(c.k, kq, kq_scale);
      quantize_rows(c.v, vq, vq_scale);
    } else if constexpr (kFloat8) {
      k_head_scale = quantize_float8<T>(c.k);
      v_head_scale = quantize_float8<T>(c.v);
    } else {
      for (std::size_t i = 0; i < c.k.size(); ++i) c.k[i] = static_cast<float>(to_storage<T>(c.k[i]));
      for (std::size_t i = 0; i < c.v.size(); ++i) c.v[i] = static_cast<float>(to_storage<T>(c.v[i]));
    }
    const T poison = kInt8 ? T{} : to_storage<T>(std::nanf(""));
    auto copy_rows = [&](Tensor<T, 4>& dst, Tensor<float, 3>& dst_scale, const Tensor<float, 4>& src,
                         const Tensor<std::int8_t, 4>& src_q, const Tensor<float, 3>& src_scale, int64_t b,
                         int64_t j, int64_t block, int64_t row) {
      const int64_t heads = src.shape()[2], dim = src.shape()[3];
      const bool live = j < lengths[static_cast<std::size_t>(b)];
      for (int64_t h = 0; h < heads; ++h) {
        if constexpr (kInt8) dst_scale(block, row, h) = live ? src_scale(b, j, h) : std::nanf("");
        for (int64_t x = 0; x < dim; ++x) {
          if constexpr (kInt8) {
            dst(block, row, h, x) = live ? src_q(b, j, h, x) : poison;
          } else if constexpr (kFloat8) {  // the stored value over its head's scale: exact
            const float head_scale = (&src == &c.k ? k_head_scale : v_head_scale)[static_cast<std::size_t>(h)];
            dst(block, row, h, x) = live ? T(src(b, j, h, x) / head_scale) : poison;
          } else {
            dst(block, row, h, x) = live ? to_storage<T>(src(b, j, h, x)) : poison;
          }
        }
      }
    };
    auto copy_key = [&](int64_t b, int64_t j, int64_t block, int64_t row) {
      copy_rows(k_cache, k_scale, c.k, kq, kq_scale, b, j, block, row);
      copy_rows(v_cache, v_scale, c.v, vq, vq_scale, b, j, block, row);
    };
    auto allocate = [&](int64_t rows0, int64_t rows1) {
      k_cache = Tensor<T, 4>({rows0, rows1, s.kv_heads, s.head_dim});
      v_cache = Tensor<T, 4>({rows0, rows1, s.kv_heads, s.v_dim});
      if constexpr (kInt8) {
        k_scale = Tensor<float, 3>({rows0, rows1, s.kv_heads});
        v_scale = Tensor<float, 3>({rows0, rows1, s.kv_heads});
        for (std::size_t i = 0; i < k_scale.size(); ++i) k_scale[i] = v_scale[i] = std::nanf("");
      }
    };
    if (s.block_size == 0) {
      allocate(s.batch, s.capacity);
      for (int64_t b = 0; b < s.batch; ++b)
        for (int64_t j = 0; j < s.capacity; ++j) copy_key(b, j, b, j);
      return;
    }
    const int64_t per_sequence = (s.capacity + s.block_size - 1) / s.block_size;
    const int64_t pool = s.batch * per_sequence + 3;  // a few blocks nobody uses
    std::vector<int32_t> order(static_cast<std::size_t>(pool));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(seed)));
    allocate(pool, s.block_size);
    for (std::size_t i = 0; i < k_cache.size(); ++i) k_cache[i] = poison;
    for (std::size_t i = 0; i < v_cache.size(); ++i) v_cache[i] = poison;
    table = Tensor<int32_t, 2>({s.batch, per_sequence});
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t n = 0; n < per_sequence; ++n) {
        const bool used = n * s.block_size < lengths[static_cast<std::size_t>(b)];
        table(b, n) = used ? order[static_cast<std::size_t>(b * per_sequence + n)] : -1;
        if (!used) continue;
        for (int64_t row = 0; row < s.block_size; ++row) {
          const int64_t j = n * s.block_size + row;
          if (j >= s.capacity) break;
          copy_key(b, j, table(b, n), row);
        }
      }
  }

  DecodeArgs<T> args(Tensor<float, 4>& out, Tensor<float, 3>& lse) const {
    DecodeArgs<T> a;
    a.q = c.q.cview();
    a.k_cache = k_cache.cview();
    a.v_cache = v_cache.cview();
    a.cache_lengths = lengths;
    if (table.size() > 0) a.block_table = table.cview();
    if constexpr (kInt8) {
      a.k_scale = k_scale.cview();
      a.v_scale = v_scale.cview();
    }
    if constexpr (kFloat8) {  // per head: strides 0 along the rows
      const auto rows = [&](const Tensor<T, 4>& cache) {
        return std::array<int64_t, 3>{cache.shape()[0], cache.shape()[1], cache.shape()[2]};
      };
      a.k_scale = View3<const float>(k_head_scale.data(), rows(k_cache), {0, 0, 1});
      a.v_scale = View3<const float>(v_head_scale.data(), rows(v_cache), {0, 0, 1});
    }
    a.out = out.view();
    a.lse = lse.view();
    return a;
  }
};

struct Outputs {
  Tensor<float, 4> out;
  Tensor<float, 3> lse;
};

template <class T>
Outputs run_decode(const DecodeCase<T>& dc, const DecodeSpec& s, int threads, Precision precision = Precision::fast) {
  Outputs r{Tensor<float, 4>({s.batch, s.q_len, s.q_heads, s.v_dim}), Tensor<float, 3>({s.batch, s.q_heads, s.q_len})};
  AttentionOptions options;
  options.causal = s.causal;
  options.execution.threads = threads;
  options.window = s.window;
  options.softcap = s.softcap;
  options.alibi_slopes = dc.alibi_slopes;
  options.sinks = dc.sinks;
  options.precision = precision;
  decode(dc.args(r.out, r.lse), options);
  return r;
}

// The fp64 oracle: attention over the case's stored values (dc.c holds them: rounded to
// the storage type, or int8 · scale), through the reference backend.
struct Reference64 {
  Tensor<double, 4> out;
  Tensor<double, 3> lse;
};

template <class T>
Reference64 reference_of(const DecodeCase<T>& dc, const DecodeSpec& s) {
  const auto q = widen<double>(dc.c.q), k = widen<double>(dc.c.k), v = widen<double>(dc.c.v);
  Reference64 r{Tensor<double, 4>({s.batch, s.q_len, s.q_heads, s.v_dim}), Tensor<double, 3>({s.batch, s.q_heads, s.q_len})};
  attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = r.out.view(), .lse = r.lse.view()},
                    dc.c.options);
  return r;
}

}  // namespace qkv::test
