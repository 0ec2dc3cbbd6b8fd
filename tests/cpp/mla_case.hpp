// The cases of the qkv::mla_decode tests (test_mla_decode.cpp, test_mla_decode_float8.cpp):
// queries and latent caches of any storage type, contiguous or paged with shuffled blocks,
// optional key lists, and an fp64 oracle written from the formula over the stored values,
// with the tolerance both files state (test_mla_decode.cpp's header).
#pragma once

#include <gtest/gtest.h>

#include <qkv/float8.hpp>
#include <qkv/mla.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu/dot_products.hpp"
#include "simd_targets.hpp"
#include "test_support.hpp"

namespace qkv::test {

struct Shape {
  int64_t batch, q_len, heads, dc, dr;
  std::vector<int64_t> lengths;
  int64_t capacity;
  int64_t block_size = 0;  // paged when > 0
};

// Float8 storage only: the caches' per-tensor scales (the stored values are element ·
// scale). Different for the two parts, so that the kpe_scale / ckv_scale factor on q_pe
// is exercised.
struct Float8Scales {
  float ckv = 0.05f, kpe = 0.3f;
};

// A case: queries, the latent caches as stored (T) and widened back to float, a shuffled
// block table when paged, optional key lists.
template <class T>
struct Case {
  static constexpr bool kFloat8 = is_float8(storage_type_of<T>);
  Shape s;
  Float8Scales scales;
  Tensor<float, 4> q_nope, q_pe;
  std::vector<T> ckv, kpe;          // contiguous [B, cap, dc|dr] or pool [blocks, bs, dc|dr]
  std::vector<float> ckv_f, kpe_f;  // the same, widened (float8: times the scale, rounded once to float)
  std::vector<int32_t> table;       // [B, blocks per sequence]
  int64_t blocks = 0;
  std::vector<int64_t> lists;  // [B, Nq, topk], empty: none
  int64_t topk = 0;

  Case(const Shape& shape, std::uint64_t seed, int64_t list_len = 0, Float8Scales float8_scales = {})
      : s(shape), scales(float8_scales) {
    q_nope = random_tensor<float, 4>({s.batch, s.q_len, s.heads, s.dc}, seed);
    q_pe = random_tensor<float, 4>({s.batch, s.q_len, s.heads, s.dr}, seed + 1);
    const int64_t per_seq = s.block_size > 0 ? (s.capacity + s.block_size - 1) / s.block_size : 0;
    const int64_t rows = s.block_size > 0 ? s.batch * per_seq * s.block_size : s.batch * s.capacity;
    blocks = s.block_size > 0 ? s.batch * per_seq : 0;
    std::mt19937_64 rng(seed + 2);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    // Float8: elements of about unit size over the scale, so the values are of about unit
    // size and the elements span many binades.
    const auto fill = [&](std::vector<T>& stored, std::vector<float>& widened, int64_t dim, float scale) {
      stored.resize(static_cast<std::size_t>(rows * dim));
      widened.resize(stored.size());
      for (std::size_t i = 0; i < stored.size(); ++i) {
        stored[i] = static_cast<T>(normal(rng) / scale);
        widened[i] = static_cast<float>(stored[i]) * scale;
      }
    };
    fill(ckv, ckv_f, s.dc, kFloat8 ? scales.ckv : 1.0f);
    fill(kpe, kpe_f, s.dr, kFloat8 ? scales.kpe : 1.0f);
    if (s.block_size > 0) {
      table.resize(static_cast<std::size_t>(blocks));
      std::iota(table.begin(), table.end(), 0);
      std::shuffle(table.begin(), table.end(), rng);
    }
    if (list_len > 0) {
      topk = list_len;
      lists.resize(static_cast<std::size_t>(s.batch * s.q_len * topk));
      for (int64_t b = 0; b < s.batch; ++b) {
        const int64_t len = s.lengths[static_cast<std::size_t>(b)];
        for (std::size_t t = 0; t < static_cast<std::size_t>(s.q_len * topk); ++t) {
          const auto pick = rng() % 6;
          lists[static_cast<std::size_t>(b * s.q_len * topk) + t] =
              len == 0 || pick == 0 ? -1 : static_cast<int64_t>(rng() % static_cast<uint64_t>(len));
        }
      }
    }
  }

