// Precision::fast on bfloat16 storage: the AVX512-BF16 block products (cpu/bf16_dot.hpp)
// forced on, against the fp64 reference and the contract of half_check.hpp with P's
// rounding to bfloat16 added (u·max_i (P·|V|)_i) and, for the gradients, P's and dS's
// (half_check.hpp's GradientWeightRounding); forced off and Precision::exact, the
// float32 arithmetic bit for bit; thread-count determinism; odd head and value dims
// (the pairs padded, never refused); variants and varlen against the exact path; the
// option's validation. Each forced-on test runs on every bfloat16 unit the CPU has: the
// AVX512-BF16 kernels (bf16_dot.hpp) and, where there are AMX tiles, amx_dot.hpp's, each
// forced in turn (test::ForcedBf16Unit). On a CPU without AVX512-BF16 the forced-on tests
// are skipped (the switch then makes calls throw, which one test checks).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cpu/bf16_dot.hpp"
#include "half_check.hpp"
#include "simd_targets.hpp"
#include "weighted_sum_oracle.hpp"

namespace qkv {
namespace {

using test::CaseSpec;
using test::ForcedBf16Unit;
using test::ForcedDotProducts;

#define QKV_REQUIRE_BF16_DOT() \
  if (!cpu::cpu_has_bf16_dot()) GTEST_SKIP() << "no AVX512-BF16 on this CPU"

struct DotCase {
  CaseSpec spec;
  bool bhsd = false;
  int threads = 2;
};

std::ostream& operator<<(std::ostream& out, const DotCase& c) { return out << c.spec.name; }

std::vector<DotCase> dot_cases() {
  const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  return {
      {{.name = "n1_d1", .q_len = 1, .k_len = 1, .head_dim = 1, .v_dim = 1}},
      {{.name = "n7_d3_causal", .q_len = 7, .k_len = 7, .head_dim = 3, .v_dim = 3, .causal = Causal::top_left}},
      {{.name = "n63_d59_bhsd", .q_len = 63, .k_len = 63, .head_dim = 59, .v_dim = 59}, true},
      {{.name = "n64_d64_gqa_causal", .batch = 2, .q_len = 64, .k_len = 64, .q_heads = 4, .kv_heads = 2,
        .head_dim = 64, .v_dim = 64, .causal = Causal::top_left}},
      {{.name = "n65_d111_mask", .q_len = 65, .k_len = 65, .head_dim = 111, .v_dim = 111, .keep_mask = true}},
      {{.name = "n65x131_d128_bottom_right", .q_len = 65, .k_len = 131, .head_dim = 128, .v_dim = 128,
        .causal = Causal::bottom_right}, true},
      {{.name = "n130x63_d256_bias", .q_len = 130, .k_len = 63, .q_heads = 2, .kv_heads = 1, .head_dim = 256,
        .v_dim = 256, .bias_mask = true}},
      {{.name = "n100_d96_dv32_padding", .batch = 3, .q_len = 100, .k_len = 100, .head_dim = 96, .v_dim = 32,
        .causal = Causal::top_left, .key_padding = true}, false, 3},
      {{.name = "n70_everything", .batch = 2, .q_len = 70, .k_len = 90, .q_heads = 4, .kv_heads = 2,
        .head_dim = 33, .v_dim = 17, .causal = Causal::bottom_right, .keep_mask = true, .bias_mask = true,
        .key_padding = true, .scale = 0.2}},
      {{.name = "single_pass_odd_dims", .batch = 4 * cores, .q_len = 20, .k_len = 75, .head_dim = 33,
        .v_dim = 17, .causal = Causal::bottom_right, .keep_mask = true, .key_padding = true}, true},
      {{.name = "n3x300_d64_decode_shape", .q_len = 3, .k_len = 300, .q_heads = 8, .kv_heads = 2,
        .head_dim = 64, .v_dim = 64, .causal = Causal::bottom_right}},
#ifndef QKV_TEST_SMALL
      {{.name = "n1000_d64_causal", .q_len = 1000, .k_len = 1000, .head_dim = 64, .v_dim = 64,
        .causal = Causal::top_left}},
#endif
  };
}

class Bf16DotAgainstReference : public ::testing::TestWithParam<DotCase> {};

TEST_P(Bf16DotAgainstReference, WithinTheFastContract) {
  QKV_REQUIRE_BF16_DOT();
  const DotCase& c = GetParam();
  for (const cpu::Bf16Unit unit : test::bf16_units_here()) {
    SCOPED_TRACE(test::unit_name(unit));
    const ForcedBf16Unit on(unit);
    test::check_half_case<bfloat16>(c.spec, c.threads, c.bhsd, 1234, Precision::fast);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Bf16DotAgainstReference, ::testing::ValuesIn(dot_cases()),
                         [](const auto& param_info) { return param_info.param.spec.name; });

// The dot-product kernels are plain AVX-512 code: the Highway target around them (which
// runs the softmax and the masks) must not matter.
TEST(Bf16Dot, EverySimdTargetWithinTheFastContract) {
  QKV_REQUIRE_BF16_DOT();
  for (const cpu::Bf16Unit unit : test::bf16_units_here()) {
    SCOPED_TRACE(test::unit_name(unit));
    const ForcedBf16Unit on(unit);
    test::for_each_simd_target([](int64_t) {
      test::check_half_case<bfloat16>({.name = "t_odd", .q_len = 33, .k_len = 47, .head_dim = 59, .v_dim = 13,
                                       .bias_mask = true, .key_padding = true},
                                      2, false, 1234, Precision::fast);
    });
  }
}

// The forward's P·V kernel and the backward's dQ = dS·K (AddWeightedPairs) called directly:
// every block shape (1–64 keys and queries, odd value dims), against float64 sums of
// bf16(P)·v — P rounded to nearest even once, the Precision::fast contract — within the
// float32 summation's bound ((k − 1)·2⁻²⁴·Σ|terms|) and the fused rescale's one rounding.
TEST(Bf16Dot, WeightedProductsTakePRoundedOnce) {
  QKV_REQUIRE_BF16_DOT();
  std::mt19937 gen(21);
  std::uniform_real_distribution<float> weight(0.0f, 1.0f);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::size_t shapes[][3] = {{1, 1, 1}, {3, 8, 3}, {17, 24, 33}, {40, 40, 59}, {64, 64, 128}, {63, 48, 127}, {64, 16, 17}};
  for (const auto& shape : shapes) {
    for (const bool prepacked : {false, true}) {
      for (const bool rescale : {false, true}) {
        const std::size_t keys = shape[0], count = shape[1], dv = shape[2];
        SCOPED_TRACE(testing::Message() << keys << " keys, " << count << " queries, dv " << dv
                                        << (prepacked ? ", V packed" : "") << (rescale ? ", alpha" : ""));
        const std::size_t pt_ld = (count + 15) / 16 * 16, v_row = dv + 2, acc_ld = dv + 1;
        std::vector<float> pt(keys * pt_ld);
        for (auto& p : pt) p = weight(gen);
        std::vector<bfloat16> v(keys * v_row);
        for (auto& x : v) x = bfloat16(normal(gen));
        std::vector<float> acc(count * acc_ld), alpha(count);
        for (auto& a : acc) a = weight(gen);
        for (auto& a : alpha) a = weight(gen);
        const std::vector<float> before = acc;
        const std::size_t v_ld = cpu::bf16dot::pair_ld(dv);
        std::vector<std::uint32_t> p_pairs(32 * cpu::bf16dot::pair_ld(64)), v_pairs(32 * v_ld, 0xFFFFFFFFu);
        const float* scale_by = rescale ? alpha.data() : nullptr;
        if (prepacked) {
          cpu::bf16dot::PackRowPairs(v.data(), static_cast<std::int64_t>(v_row), keys, dv, v_pairs.data(), v_ld);
          cpu::bf16dot::AddWeightedPairs(pt.data(), pt_ld, count, keys, v_pairs.data(), v_ld, dv, p_pairs.data(),
                                         acc.data(), acc_ld, scale_by);
        } else {
          cpu::bf16dot::RescaleAddWeighted(pt.data(), pt_ld, count, keys, v.data(), static_cast<std::int64_t>(v_row),
                                           dv, {p_pairs.data(), v_pairs.data()}, acc.data(), acc_ld, scale_by);
        }
        for (std::size_t i = 0; i < count; ++i) {
          for (std::size_t x = 0; x < dv; ++x) {
            const auto [sum, magnitude] = test::exact_weighted_sum(pt.data(), pt_ld, v.data(), v_row, keys, i, x);
            const double old = before[i * acc_ld + x];
            const double exact = (rescale ? old * alpha[i] : old) + sum;
            const double bound = static_cast<double>(keys) * 0x1p-24 * magnitude + 0x1p-23 * std::abs(exact) + 1e-30;
            ASSERT_NEAR(acc[i * acc_ld + x], exact, bound) << "query " << i << ", channel " << x;
          }
          ASSERT_EQ(acc[i * acc_ld + dv], before[i * acc_ld + dv]) << "written past dv";
        }
      }
    }
  }
}

bool same_bits(const test::Results& a, const test::Results& b) {
  auto same = [](const auto& x, const auto& y) {
    return std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  };
  return same(a.out, b.out) && same(a.lse, b.lse) && same(a.dq, b.dq) && same(a.dk, b.dk) && same(a.dv, b.dv);
}

const CaseSpec kMixed{.name = "mixed", .batch = 2, .q_len = 150, .k_len = 170, .q_heads = 4, .kv_heads = 2,
                      .head_dim = 63, .v_dim = 48, .causal = Causal::bottom_right, .bias_mask = true,
                      .key_padding = true};

// Precision::exact ignores the switch, and the switch off makes fast exact: the float32
// arithmetic either way, bit for bit (bench/compare_digests.sh checks it against the
// saved baselines too). Forced on, fast really takes the other path.
TEST(Bf16Dot, ExactIsTheFloat32ArithmeticWhateverTheSwitch) {
  Tensor<float, 4> dout;
  const test::Case<float> c = test::half_case<bfloat16>(kMixed, 5, dout);
  test::Results exact_off, fast_off;
  {
    const ForcedDotProducts off(false);
    exact_off = test::run_cpu_half<bfloat16>(c, &dout, 2, false, Precision::exact);
    fast_off = test::run_cpu_half<bfloat16>(c, &dout, 2, false, Precision::fast);
  }
  EXPECT_TRUE(same_bits(exact_off, fast_off));
  for (const cpu::Bf16Unit unit : test::bf16_units_here()) {
  SCOPED_TRACE(test::unit_name(unit));
  const ForcedBf16Unit on(unit);
  EXPECT_TRUE(same_bits(exact_off, test::run_cpu_half<bfloat16>(c, &dout, 2, false, Precision::exact)));
  const test::Results fast_on = test::run_cpu_half<bfloat16>(c, &dout, 2, false, Precision::fast);
  EXPECT_NE(std::memcmp(fast_on.out.data(), exact_off.out.data(), fast_on.out.size() * sizeof(float)), 0)
      << "forced on, Precision::fast gave the float32 path's bits: the dot products never ran";
  EXPECT_NE(std::memcmp(fast_on.dk.data(), exact_off.dk.data(), exact_off.dk.size() * sizeof(float)), 0)
      << "forced on, dk has the float32 path's bits: the backward's dot products never ran";
  // P enters P·V as one bfloat16 term (the fast contract): out moves from the float32
  // path's by at most one bf16 rounding of every weight, 2⁻⁸·Σ_j P_ij·|v_j| (half_check.hpp's
  // max_weighted_abs_value), plus the two results' own storing roundings (one bf16 ulp,
  // 2⁻⁷ relative, each way) and the float32 noise near zero.
  float largest = 0.0f;
  for (std::size_t i = 0; i < exact_off.out.size(); ++i) largest = std::max(largest, std::abs(exact_off.out[i]));
  const double weights = 0x1p-8 * test::max_weighted_abs_value(c);
  for (std::size_t i = 0; i < fast_on.out.size(); ++i) {
    const float a = fast_on.out[i], b = exact_off.out[i];
    EXPECT_LE(std::abs(a - b), std::abs(b) * 0x1p-7f + weights + 1e-5f * largest) << i;
  }
  }
}

// Where both units exist, forcing one or the other really changes the kernels: the AMX
// tiles sum the same exact products in another order, so some bits differ, but the
// float32 sums agree to ~1e-6 and each result (out and the gradients, all stored as
// bfloat16) moves by one bfloat16 ulp at most, where a near-tie rounds the other way.
TEST(Bf16Dot, TheTwoUnitsAreDifferentKernelsWithTheSameProducts) {
  if (test::bf16_units_here().size() < 2) GTEST_SKIP() << "this CPU has one bfloat16 unit at most";
  Tensor<float, 4> dout;
  const test::Case<float> c = test::half_case<bfloat16>(kMixed, 5, dout);
  test::Results avx512, tiles;
  {
    const ForcedBf16Unit on(cpu::Bf16Unit::avx512_bf16);
    avx512 = test::run_cpu_half<bfloat16>(c, &dout, 2, false, Precision::fast);
  }
  {
    const ForcedBf16Unit on(cpu::Bf16Unit::amx);
    tiles = test::run_cpu_half<bfloat16>(c, &dout, 2, false, Precision::fast);
  }
  EXPECT_FALSE(same_bits(avx512, tiles)) << "forcing the tiles gave vdpbf16ps's bits: AMX never ran";
  auto largest = [](const Tensor<float, 4>& x) {
    float m = 0.0f;
    for (std::size_t i = 0; i < x.size(); ++i) m = std::max(m, std::abs(x[i]));
    return m;
  };
  auto worst = [](const Tensor<float, 4>& a, const Tensor<float, 4>& b) {
    float w = 0.0f;
    for (std::size_t i = 0; i < a.size(); ++i) w = std::max(w, std::abs(a[i] - b[i]));
    return w;
  };
  EXPECT_LE(worst(avx512.out, tiles.out), 0x1p-7f * largest(avx512.out));
  EXPECT_LE(worst(avx512.dq, tiles.dq), 0x1p-7f * largest(avx512.dq));
  EXPECT_LE(worst(avx512.dk, tiles.dk), 0x1p-7f * largest(avx512.dk));
  EXPECT_LE(worst(avx512.dv, tiles.dv), 0x1p-7f * largest(avx512.dv));
}

// float16 and float32 storage have no dot product here: fast is exact for them.
TEST(Bf16Dot, OtherStorageTypesIgnoreThePrecision) {
  const ForcedDotProducts on(cpu::cpu_has_bf16_dot());
  Tensor<float, 4> dout;
  const test::Case<float> c = test::half_case<float16>(kMixed, 6, dout);
  EXPECT_TRUE(same_bits(test::run_cpu_half<float16>(c, &dout, 2, false, Precision::exact),
                        test::run_cpu_half<float16>(c, &dout, 2, false, Precision::fast)));
}

TEST(Bf16Dot, BitwiseIdenticalForAnyThreadCount) {
  QKV_REQUIRE_BF16_DOT();
  for (const cpu::Bf16Unit unit : test::bf16_units_here()) {
  SCOPED_TRACE(test::unit_name(unit));
  const ForcedBf16Unit on(unit);
  for (int64_t batch : {int64_t{1}, int64_t{2} * std::max(1u, std::thread::hardware_concurrency())}) {
    CaseSpec spec = kMixed;
    spec.batch = batch;
    Tensor<float, 4> dout;
    const test::Case<float> c = test::half_case<bfloat16>(spec, 7, dout);
    const test::Results first = test::run_cpu_half<bfloat16>(c, &dout, 1, false, Precision::fast);
    for (int threads : {2, 3, 8})
      EXPECT_TRUE(same_bits(first, test::run_cpu_half<bfloat16>(c, &dout, threads, false, Precision::fast)))
          << "batch " << batch << ", " << threads << " threads";
  }
  }
}

// The variants (window, ALiBi, soft-cap, sinks, dropout with masks and GQA) through the dot
// products, against the exact path on the same inputs: both round once to bfloat16 (≤ u·|out|
// each), and fast rounds each weight (≤ u·P_ij), whose sum over a row is ≤ 1/(1 − p)
// (sinks only lower it): |out_fast − out_exact| ≤ u·max|v|/(1 − p) + 2u·max|out| + 1e-5.
struct Variant {
  const char* name;
  Window window;
  bool alibi = false, sinks = false;
  float softcap = 0.0f, dropout = 0.0f;
};

TEST(Bf16Dot, VariantsWithinTheWeightRoundingOfTheExactPath) {
  QKV_REQUIRE_BF16_DOT();
  for (const cpu::Bf16Unit unit : test::bf16_units_here()) {
  SCOPED_TRACE(test::unit_name(unit));
  const ForcedBf16Unit on(unit);
  const CaseSpec spec{.name = "variants", .batch = 2, .q_len = 90, .k_len = 130, .q_heads = 4, .kv_heads = 2,
                      .head_dim = 33, .v_dim = 24, .causal = Causal::bottom_right, .keep_mask = true,
                      .bias_mask = true, .key_padding = true};
  const Variant variants[] = {{"window", {40, 20}},
                              {"alibi", {}, true},
                              {"softcap", {}, false, false, 2.5f},
                              {"sinks", {16, 16}, false, true},
                              {"dropout", {}, false, false, 0.0f, 0.2f},
                              {"everything", {50, 10}, true, true, 3.0f, 0.2f}};
  Tensor<float, 4> dout;
  test::Case<float> c = test::half_case<bfloat16>(spec, 31, dout);
  std::vector<float> slopes, sinks;
  for (int64_t h = 0; h < spec.q_heads; ++h) {
    slopes.push_back(std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(spec.q_heads)));
    sinks.push_back(0.5f * static_cast<float>(h) - 0.3f);
  }
  double max_v = 0.0;
  for (std::size_t i = 0; i < c.v.size(); ++i) max_v = std::max(max_v, std::abs(double{c.v[i]}));
  const double u = test::unit_roundoff<bfloat16>();
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    test::Case<float> with = c;
    with.options.window = v.window;
    with.options.softcap = v.softcap;
    with.options.dropout = {.p = v.dropout, .seed = 77, .offset = 3};
    if (v.alibi) with.options.alibi_slopes = slopes;
    if (v.sinks) with.options.sinks = sinks;
    const test::Results exact = test::run_cpu_half<bfloat16>(with, &dout, 2, false, Precision::exact);
    const test::Results fast = test::run_cpu_half<bfloat16>(with, &dout, 2, false, Precision::fast);
    double max_out = 0.0, worst = 0.0, worst_lse = 0.0;
    for (std::size_t i = 0; i < exact.out.size(); ++i) {
      max_out = std::max(max_out, std::abs(double{exact.out[i]}));
      worst = std::max(worst, std::abs(double{fast.out[i]} - double{exact.out[i]}));
    }
    for (std::size_t i = 0; i < exact.lse.size(); ++i)  // −inf rows alike: their difference is NaN, not > 1e-5
      if (exact.lse[i] != fast.lse[i]) worst_lse = std::max(worst_lse, std::abs(double{fast.lse[i]} - double{exact.lse[i]}));
    EXPECT_LE(worst, u * max_v / (1.0 - v.dropout) + 2.0 * u * max_out + 1e-5 * std::max(1.0, max_out));
    EXPECT_LE(worst_lse, 1e-5) << "lse (the logits differ only by fp32 sums; Q·Kᵀ's products are exact)";
  }
  }
}

// Forced on where the CPU lacks the unit: every bfloat16 call says so (as QKV_DOT_PRODUCTS=on).
// The query pairs' layout (bf16_dot.hpp's PackQueryPairs, a 16 × 16 transposition of
// words): word (c, i) = (q_i[2c], q_i[2c+1]), an odd d's last value with a zero partner,
// columns past count zero; every count and d around the 16-lane tiles, rows further
// apart than d.
TEST(Bf16Dot, QueryPairsAreTheRowsPairedAlongD) {
  QKV_REQUIRE_BF16_DOT();
  constexpr std::size_t kLd = 64;
  for (std::size_t count : {1, 15, 16, 17, 40, 64})
    for (std::size_t d : {1, 2, 31, 32, 33, 64, 129}) {
      const std::int64_t stride = static_cast<std::int64_t>(d) + 3;
      std::vector<bfloat16> q(count * static_cast<std::size_t>(stride));
      for (std::size_t n = 0; n < q.size(); ++n) q[n] = bfloat16::from_bits(static_cast<std::uint16_t>(n * 40503u + 7));
      const std::size_t pairs = (d + 1) / 2;
      std::vector<std::uint32_t> qp(pairs * kLd, 0xDEADBEEFu);
      cpu::bf16dot::PackQueryPairs(q.data(), stride, count, d, qp.data(), kLd);
      for (std::size_t c = 0; c < pairs; ++c)
        for (std::size_t i = 0; i < kLd; ++i) {
          std::uint32_t want = 0;
          if (i < count) {
            const bfloat16* row = q.data() + static_cast<std::int64_t>(i) * stride;
            want = row[2 * c].bits | (2 * c + 1 < d ? static_cast<std::uint32_t>(row[2 * c + 1].bits) << 16 : 0u);
          }
          ASSERT_EQ(qp[c * kLd + i], want) << "count " << count << " d " << d << " pair " << c << " column " << i;
        }
    }
}

TEST(Bf16Dot, ForcedOnWithoutTheUnitThrows) {
  if (cpu::cpu_has_bf16_dot()) GTEST_SKIP() << "this CPU has AVX512-BF16";
  const ForcedDotProducts on(true);
  Tensor<float, 4> dout;
  const test::Case<float> c = test::half_case<bfloat16>(kMixed, 5, dout);
  EXPECT_THROW(test::run_cpu_half<bfloat16>(c, nullptr, 2, false, Precision::fast), Error);
}

// The same for the tiles (QKV_AMX=on) where there are none; Precision::exact throws too,
// as QKV_DOT_PRODUCTS=on makes it: the switch names hardware the process lacks.
TEST(Bf16Dot, ForcedAmxWithoutTheTilesThrows) {
  if (cpu::cpu_has_amx_bf16()) GTEST_SKIP() << "this CPU has AMX-BF16 tiles";
  const test::ForcedAmx on(true);
  Tensor<float, 4> dout;
  const test::Case<float> c = test::half_case<bfloat16>(kMixed, 5, dout);
  EXPECT_THROW(test::run_cpu_half<bfloat16>(c, nullptr, 2, false, Precision::fast), Error);
}

}  // namespace
}  // namespace qkv
