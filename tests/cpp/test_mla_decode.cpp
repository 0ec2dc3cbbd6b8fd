// qkv::mla_decode (absorbed latent attention over c_kv / k_pe caches) against an fp64
// oracle written here from the formula — S = scale·(q_nope·c_kv + q_pe·k_pe), out =
// softmax(S)·c_kv over the keys each query sees (bottom-right causal among the Nq new
// tokens, cut to the cache length, and with indices the listed ones, −1 and repeats
// dropped) — over the stored (rounded) cache values. Every storage (float32, bfloat16,
// float16), contiguous and paged with shuffled blocks, Nq 1..4, cache lengths 0..N,
// head sizes read in place and widened, every compiled SIMD target, the reference
// backend, 1/2/3 threads bitwise equal; bad calls are a qkv::Error naming the argument,
// with nothing written.
//
// Tolerance, as test_decode.cpp's: max |got − ref64| ≤ 2·max |plain32 − ref64| + floor,
// plain32 the same formula as an unfused float32 loop, floor = 8·ε₃₂·max(1, max |ref64|):
// float32 arithmetic (every storage with Precision::exact; float32 and float16 caches
// always). A bfloat16 cache with Precision::fast on a CPU with vdpbf16ps takes the dot
// products (cpu/decode_latent-inl.h): q rounded to bfloat16 once and P once, the bf16
// contract: checked against the oracle of the rounded queries, plus what P rounded once
// can add to each element.
#include <gtest/gtest.h>

#include <qkv/error.hpp>
#include <qkv/decode.hpp>
#include <qkv/float8.hpp>
#include <qkv/mla.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cpu/dot_products.hpp"
#include "forced_vdpbf16ps.hpp"
#include "simd_targets.hpp"
#include "test_support.hpp"

namespace qkv {
namespace {

using test::random_tensor;

struct Shape {
  int64_t batch, q_len, heads, dc, dr;
  std::vector<int64_t> lengths;
  int64_t capacity;
  int64_t block_size = 0;  // paged when > 0
};

// A case: queries, the latent caches as stored (T) and widened back to float, a shuffled
// block table when paged, optional key lists.
template <class T>
struct Case {
  Shape s;
  Tensor<float, 4> q_nope, q_pe;
  std::vector<T> ckv, kpe;          // contiguous [B, cap, dc|dr] or pool [blocks, bs, dc|dr]
  std::vector<float> ckv_f, kpe_f;  // the same, widened
  std::vector<int32_t> table;       // [B, blocks per sequence]
  int64_t blocks = 0;
  std::vector<int64_t> lists;  // [B, Nq, topk], empty: none
  int64_t topk = 0;