  // Row of key j of sequence b in the caches (through the table when paged).
  int64_t row(int64_t b, int64_t j) const {
    if (s.block_size == 0) return b * s.capacity + j;
    const int64_t per_seq = static_cast<int64_t>(table.size()) / s.batch;
    return table[static_cast<std::size_t>(b * per_seq + j / s.block_size)] * s.block_size + j % s.block_size;
  }

  MlaDecodeArgs<T> args(Tensor<float, 4>& out, Tensor<float, 3>& lse) const {
    MlaDecodeArgs<T> a;
    a.q_nope = q_nope.cview();
    a.q_pe = q_pe.cview();
    const int64_t outer = s.block_size > 0 ? blocks : s.batch, inner = s.block_size > 0 ? s.block_size : s.capacity;
    a.ckv_cache = View3<const T>::contiguous(ckv.data(), {outer, inner, s.dc});
    a.kpe_cache = View3<const T>::contiguous(kpe.data(), {outer, inner, s.dr});
    a.cache_lengths = s.lengths;
    if (s.block_size > 0)
      a.block_table = TensorView<const int32_t, 2>::contiguous(table.data(), {s.batch, blocks / s.batch});
    a.out = out.view();
    a.lse = lse.view();
    if (!lists.empty()) a.indices = TensorView<const int64_t, 3>::contiguous(lists.data(), {s.batch, s.q_len, topk});
    if constexpr (kFloat8) {
      a.ckv_scale = scales.ckv;
      a.kpe_scale = scales.kpe;
    }
    return a;
  }
};

struct Oracle {
  std::vector<double> out, lse;
  std::vector<float> plain_out;
  std::vector<double> weighted_abs;  // Σ_j P_j·|v_j| per output element
};

// round_q: the queries rounded to bfloat16 first (what the dot products multiply).
template <class T>
Oracle oracle(const Case<T>& c, double scale, bool round_q = false) {
  const auto q_of = [&](float x) { return round_q ? static_cast<float>(bfloat16(x)) : x; };
  const Shape& s = c.s;
  Oracle o;
  o.out.assign(static_cast<std::size_t>(s.batch * s.q_len * s.heads * s.dc), 0.0);
  o.plain_out.assign(o.out.size(), 0.0f);
  o.weighted_abs.assign(o.out.size(), 0.0);
  o.lse.assign(static_cast<std::size_t>(s.batch * s.heads * s.q_len), -std::numeric_limits<double>::infinity());
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t len = s.lengths[static_cast<std::size_t>(b)];
    for (int64_t i = 0; i < s.q_len; ++i) {
      const int64_t end = std::clamp<int64_t>(i + len - s.q_len + 1, 0, len);
      std::vector<int64_t> keys;
      if (c.lists.empty()) {
        for (int64_t j = 0; j < end; ++j) keys.push_back(j);
      } else {
        std::set<int64_t> set;
        for (int64_t t = 0; t < c.topk; ++t) {
          const int64_t j = c.lists[static_cast<std::size_t>((b * s.q_len + i) * c.topk + t)];
          if (j >= 0 && j < end) set.insert(j);
        }
        keys.assign(set.begin(), set.end());
      }
      if (keys.empty()) continue;
      for (int64_t h = 0; h < s.heads; ++h) {
        std::vector<double> sc(keys.size());
        std::vector<float> sc32(keys.size());
        for (std::size_t n = 0; n < keys.size(); ++n) {
          const int64_t r = c.row(b, keys[n]);
          double dot = 0.0;
          float dot32 = 0.0f;
          for (int64_t x = 0; x < s.dc; ++x) {
            const float kx = c.ckv_f[static_cast<std::size_t>(r * s.dc + x)];
            dot += static_cast<double>(q_of(c.q_nope(b, i, h, x))) * kx;
            dot32 += q_of(c.q_nope(b, i, h, x)) * kx;
          }
          for (int64_t x = 0; x < s.dr; ++x) {
            const float kx = c.kpe_f[static_cast<std::size_t>(r * s.dr + x)];
            dot += static_cast<double>(q_of(c.q_pe(b, i, h, x))) * kx;
            dot32 += q_of(c.q_pe(b, i, h, x)) * kx;
          }
          sc[n] = scale * dot;
          sc32[n] = static_cast<float>(scale) * dot32;
        }
        const double m = *std::max_element(sc.begin(), sc.end());
        const float m32 = *std::max_element(sc32.begin(), sc32.end());
        double l = 0.0;
        float l32 = 0.0f;
        for (std::size_t n = 0; n < keys.size(); ++n) {
          l += std::exp(sc[n] - m);
          l32 += std::exp(sc32[n] - m32);
        }
        const std::size_t at = static_cast<std::size_t>(((b * s.q_len + i) * s.heads + h) * s.dc);
        for (std::size_t n = 0; n < keys.size(); ++n) {
          const double p = std::exp(sc[n] - m) / l;
          const float p32 = std::exp(sc32[n] - m32) / l32;
          const int64_t r = c.row(b, keys[n]);
          for (int64_t x = 0; x < s.dc; ++x) {
            o.out[at + static_cast<std::size_t>(x)] += p * c.ckv_f[static_cast<std::size_t>(r * s.dc + x)];
            o.weighted_abs[at + static_cast<std::size_t>(x)] +=
                p * std::abs(static_cast<double>(c.ckv_f[static_cast<std::size_t>(r * s.dc + x)]));
            o.plain_out[at + static_cast<std::size_t>(x)] += p32 * c.ckv_f[static_cast<std::size_t>(r * s.dc + x)];
          }
        }
        o.lse[static_cast<std::size_t>((b * s.heads + h) * s.q_len + i)] = m + std::log(l);
      }
    }
  }
  return o;
}

