// qkv::decode over int8 caches with Precision::fast on AVX512-VNNI (cpu/int8_dot.hpp):
// query rows and weights as two int8 terms each, exact int32 dot products with the stored
// rows. Forced on (skipped where the CPU lacks VNNI), against the same call in
// Precision::exact (the float32 arithmetic over the same stored values, itself tested
// against the fp64 reference in test_decode.cpp). The bound is derived, not fitted:
//
//   scores: q_r (scale·q) is split with step s_r = max_c |q_rc| / 127 into hi + lo/254,
//   so each element moves by at most s_r/508 and each logit by δ_rj ≤ (s_r/508)·Σ_c |k_jc|
//   (k the stored values). Weights then change by a factor within e^(±2δ), δ = max δ_rj:
//   at most (e^(2δ) − 1)·max|v| on the output.
//   weights: a block's P'_j = P_j·(v_j's scale) is split with t = max_j P'_j / 255 into
//   hi + lo/255, within t/510 each; a block holds at most kDecodeMaxBlockKeys keys of
//   |v_int| ≤ 127, and the blocks' largest weights sum to at most l, so the output moves by
//   at most max|v|·kDecodeMaxBlockKeys/(255·510).
//   plus the float32 noise of either arithmetic (1e-5·max(1, max|out|)).
//
// Also: the P·V kernel alone against float64 (subnormal weights, dv tails), every SIMD
// target, thread counts bitwise, odd head dims (masked loads where the float path packs),
// paged caches, variants, NaN value rows (visible: NaN reaches exactly the rows that see
// them; hidden: nothing), Precision::exact and the switch off unchanged, and that the
// path really runs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpu/decode.hpp"       // decode_vector_lanes
#include "cpu/decode_plan.hpp"  // kDecodeMaxBlockKeys
#include "cpu/dot_products.hpp"
#include "cpu/int8_dot.hpp"
#include "decode_case.hpp"
#include "half_check.hpp"  // ForcedDotProducts
#include "simd_targets.hpp"

namespace qkv {
namespace {

using test::DecodeCase;
using test::DecodeSpec;

double two_term_bound(const DecodeCase<std::int8_t>& dc, const DecodeSpec& s, double max_out) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  const int64_t group = s.q_heads / s.kv_heads;
  double delta = 0.0, max_v = 0.0;
  for (std::size_t i = 0; i < dc.c.v.size(); ++i) max_v = std::max(max_v, std::abs(double{dc.c.v[i]}));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t i = 0; i < s.q_len; ++i)
      for (int64_t h = 0; h < s.q_heads; ++h) {
        double largest = 0.0;
        for (int64_t c = 0; c < s.head_dim; ++c) largest = std::max(largest, std::abs(scale * dc.c.q(b, i, h, c)));
        const double step = largest / 127.0;
        for (int64_t j = 0; j < dc.lengths[static_cast<std::size_t>(b)]; ++j) {
          double norm1 = 0.0;
          for (int64_t c = 0; c < s.head_dim; ++c) norm1 += std::abs(double{dc.c.k(b, j, h / group, c)});
          delta = std::max(delta, step / 508.0 * norm1);
        }
      }
  const double weights = max_v * static_cast<double>(cpu::kDecodeMaxBlockKeys) / (255.0 * 510.0);
  return (std::exp(2 * delta) - 1) * max_v + weights + 1e-5 * std::max(1.0, max_out);
}

struct Compared {
  double worst = 0.0, max_out = 0.0;
};

Compared compare(const test::Outputs& fast, const test::Outputs& exact) {
  Compared c;
  for (std::size_t i = 0; i < exact.out.size(); ++i) {
    c.max_out = std::max(c.max_out, std::abs(double{exact.out[i]}));
    c.worst = std::max(c.worst, std::abs(double{fast.out[i]} - double{exact.out[i]}));
  }
  return c;
}

