// The AMX kernels of cpu/amx_dot.hpp called directly, against float64 sums of the same
// exact products: every shape a block can have (1 to 64 keys and queries, odd head and
// value dims, rows far apart), so partial tiles (copied, zero-padded) and whole ones
// (loaded in place) both run. The bound is the float32 summation's: the products of two
// bfloat16 values are exact, and any order of k float32 additions is within
// (k − 1)·2⁻²⁴·Σ|terms| of the exact sum; P·V takes bf16(P), P rounded to nearest even once
// (the Precision::fast contract), and adds the fused rescale's one rounding. Skipped where
// the CPU has no AMX.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <cstdint>
#include <random>
#include <vector>

#include "cpu/amx_dot.hpp"
#include "cpu/bf16_dot.hpp"
#include "cpu/dot_products.hpp"
#include "weighted_sum_oracle.hpp"

namespace qkv {
namespace {

#define QKV_REQUIRE_AMX() \
  if (!cpu::cpu_has_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 tiles on this CPU (or the OS does not grant them)"

std::vector<bfloat16> random_bf16(std::size_t n, std::mt19937& gen, float spread = 1.0f) {
  std::normal_distribution<float> normal(0.0f, spread);
  std::vector<bfloat16> v(n);
  for (auto& x : v) x = bfloat16(normal(gen));
  return v;
}

struct Shape {
  std::size_t rows, width, d;  // keys (or queries) × queries (or values) × reduction
};

const Shape kShapes[] = {{1, 1, 1},   {3, 8, 3},    {16, 16, 32}, {17, 24, 33}, {40, 40, 59},
                         {64, 64, 64}, {64, 64, 128}, {63, 48, 127}, {64, 16, 256}, {31, 64, 200}};

TEST(AmxDot, ScoresMatchTheExactProductsWithinFloat32Sums) {
  QKV_REQUIRE_AMX();
  std::mt19937 gen(11);
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(testing::Message() << s.rows << " keys, " << s.width << " queries, d " << s.d);
    const std::size_t k_row = s.d + 5;  // rows apart, as a [B, N, H, d] layout has them
    const std::vector<bfloat16> k = random_bf16(s.rows * k_row, gen), q = random_bf16(s.width * s.d, gen);
    const std::size_t q_ld = cpu::bf16dot::pair_ld(64);
    std::vector<std::uint32_t> qp((s.d + 1) / 2 * q_ld, 0xFFFFFFFFu);  // garbage where nothing is packed
    cpu::bf16dot::PackQueryPairs(q.data(), static_cast<std::int64_t>(s.d), s.width, s.d, qp.data(), q_ld);
    const std::size_t st_ld = s.width + 3;
    std::vector<float> st(s.rows * st_ld, -7.0f);
    const float scale = 0.125f;
    cpu::amx::ScoresTransposed(k.data(), static_cast<std::int64_t>(k_row), s.rows, s.d, qp.data(), q_ld, s.width,
                               scale, st.data(), st_ld);
    for (std::size_t j = 0; j < s.rows; ++j) {
      for (std::size_t i = 0; i < s.width; ++i) {
        double exact = 0.0, magnitude = 0.0;
        for (std::size_t c = 0; c < s.d; ++c) {
          const double term = static_cast<double>(static_cast<float>(k[j * k_row + c])) * static_cast<float>(q[i * s.d + c]);
          exact += term;
          magnitude += std::abs(term);
        }
        const double bound = (static_cast<double>(s.d) * 0x1p-24 * magnitude + 0x1p-24 * std::abs(exact)) * scale + 1e-30;
        ASSERT_NEAR(st[j * st_ld + i], scale * exact, bound) << "key " << j << ", query " << i;
      }
      for (std::size_t i = s.width; i < st_ld; ++i) ASSERT_EQ(st[j * st_ld + i], -7.0f) << "written past width";
    }
  }
}

// Two accumulator layouts: a row length that is not a multiple of 16 takes the block's
// sum from zero and acc·alpha + sum in one rounding; a multiple of 16 (the forward's
// dv_ld) adds the sum onto acc in the tiles after scaling the rows whose alpha is not 1,
// one more rounding per row, and reads and writes whole tiles of acc: rows up to
// round_up(count, 16) and columns up to acc_ld, which must come back unchanged.
TEST(AmxDot, RescaleAddWeightedTakesPRoundedOnce) {
  QKV_REQUIRE_AMX();
  std::mt19937 gen(12);
  std::uniform_real_distribution<float> weight(0.0f, 1.0f);
  for (const bool onto : {false, true}) {
    for (const Shape& s : kShapes) {
      const std::size_t keys = std::min<std::size_t>(s.d, 64), count = s.rows, dv = s.width + 1;
      SCOPED_TRACE(testing::Message() << keys << " keys, " << count << " queries, dv " << dv << (onto ? ", onto acc" : ""));
      const std::size_t pt_ld = (count + 15) / 16 * 16, v_row = dv + 2;
      const std::size_t acc_ld = onto ? (dv + 15) / 16 * 16 : dv + 1, acc_rows = onto ? pt_ld : count;
      std::vector<float> pt(64 * pt_ld);
      for (auto& p : pt) p = weight(gen);
      const std::vector<bfloat16> v = random_bf16(keys * v_row, gen);
      std::vector<float> acc(acc_rows * acc_ld), alpha(count);
      for (auto& a : acc) a = weight(gen);
      // Most rows keep their maximum (alpha exactly 1, as the online softmax gives them).
      for (auto& a : alpha) a = weight(gen) < 0.5f ? 1.0f : weight(gen);
      const std::vector<float> before = acc;
      std::vector<std::uint32_t> p_pairs(2 * 32 * 64), v_pairs(32 * cpu::bf16dot::pair_ld(dv), 0xFFFFFFFFu);
      cpu::amx::RescaleAddWeighted(pt.data(), pt_ld, count, keys, v.data(), static_cast<std::int64_t>(v_row), dv,
                                   {p_pairs.data(), v_pairs.data()}, acc.data(), acc_ld, alpha.data());
      for (std::size_t i = 0; i < count; ++i) {
        for (std::size_t x = 0; x < dv; ++x) {
          const auto [sum, magnitude] = test::exact_weighted_sum(pt.data(), pt_ld, v.data(), v_row, keys, i, x);
          const double scaled = static_cast<double>(before[i * acc_ld + x]) * alpha[i];
          const double exact = scaled + sum;
          // onto: acc·alpha rounded, then keys + 1 float32 additions in the tiles' order.
          const double bound = onto ? static_cast<double>(keys + 1) * 0x1p-24 * (magnitude + std::abs(scaled)) +
                                          0x1p-23 * std::abs(exact) + 1e-30
                                    : static_cast<double>(keys) * 0x1p-24 * magnitude + 0x1p-23 * std::abs(exact) + 1e-30;
          ASSERT_NEAR(acc[i * acc_ld + x], exact, bound) << "query " << i << ", channel " << x;
        }
        for (std::size_t x = dv; x < acc_ld; ++x)
          ASSERT_EQ(acc[i * acc_ld + x], before[i * acc_ld + x]) << "written past dv, query " << i;
      }
      for (std::size_t i = count; i < acc_rows; ++i)
        for (std::size_t x = 0; x < acc_ld; ++x)
          ASSERT_EQ(acc[i * acc_ld + x], before[i * acc_ld + x]) << "written past count: row " << i;
    }
  }
}

// A TileScope keeps one configuration for the products inside it: they give the bits they
// give alone, an inner or inactive scope changes nothing, and products after the scope
// configure the tiles again themselves.
TEST(AmxDot, TileScopeGivesTheSameProducts) {
  QKV_REQUIRE_AMX();
  std::mt19937 gen(14);
  const std::size_t keys = 40, width = 48, d = 72, q_ld = cpu::bf16dot::pair_ld(width);
  const std::vector<bfloat16> k = random_bf16(keys * d, gen), q = random_bf16(width * d, gen);
  std::vector<std::uint32_t> qp((d + 1) / 2 * q_ld);
  cpu::bf16dot::PackQueryPairs(q.data(), static_cast<std::int64_t>(d), width, d, qp.data(), q_ld);
  const auto scores = [&] {
    std::vector<float> st(keys * width);
    cpu::amx::ScoresTransposed(k.data(), static_cast<std::int64_t>(d), keys, d, qp.data(), q_ld, width, 0.25f, st.data(),
                               width);
    return st;
  };
  const std::vector<float> alone = scores();
  {
    const cpu::amx::TileScope scope(true);
    EXPECT_EQ(scores(), alone);
    const cpu::amx::TileScope inner(true);  // not the owner: leaves the tiles to the outer scope
    EXPECT_EQ(scores(), alone);
  }
  EXPECT_EQ(scores(), alone);  // released: this product loads its own configuration
  {
    const cpu::amx::TileScope inactive(false);
    EXPECT_EQ(scores(), alone);
  }
  EXPECT_EQ(scores(), alone);
}

// dK's product: a left operand paired along its rows, one or two terms, added to c.
TEST(AmxDot, AddProductMatchesTheExactProducts) {
  QKV_REQUIRE_AMX();
  std::mt19937 gen(13);
  for (const Shape& s : kShapes) {
    for (const auto terms : {cpu::bf16dot::Terms::one, cpu::bf16dot::Terms::two}) {
      const std::size_t rows = s.rows, pairs = (s.width + 1) / 2, n = s.d;
      SCOPED_TRACE(testing::Message() << rows << " rows, " << pairs << " pairs, n " << n << ", terms "
                                      << static_cast<int>(terms));
      const std::size_t a_ld = pairs + 3, b_ld = cpu::bf16dot::pair_ld(n), c_ld = n + 2;
      const std::size_t term_words = rows * a_ld;
      const std::vector<bfloat16> a_values = random_bf16(2 * 2 * term_words, gen);
      std::vector<std::uint32_t> a(2 * term_words);
      for (std::size_t w = 0; w < a.size(); ++w)
        a[w] = static_cast<std::uint32_t>(a_values[2 * w].bits) | (static_cast<std::uint32_t>(a_values[2 * w + 1].bits) << 16);
      const std::vector<bfloat16> b_values = random_bf16(2 * pairs * b_ld, gen);
      std::vector<std::uint32_t> b(pairs * b_ld);
      for (std::size_t w = 0; w < b.size(); ++w)
        b[w] = static_cast<std::uint32_t>(b_values[2 * w].bits) | (static_cast<std::uint32_t>(b_values[2 * w + 1].bits) << 16);
      std::vector<float> c(rows * c_ld, 0.5f);
      const cpu::bf16dot::LeftPairs left{a.data(), a_ld, 1, terms, term_words};
      cpu::amx::AddProduct(left, rows, pairs, b.data(), b_ld, n, c.data(), c_ld);
      auto half = [](std::uint32_t word, int which) {
        std::uint32_t bits = (which == 0 ? word & 0xFFFFu : word >> 16) << 16;
        float f;
        std::memcpy(&f, &bits, sizeof f);
        return static_cast<double>(f);
      };
      for (std::size_t r = 0; r < rows; ++r)
        for (std::size_t x = 0; x < n; ++x) {
          double sum = 0.0, magnitude = 0.0;
          for (std::size_t t = 0; t < static_cast<std::size_t>(terms); ++t)
            for (std::size_t k = 0; k < pairs; ++k)
              for (int h = 0; h < 2; ++h) {
                const double term = half(a[t * term_words + r * a_ld + k], h) * half(b[k * b_ld + x], h);
                sum += term;
                magnitude += std::abs(term);
              }
          const double bound = static_cast<double>(4 * pairs) * 0x1p-24 * magnitude + 0x1p-23 * (0.5 + std::abs(sum)) + 1e-30;
          ASSERT_NEAR(c[r * c_ld + x], 0.5 + sum, bound) << "row " << r << ", column " << x;
        }
      for (std::size_t r = 0; r < rows; ++r) ASSERT_EQ(c[r * c_ld + n], 0.5f) << "written past n";
    }
  }
}

// An infinity or NaN in a key reaches that key's scores (and no other's): the tiles do
// not drop them, and the zero padding of partial tiles never meets them (0·Inf).
TEST(AmxDot, NonFiniteInputsReachTheScores) {
  QKV_REQUIRE_AMX();
  std::mt19937 gen(14);
  const std::size_t keys = 20, width = 16, d = 64, q_ld = 64;
  std::vector<bfloat16> k = random_bf16(keys * d, gen), q = random_bf16(width * d, gen);
  k[3 * d + 5] = bfloat16(std::numeric_limits<float>::infinity());
  k[7 * d + 9] = bfloat16(std::numeric_limits<float>::quiet_NaN());
  std::vector<std::uint32_t> qp(d / 2 * q_ld);
  cpu::bf16dot::PackQueryPairs(q.data(), static_cast<std::int64_t>(d), width, d, qp.data(), q_ld);
  std::vector<float> st(keys * width);
  cpu::amx::ScoresTransposed(k.data(), static_cast<std::int64_t>(d), keys, d, qp.data(), q_ld, width, 1.0f, st.data(), width);
  for (std::size_t i = 0; i < width; ++i) {
    EXPECT_TRUE(std::isinf(st[3 * width + i]) || std::isnan(st[3 * width + i])) << i;
    EXPECT_TRUE(std::isnan(st[7 * width + i])) << i;
    EXPECT_TRUE(std::isfinite(st[0 * width + i])) << i;
  }
}

}  // namespace
}  // namespace qkv