// out and lse against the oracle: out within twice a plain float32 evaluation's error
// plus 8 ulps of its size (and, on the dot unit — `dots`, the oracle of the bf16-rounded
// queries — what P rounded once to bfloat16 can add to each element, u·Σ_j P_j·|v_j|,
// u = 2⁻⁸); lse within 1e-5 relative, −inf exactly where the oracle's is.
inline void expect_near_oracle(const Oracle& o, const float* out, const float* lse, bool dots) {
  double err = 0.0, plain_err = 0.0, ref_max = 0.0;
  for (std::size_t n = 0; n < o.out.size(); ++n) {
    err = std::max(err, std::abs(out[n] - o.out[n]) - (dots ? o.weighted_abs[n] / 256.0 : 0.0));
    plain_err = std::max(plain_err, std::abs(o.plain_out[n] - o.out[n]));
    ref_max = std::max(ref_max, std::abs(o.out[n]));
  }
  const double floor = 8.0 * std::numeric_limits<float>::epsilon() * std::max(1.0, ref_max);
  EXPECT_LE(err, 2.0 * plain_err + floor) << "plain float32 error " << plain_err;
  for (std::size_t n = 0; n < o.lse.size(); ++n) {
    if (std::isinf(o.lse[n])) {
      EXPECT_TRUE(std::isinf(lse[n]) && lse[n] < 0) << "lse " << n << " = " << lse[n];
    } else {
      EXPECT_NEAR(lse[n], o.lse[n], 1e-5 * std::max(1.0, std::abs(o.lse[n]))) << "lse " << n;
    }
  }
}

inline AttentionOptions step_options(double scale, int threads = 2, Backend backend = Backend::automatic,
                              Precision precision = Precision::fast) {
  AttentionOptions o;
  o.precision = precision;
  o.scale = scale;
  o.causal = Causal::bottom_right;
  o.execution.threads = threads;
  o.execution.backend = backend;
  return o;
}