// The VNNI path runs on SIMD targets whose vectors hold a multiple of 4 keys — not on
// HWY_SCALAR (the sanitizer build's only target, or forced), where it stays the float32
// arithmetic, bitwise.
void check(const DecodeSpec& spec) {
  const bool dots = cpu::decode_vector_lanes() % 4 == 0;
  SCOPED_TRACE(spec.name + " block=" + std::to_string(spec.block_size));
  DecodeSpec s = spec;
  s.type = StorageType::int8;
  const DecodeCase<std::int8_t> dc(s);
  const test::Outputs exact = test::run_decode(dc, s, 2, Precision::exact);
  const test::ForcedDotProducts on(true);
  const test::Outputs fast = test::run_decode(dc, s, 2, Precision::fast);
  const Compared c = compare(fast, exact);
  const double bound = two_term_bound(dc, s, c.max_out);
  EXPECT_LE(c.worst, bound) << "max |out| " << c.max_out;
  // (d = 1: q splits into ±127·s_r exactly, and small cases can round alike.)
  if (!dots) {
    EXPECT_EQ(c.worst, 0.0) << "the float32 arithmetic was expected";
  } else if (s.head_dim > 1) {
    EXPECT_GT(c.worst, 0.0) << "forced on, the int8 dot products never ran";
  }
  double lse_worst = 0.0;
  for (std::size_t i = 0; i < exact.lse.size(); ++i)
    lse_worst = std::max(lse_worst, std::abs(double{fast.lse[i]} - double{exact.lse[i]}));
  EXPECT_LE(lse_worst, 2 * std::log1p(bound) + 1e-5) << "lse";  // the weights' e^(±2δ)
  if (std::getenv("QKV_TEST_PRINT_ERRORS") != nullptr)
    std::printf("%s: max |fast - exact| = %.3g = %.3g%% of max |out| (bound %.3g)\n", s.name.c_str(), c.worst,
                100 * c.worst / c.max_out, bound);
  for (int threads : {1, 3}) {
    const test::Outputs again = test::run_decode(dc, s, threads, Precision::fast);
    EXPECT_EQ(std::memcmp(again.out.data(), fast.out.data(), fast.out.size() * sizeof(float)), 0) << threads;
    EXPECT_EQ(std::memcmp(again.lse.data(), fast.lse.data(), fast.lse.size() * sizeof(float)), 0) << threads;
  }
}

#define QKV_REQUIRE_VNNI() \
  if (!cpu::cpu_has_int8_dot()) GTEST_SKIP() << "no AVX512-VNNI on this CPU"

TEST(Int8Dot, DecodeWithinTheTwoTermBound) {
  QKV_REQUIRE_VNNI();
  const std::vector<DecodeSpec> specs{
      {.name = "gqa4_d128", .batch = 2, .q_len = 1, .capacity = 700, .q_heads = 8, .kv_heads = 2,
       .head_dim = 128, .v_dim = 128, .lengths = {700, 333}},
      {.name = "gqa8_q3_d64", .batch = 1, .q_len = 3, .capacity = 300, .q_heads = 16, .kv_heads = 2},
      {.name = "mha_d128_rows1", .batch = 1, .q_len = 1, .capacity = 500, .q_heads = 4, .kv_heads = 4,
       .head_dim = 128, .v_dim = 128},
      {.name = "odd_dims", .batch = 2, .q_len = 3, .capacity = 77, .q_heads = 3, .kv_heads = 1,
       .head_dim = 59, .v_dim = 13, .lengths = {77, 2}},
      {.name = "d1", .batch = 1, .q_len = 1, .capacity = 5, .head_dim = 1, .v_dim = 1},
      {.name = "d200_mqa", .batch = 1, .q_len = 4, .capacity = 100, .q_heads = 4, .kv_heads = 1,
       .head_dim = 200, .v_dim = 72, .lengths = {97}},
      {.name = "dv_past_64", .batch = 1, .q_len = 2, .capacity = 150, .q_heads = 6, .kv_heads = 2,
       .head_dim = 96, .v_dim = 80},
      {.name = "chunks_paged", .batch = 2, .q_len = 1, .capacity = 2600, .q_heads = 8, .kv_heads = 8,
       .lengths = {2600, 1100}, .block_size = 16},
      {.name = "variants", .batch = 1, .q_len = 2, .capacity = 200, .q_heads = 4, .kv_heads = 2,
       .head_dim = 64, .v_dim = 64, .window = {50, 0}, .softcap = 20.0f, .alibi = true, .sinks = true},
  };
  for (const DecodeSpec& s : specs) check(s);
}