  Case(const Shape& shape, std::uint64_t seed, int64_t list_len = 0) : s(shape) {
    q_nope = random_tensor<float, 4>({s.batch, s.q_len, s.heads, s.dc}, seed);
    q_pe = random_tensor<float, 4>({s.batch, s.q_len, s.heads, s.dr}, seed + 1);
    const int64_t per_seq = s.block_size > 0 ? (s.capacity + s.block_size - 1) / s.block_size : 0;
    const int64_t rows = s.block_size > 0 ? s.batch * per_seq * s.block_size : s.batch * s.capacity;
    blocks = s.block_size > 0 ? s.batch * per_seq : 0;
    std::mt19937_64 rng(seed + 2);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const auto fill = [&](std::vector<T>& stored, std::vector<float>& widened, int64_t dim) {
      stored.resize(static_cast<std::size_t>(rows * dim));
      widened.resize(stored.size());
      for (std::size_t i = 0; i < stored.size(); ++i) {
        stored[i] = static_cast<T>(normal(rng));
        widened[i] = static_cast<float>(stored[i]);
      }
    };
    fill(ckv, ckv_f, s.dc);
    fill(kpe, kpe_f, s.dr);
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

AttentionOptions step_options(double scale, int threads = 2, Backend backend = Backend::automatic,
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
  const bool dots = std::is_same_v<T, bfloat16> && precision == Precision::fast && cpu::bf16_dot_products(precision);
  const Oracle o = oracle(c, scale, dots);
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

// Nq 1..4 against lengths 0, below Nq, one block, many blocks; widened (dc 12, dr 4) and
// in place where the target's vectors allow (dc 32, dr 16; dc 64 dr 16 for 16 lanes).
std::vector<Shape> shapes() {
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

// A bfloat16 cache with Precision::fast on vdpbf16ps, forced on: the latent block step
// for tiles of whole vectors of rows (16 heads × Nq 1, 2, 4; a partly visible block
// falls back to the float step within the same rows), within the bound expect_matches
// states — and not the float32 path's bits (the dot products did run).
TEST(MlaDecode, Bfloat16OnTheDotUnitWithinTheBf16Contract) {
  if (!cpu::cpu_has_bf16_dot()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  const test::ForcedVdpbf16ps forced;
  test::for_each_simd_target([&](int64_t) {
    std::uint64_t seed = 41;
    for (int64_t q_len : {1, 2, 4})
      for (int64_t block : {0, 16}) {
        const Shape s{2, q_len, 16, 64, 16, {77, 300}, 304, block};
        const std::string what = "Nq " + std::to_string(q_len) + (block > 0 ? " paged" : " contiguous");
        for (int64_t lists : {0, 40}) {
          const Case<bfloat16> c(s, seed++, lists);
          expect_matches(c, Backend::automatic, what + (lists > 0 ? " indices" : ""), Precision::fast);
          Tensor<float, 4> fast({s.batch, s.q_len, s.heads, s.dc}), exact({s.batch, s.q_len, s.heads, s.dc});
          Tensor<float, 3> lse({s.batch, s.heads, s.q_len});
          mla_decode(c.args(fast, lse), step_options(0.3, 2, Backend::automatic, Precision::fast));
          mla_decode(c.args(exact, lse), step_options(0.3, 2, Backend::automatic, Precision::exact));
          EXPECT_NE(0, std::memcmp(fast.data(), exact.data(), fast.size() * sizeof(float))) << what;
        }
      }
  });
}

// A float8 latent pool (vLLM's FP8 MLA cache: [c_kv | k_pe] rows in float8, one scale for
// the tensor) through qkv::decode, the values the keys' first dc channels, Precision::fast
// with vdpbf16ps forced on: the latent step widens the float8 rows to bfloat16 exactly and
// applies the scale to each block's scores and weights. Against the formula over the
// stored values (float8 × scale) with the bf16-rounded queries, within what the weight
// P·s rounded once to bfloat16 adds, u·Σ_j P_j·|v_j| (u = 2⁻⁸ as above), plus float32 sums
// over ≤ 300 keys of 80 channels ((d + keys)·ε of the largest value). Nq 3: the newest
// keys' partly visible block takes the float step in the same rows. The bits differ
// from Precision::exact's (the dot products ran).
template <class F>
void expect_float8_latent_pool_on_the_dot_unit() {
  const int64_t batch = 2, q_len = 3, heads = 16, dc = 64, dr = 16, d = dc + dr, capacity = 304;
  const std::vector<int64_t> lengths{77, 300};
  const float s8 = 0.02f;
  const Tensor<float, 4> wide = random_tensor<float, 4>({batch, capacity, 1, d}, 5, 1.0 / s8);
  Tensor<F, 4> pool({batch, capacity, 1, d});
  for (std::size_t n = 0; n < pool.size(); ++n) pool[n] = F(wide[n]);
  const Tensor<float, 4> q = random_tensor<float, 4>({batch, q_len, heads, d}, 6);
  const auto kv = pool.cview();
  const View4<const F> values(kv.data, {batch, capacity, 1, dc}, kv.strides);
  const View3<const float> scale8(&s8, {batch, capacity, 1}, {0, 0, 0});
  const double scale = 0.1;
  auto run = [&](Precision precision, Tensor<float, 4>& out, Tensor<float, 3>& lse) {
    decode(DecodeArgs<F>{.q = q.cview(), .k_cache = kv, .v_cache = values, .cache_lengths = lengths,
                         .out = out.view(), .lse = lse.view(), .k_scale = scale8, .v_scale = scale8},
           step_options(scale, 2, Backend::automatic, precision));
  };
  test::for_each_simd_target([&](int64_t) {
    Tensor<float, 4> out({batch, q_len, heads, dc}), exact({batch, q_len, heads, dc});
    Tensor<float, 3> lse({batch, heads, q_len}), exact_lse({batch, heads, q_len});
    run(Precision::fast, out, lse);
    run(Precision::exact, exact, exact_lse);
    EXPECT_NE(0, std::memcmp(out.data(), exact.data(), out.size() * sizeof(float)));
    double largest = 1.0;
    for (std::size_t n = 0; n < pool.size(); ++n) largest = std::max(largest, std::abs(static_cast<double>(float(pool[n])) * s8));
    const double floor = static_cast<double>(d + 300) * std::numeric_limits<float>::epsilon() * largest;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < q_len; ++i)
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t visible = lengths[b] - q_len + i + 1;
          std::vector<double> logit(static_cast<std::size_t>(visible));
          double top = -std::numeric_limits<double>::infinity();
          for (int64_t j = 0; j < visible; ++j) {
            double dot = 0.0;
            for (int64_t c = 0; c < d; ++c)
              dot += static_cast<double>(float(bfloat16(q(b, i, h, c)))) * float(pool(b, j, 0, c)) * s8;
            logit[static_cast<std::size_t>(j)] = scale * dot;
            top = std::max(top, scale * dot);
          }
          double sum = 0.0;
          for (double& x : logit) sum += (x = std::exp(x - top));
          SCOPED_TRACE(testing::Message() << "b " << b << " i " << i << " h " << h);
          EXPECT_NEAR(lse(b, h, i), top + std::log(sum), 1e-5 * std::max(1.0, std::abs(top + std::log(sum))));
          for (int64_t c = 0; c < dc; ++c) {
            double want = 0.0, weighted_abs = 0.0;
            for (int64_t j = 0; j < visible; ++j) {
              const double v = static_cast<double>(float(pool(b, j, 0, c))) * s8, p = logit[static_cast<std::size_t>(j)] / sum;
              want += p * v;
              weighted_abs += p * std::abs(v);
            }
            EXPECT_LE(std::abs(out(b, i, h, c) - want), weighted_abs / 256.0 + floor) << "c " << c;
          }
        }
  });
}

TEST(MlaDecode, Float8LatentPoolOnTheDotUnitWithinTheBf16Contract) {
  if (!cpu::cpu_has_bf16_dot()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  const test::ForcedVdpbf16ps forced;
  expect_float8_latent_pool_on_the_dot_unit<float8_e4m3fn>();
  expect_float8_latent_pool_on_the_dot_unit<float8_e5m2>();
}

TEST(MlaDecode, Float32MatchesTheFormulaOnEveryTarget) { every_shape<float>("float32"); }
TEST(MlaDecode, Bfloat16MatchesTheFormulaOnEveryTarget) { every_shape<bfloat16>("bfloat16"); }
TEST(MlaDecode, Float16MatchesTheFormulaOnEveryTarget) { every_shape<float16>("float16"); }

TEST(MlaDecode, ReferenceBackendMatchesTheFormula) {
  std::uint64_t seed = 101;
  for (const Shape& s : shapes()) {
    expect_matches(Case<float>(s, seed++), Backend::reference, "reference");
    expect_matches(Case<bfloat16>(s, seed++, 7), Backend::reference, "reference bf16 indices");
  }
}

TEST(MlaDecode, BitwiseEqualForAnyThreadCount) {
  for (int64_t block : {0, 16}) {
    const Case<bfloat16> c({2, 3, 16, 64, 16, {700, 1500}, 1504, block}, 7);
    const Case<bfloat16> listed({2, 3, 16, 64, 16, {700, 1500}, 1504, block}, 8, 300);
    for (const Case<bfloat16>* cc : {&c, &listed}) {
      std::vector<std::vector<float>> results;
      for (int threads : {1, 2, 3}) {
        Tensor<float, 4> out({2, 3, 16, 64});
        Tensor<float, 3> lse({2, 16, 3});
        mla_decode(cc->args(out, lse), step_options(0.2, threads));
        std::vector<float> all(out.data(), out.data() + out.size());
        all.insert(all.end(), lse.data(), lse.data() + lse.size());
        results.push_back(std::move(all));
      }
      for (std::size_t t = 1; t < results.size(); ++t)
        EXPECT_EQ(0, std::memcmp(results[0].data(), results[t].data(), results[0].size() * sizeof(float)))
            << "threads " << t + 1 << " differ from 1";
    }
  }
}

// A bad call: a qkv::Error naming the argument, and the outputs left as they were.
void expect_refused(const std::function<void(MlaDecodeArgs<float>&, AttentionOptions&)>& spoil,
                    const std::string& needle) {
  Case<float> c({2, 2, 4, 16, 8, {5, 9}, 16, 8}, 3, 4);
  Tensor<float, 4> out({2, 2, 4, 16});
  Tensor<float, 3> lse({2, 4, 2});
  test::fill(out, 7.0f);
  test::fill(lse, 7.0f);
  MlaDecodeArgs<float> a = c.args(out, lse);
  AttentionOptions o = step_options(0.25);
  spoil(a, o);
  test::expect_error([&] { mla_decode(a, o); }, needle);
  for (std::size_t n = 0; n < out.size(); ++n) ASSERT_EQ(out[n], 7.0f) << "out written by a failed call";
  for (std::size_t n = 0; n < lse.size(); ++n) ASSERT_EQ(lse[n], 7.0f) << "lse written by a failed call";
}

TEST(MlaDecode, BadCallsNameTheArgumentAndWriteNothing) {
  expect_refused([](auto&, AttentionOptions& o) { o.scale.reset(); }, "options.scale: required");
  expect_refused([](auto& a, auto&) { a.q_pe.shape[3] = 4; }, "kpe_cache");
  expect_refused([](auto& a, auto&) { a.q_pe.shape[2] = 3; }, "q_pe");
  expect_refused([](auto& a, auto&) { a.kpe_cache.shape[1] = 4; }, "kpe_cache");
  expect_refused([](auto& a, auto&) { a.out.shape[3] = 8; }, "out");
  expect_refused([](auto& a, auto&) { a.lse.shape[1] = 2; }, "lse");
  static std::vector<int64_t> too_long{5, 17};
  expect_refused([](auto& a, auto&) { a.cache_lengths = too_long; }, "cache_lengths[1]");
  static std::vector<int32_t> bad_table{0, 1, 2, 99};
  expect_refused([](auto& a, auto&) { a.block_table = TensorView<const int32_t, 2>::contiguous(bad_table.data(), {2, 2}); },
                 "block_table[1, 1]");
  static std::vector<int64_t> bad_index(2 * 2 * 4, 0);
  bad_index[5] = 9;  // sequence 0 holds 5 keys
  expect_refused([](auto& a, auto&) { a.indices = TensorView<const int64_t, 3>::contiguous(bad_index.data(), {2, 2, 4}); },
                 "indices");
  expect_refused([](auto&, AttentionOptions& o) { o.window = Window{4, 0}; }, "window");
  static std::vector<int64_t> key_lengths{1, 1};
  expect_refused([](auto&, AttentionOptions& o) { o.key_lengths = key_lengths; }, "key_lengths");
}

}  // namespace
}  // namespace qkv