template <class T>
void expect_matches(const Case<T>& c, Backend backend, const std::string& what, Precision precision = Precision::exact) {
  SCOPED_TRACE(what);
  const double scale = 0.3;
  const Shape& s = c.s;
  Tensor<float, 4> out({s.batch, s.q_len, s.heads, s.dc});
  Tensor<float, 3> lse({s.batch, s.heads, s.q_len});
  mla_decode(c.args(out, lse), step_options(scale, 2, backend, precision));
  // The dot products (bf16 cache, Precision::fast, a CPU with the unit forced on by the
  // caller): against the oracle of the bf16-rounded queries, with what P rounded once to
  // bfloat16 can add to each element, u·Σ_j P_j·|v_j| (u = 2⁻⁸).
  // Float8 on the dot unit rounds q_pe · (kpe_scale / ckv_scale), not q_pe: that path's bits
  // are checked against the combined pool's instead (test_mla_decode_float8.cpp).
  if constexpr (Case<T>::kFloat8) {
    ASSERT_EQ(precision, Precision::exact) << "float8: exact only here";
  }
  const bool dots = std::is_same_v<T, bfloat16> && precision == Precision::fast && cpu::bf16_dot_products(precision);
  expect_near_oracle(oracle(c, scale, dots), out.data(), lse.data(), dots);
}

// Nq 1..4 against lengths 0, below Nq, one block, many blocks; widened (dc 12, dr 4) and
// in place where the target's vectors allow (dc 32, dr 16; dc 64 dr 16 for 16 lanes).
inline std::vector<Shape> shapes() {
  std::vector<Shape> all;
  for (int64_t q_len : {1, 2, 4})
    for (auto [dc, dr] : {std::pair<int64_t, int64_t>{12, 4}, {32, 16}, {64, 16}})
      for (int64_t block : {0, 8}) all.push_back({3, q_len, 5, dc, dr, {0, 2, 77}, 80, block});
  all.push_back({1, 1, 16, 64, 16, {300}, 300, 16});  // DeepSeek-like wide head group, several chunks
  return all;
}

template <class T>
void every_shape(const char* storage) {
  test::for_each_simd_target([&](int64_t) {
    std::uint64_t seed = 11;
    for (const Shape& s : shapes()) {
      const std::string what = std::string(storage) + " Nq " + std::to_string(s.q_len) + " dc " +
                               std::to_string(s.dc) + " dr " + std::to_string(s.dr) +
                               (s.block_size > 0 ? " paged" : " contiguous");
      expect_matches(Case<T>(s, seed++), Backend::automatic, what);
      expect_matches(Case<T>(s, seed++, 9), Backend::automatic, what + " indices");
    }
  });
}

// A bad call: a qkv::Error naming the argument, and the outputs left as they were.
template <class T = float>
void expect_refused(const std::function<void(MlaDecodeArgs<std::type_identity_t<T>>&, AttentionOptions&)>& spoil,
                    const std::string& needle) {
  SCOPED_TRACE(needle);
  const Case<T> c({2, 2, 4, 16, 8, {5, 9}, 16, 8}, 3, 4);
  Tensor<float, 4> out({2, 2, 4, 16});
  Tensor<float, 3> lse({2, 4, 2});
  fill(out, 7.0f);
  fill(lse, 7.0f);
  MlaDecodeArgs<T> a = c.args(out, lse);
  AttentionOptions o = step_options(0.25);
  spoil(a, o);
  expect_error([&] { mla_decode(a, o); }, needle);
  for (std::size_t n = 0; n < out.size(); ++n) ASSERT_EQ(out[n], 7.0f) << "out written by a failed call";
  for (std::size_t n = 0; n < lse.size(); ++n) ASSERT_EQ(lse[n], 7.0f) << "lse written by a failed call";
}

// Out and lse of 1, 2 and 3 threads: bitwise equal.
template <class T>
void expect_same_bits_for_any_thread_count(const Case<T>& c, Precision precision = Precision::fast) {
  const Shape& s = c.s;
  std::vector<std::vector<float>> results;
  for (int threads : {1, 2, 3}) {
    Tensor<float, 4> out({s.batch, s.q_len, s.heads, s.dc});
    Tensor<float, 3> lse({s.batch, s.heads, s.q_len});
    mla_decode(c.args(out, lse), step_options(0.2, threads, Backend::automatic, precision));
    std::vector<float> all(out.data(), out.data() + out.size());
    all.insert(all.end(), lse.data(), lse.data() + lse.size());
    results.push_back(std::move(all));
  }
  for (std::size_t t = 1; t < results.size(); ++t)
    EXPECT_EQ(0, std::memcmp(results[0].data(), results[t].data(), results[0].size() * sizeof(float)))
        << "threads " << t + 1 << " differ from 1";
}

}  // namespace qkv::test