// The VNNI products serve every Highway target's softmax and merge (blocks of whole
// vectors of keys: 4, 8 or 16 lanes, multiples of the products' 4 keys; HWY_SCALAR's
// single lanes keep the float32 arithmetic).
TEST(Int8Dot, EverySimdTarget) {
  QKV_REQUIRE_VNNI();
  test::for_each_simd_target([](int64_t) {
    check({.name = "targets", .batch = 2, .q_len = 2, .capacity = 301, .q_heads = 8, .kv_heads = 2,
           .head_dim = 72, .v_dim = 40, .lengths = {301, 45}, .block_size = 16});
  });
}

// A NaN value row (its scale NaN, as KVCache stores a non-finite row): the rows that see
// it get NaN, the rows that do not stay finite and within the bound.
TEST(Int8Dot, NonFiniteValueRowsReachOnlyTheRowsThatSeeThem) {
  QKV_REQUIRE_VNNI();
  DecodeSpec s{.name = "nan_rows", .batch = 2, .q_len = 3, .capacity = 200, .q_heads = 4, .kv_heads = 2,
               .lengths = {200, 150}};
  s.type = StorageType::int8;
  s.window = {40, 0};  // query i sees keys (L − 3 + i − 40, L − 3 + i]
  DecodeCase<std::int8_t> dc(s);
  dc.v_scale(0, 199, 0) = std::nanf("");  // seen only by batch 0's last query, kv head 0
  dc.v_scale(1, 10, 1) = std::nanf("");   // behind every query's window
  const test::Outputs exact = test::run_decode(dc, s, 2, Precision::exact);
  const test::ForcedDotProducts on(true);
  const test::Outputs fast = test::run_decode(dc, s, 2, Precision::fast);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t i = 0; i < s.q_len; ++i)
      for (int64_t h = 0; h < s.q_heads; ++h) {
        const bool sees_nan = b == 0 && i == 2 && h / 2 == 0;
        for (int64_t c = 0; c < s.v_dim; ++c) {
          const float f = fast.out(b, i, h, c), e = exact.out(b, i, h, c);
          if (sees_nan) {
            EXPECT_TRUE(std::isnan(f) && std::isnan(e)) << b << " " << i << " " << h;
          } else {
            ASSERT_TRUE(std::isfinite(f)) << b << " " << i << " " << h;
            EXPECT_NEAR(f, e, 1e-3) << b << " " << i << " " << h;
          }
        }
      }
}

// The P·V kernel alone against float64, on weights decode can produce: ordinary ones,
// a row whose largest weight is below float's smallest normal (P·v_scale of a cache whose
// values are ~1e-38, or a block ~90 logits under an earlier block's maximum), an all-zero
// row; dv not
// a multiple of 64 (the channel order restored after the interleave, nothing written
// past dv). Bound per element: Σ_j |v_j|·t/510 (the split) + float32 rounding.
TEST(Int8Dot, WeightedValuesAgainstFloat64) {
  QKV_REQUIRE_VNNI();
  const std::size_t rows = 3, keys = 24, dv = 80, acc_ld = 96;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<std::int8_t> values(keys * dv);
  for (auto& x : values) x = static_cast<std::int8_t>(static_cast<int>(rng() % 255) - 127);
  std::vector<const std::int8_t*> v(keys);
  for (std::size_t j = 0; j < keys; ++j) v[j] = values.data() + j * dv;
  std::vector<float> p(rows * keys), alpha{0.5f, 1.0f, 0.25f}, acc(rows * acc_ld);
  for (std::size_t j = 0; j < keys; ++j) {
    p[j] = unit(rng);
    p[keys + j] = unit(rng) * 1e-40f;  // subnormal weights
    p[2 * keys + j] = 0.0f;
  }
  for (auto& x : acc) x = unit(rng) - 0.5f;
  std::fill(acc.begin() + acc_ld, acc.begin() + 2 * acc_ld, 0.0f);  // row 1: only its tiny sum, no cover
  const std::vector<float> before = acc;
  std::vector<std::uint8_t> weights(cpu::int8dot::weight_bytes(rows, keys));
  std::vector<std::int8_t> interleaved(cpu::int8dot::value_bytes(keys, dv));
  ASSERT_TRUE(cpu::int8dot::AddWeighted(rows, p.data(), keys, keys, v.data(), dv, alpha.data(), acc.data(), acc_ld,
                                        weights.data(), interleaved.data(), {}));
  for (std::size_t r = 0; r < rows; ++r) {
    double largest = 0.0;
    for (std::size_t j = 0; j < keys; ++j) largest = std::max(largest, double{p[r * keys + j]});
    for (std::size_t c = 0; c < acc_ld; ++c) {
      const double old = before[r * acc_ld + c];
      if (c >= dv) {
        EXPECT_EQ(acc[r * acc_ld + c], before[r * acc_ld + c]) << "written past dv: " << r << " " << c;
        continue;
      }
      double sum = 0.0, norm1 = 0.0;
      for (std::size_t j = 0; j < keys; ++j) {
        sum += double{p[r * keys + j]} * values[j * dv + c];
        norm1 += std::abs(static_cast<double>(values[j * dv + c]));
      }
      const double want = old * alpha[r] + sum;
      const double bound = norm1 * largest / 255.0 / 510.0 + 1e-6 * (std::abs(old) + std::abs(sum)) + 1e-45 * norm1;
      EXPECT_NEAR(acc[r * acc_ld + c], want, bound) << r << " " << c;
    }
  }
}

// Precision::exact, and the switch off, keep the float32 arithmetic over int8 caches.
TEST(Int8Dot, ExactIgnoresTheSwitch) {
  DecodeSpec s{.name = "exact", .batch = 1, .q_len = 2, .capacity = 300, .q_heads = 8, .kv_heads = 2};
  s.type = StorageType::int8;
  const DecodeCase<std::int8_t> dc(s);
  test::Outputs off_fast;
  const test::Outputs exact = test::run_decode(dc, s, 2, Precision::exact);
  {
    const test::ForcedDotProducts off(false);
    off_fast = test::run_decode(dc, s, 2, Precision::fast);
  }
  EXPECT_EQ(std::memcmp(exact.out.data(), off_fast.out.data(), exact.out.size() * sizeof(float)), 0);
  if (!cpu::cpu_has_int8_dot()) return;
  const test::ForcedDotProducts on(true);
  const test::Outputs on_exact = test::run_decode(dc, s, 2, Precision::exact);
  EXPECT_EQ(std::memcmp(exact.out.data(), on_exact.out.data(), exact.out.size() * sizeof(float)), 0);
}

// Forced on where the CPU lacks VNNI: every int8 decode says so (as QKV_DOT_PRODUCTS=on),
// under every compiled target, the scalar and emulated ones included (the sanitizer build
// has only its static target, and an AVX2-only CPU runs no AVX-512 one). Where the CPU has
// the unit, forcing it on runs and agrees with the float32 arithmetic within int8's bound,
// checked by the tests above; here it must at least not throw on any target.
TEST(Int8Dot, ForcedOnWithoutTheUnitIsAnError) {
  DecodeSpec s{.name = "no_unit", .q_heads = 2, .kv_heads = 1};
  s.type = StorageType::int8;
  const DecodeCase<std::int8_t> dc(s);
  const test::ForcedDotProducts on(true);
  test::for_each_simd_target([&](int64_t) {
    if (cpu::cpu_has_int8_dot())
      EXPECT_NO_THROW(test::run_decode(dc, s, 1, Precision::fast));
    else
      EXPECT_THROW(test::run_decode(dc, s, 1, Precision::fast), Error);
  });
}

}  // namespace
}  // namespace qkv
