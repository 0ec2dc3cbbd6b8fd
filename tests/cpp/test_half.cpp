// qkv::bfloat16 and qkv::float16: known bit patterns, exhaustive widening round trips,
// and round-to-nearest-even checked at every tie between neighbouring values.
#include <gtest/gtest.h>

#include <qkv/half.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

namespace qkv {
namespace {

std::uint32_t float_bits(float x) { return std::bit_cast<std::uint32_t>(x); }

TEST(BFloat16, KnownBitPatterns) {
  EXPECT_EQ(bfloat16(1.0f).bits, 0x3F80);
  EXPECT_EQ(bfloat16(-2.0f).bits, 0xC000);
  EXPECT_EQ(bfloat16(0.0f).bits, 0x0000);
  EXPECT_EQ(bfloat16(-0.0f).bits, 0x8000);
  EXPECT_EQ(bfloat16(INFINITY).bits, 0x7F80);
  EXPECT_EQ(bfloat16(-INFINITY).bits, 0xFF80);
  EXPECT_EQ(bfloat16(3.140625f).bits, 0x4049);  // exactly representable
  // 1 + 2⁻⁸ is the tie between 1 and 1 + 2⁻⁷: even (1.0) wins; a hair above rounds up.
  EXPECT_EQ(bfloat16(1.0f + 0x1p-8f).bits, 0x3F80);
  EXPECT_EQ(bfloat16(1.0f + 0x1p-8f + 0x1p-23f).bits, 0x3F81);
  // 1 + 3·2⁻⁸ is the tie between 1 + 2⁻⁷ (odd) and 1 + 2⁻⁶ (even): up.
  EXPECT_EQ(bfloat16(1.0f + 3 * 0x1p-8f).bits, 0x3F82);
  // The largest float rounds to inf; the largest bfloat16 stays.
  EXPECT_EQ(bfloat16(std::numeric_limits<float>::max()).bits, 0x7F80);
  EXPECT_EQ(bfloat16(bfloat16::from_bits(0x7F7F)).bits, 0x7F7F);
  // Float subnormals keep their top bits.
  EXPECT_EQ(bfloat16(std::numeric_limits<float>::denorm_min()).bits, 0x0000);
  EXPECT_EQ(bfloat16(std::bit_cast<float>(0x00010000u)).bits, 0x0001);
  EXPECT_EQ(static_cast<float>(bfloat16::from_bits(0x0001)), std::bit_cast<float>(0x00010000u));
  // NaN stays NaN with its sign, quiet, even when the payload lives in the dropped bits.
  const bfloat16 nan(std::bit_cast<float>(0x7F800001u));
  EXPECT_TRUE(std::isnan(static_cast<float>(nan)));
  EXPECT_EQ(nan.bits, 0x7FC0);
  EXPECT_EQ(bfloat16(std::bit_cast<float>(0xFFC00000u)).bits, 0xFFC0);
}

TEST(BFloat16, EveryBitPatternWidensExactlyAndRoundTrips) {
  for (std::uint32_t b = 0; b <= 0xFFFF; ++b) {
    const auto h = bfloat16::from_bits(static_cast<std::uint16_t>(b));
    const float wide = h;
    ASSERT_EQ(float_bits(wide), b << 16) << b;  // widening = the top 16 bits
    const bool is_nan = (b & 0x7FFF) > 0x7F80;
    if (is_nan) {
      ASSERT_EQ(bfloat16(wide).bits, b | 0x0040) << b;  // quieted, sign and payload kept
    } else {
      ASSERT_EQ(bfloat16(wide).bits, b) << b;
    }
  }
}

// Between every pair of neighbouring finite bfloat16 values a < b (positive and
// negative): the midpoint goes to the even one, anything strictly nearer to one goes
// to it. The midpoint is a float (bfloat16 has 8 significant bits, float 24).
TEST(BFloat16, RoundsToNearestEvenAtEveryTie) {
  for (std::uint32_t sign : {0u, 0x8000u}) {
    for (std::uint32_t b = 0; b < 0x7F7F; ++b) {
      const auto lo = bfloat16::from_bits(static_cast<std::uint16_t>(sign | b));
      const auto hi = bfloat16::from_bits(static_cast<std::uint16_t>(sign | (b + 1)));
      // lo + (hi − lo)/2: exact, and no overflow next to the largest value.
      const float mid = static_cast<float>(lo) + (static_cast<float>(hi) - static_cast<float>(lo)) / 2;
      const std::uint16_t even = (b & 1) ? hi.bits : lo.bits;
      ASSERT_EQ(bfloat16(mid).bits, even) << b;
      const float toward_lo = std::nextafter(mid, static_cast<float>(lo));
      const float toward_hi = std::nextafter(mid, static_cast<float>(hi));
      ASSERT_EQ(bfloat16(toward_lo).bits, lo.bits) << b;
      ASSERT_EQ(bfloat16(toward_hi).bits, hi.bits) << b;
    }
  }
}

TEST(Float16, KnownBitPatterns) {
  EXPECT_EQ(float16(1.0f).bits, 0x3C00);
  EXPECT_EQ(float16(-2.0f).bits, 0xC000);
  EXPECT_EQ(float16(0.5f).bits, 0x3800);
  EXPECT_EQ(float16(-0.0f).bits, 0x8000);
  EXPECT_EQ(float16(65504.0f).bits, 0x7BFF);   // largest finite
  EXPECT_EQ(float16(65519.996f).bits, 0x7BFF);  // below the tie: stays finite
  EXPECT_EQ(float16(65520.0f).bits, 0x7C00);   // the tie with 65536: even is inf
  EXPECT_EQ(float16(1e10f).bits, 0x7C00);
  EXPECT_EQ(float16(-INFINITY).bits, 0xFC00);
  EXPECT_EQ(float16(0x1p-14f).bits, 0x0400);   // smallest normal
  EXPECT_EQ(float16(0x1p-24f).bits, 0x0001);   // smallest subnormal
  EXPECT_EQ(float16(0x1p-25f).bits, 0x0000);   // tie with 0: even is 0
  EXPECT_EQ(float16(std::nextafter(0x1p-25f, 1.0f)).bits, 0x0001);
  EXPECT_EQ(float16(-0x1p-26f).bits, 0x8000);  // underflow keeps the sign
  EXPECT_EQ(float16(3 * 0x1p-25f).bits, 0x0002);  // tie 1.5·2⁻²⁴: even is 2·2⁻²⁴
  EXPECT_EQ(float16(0x1p-14f - 0x1p-25f).bits, 0x0400);  // tie below 2⁻¹⁴ carries up
  EXPECT_EQ(float16(1.0f + 0x1p-11f).bits, 0x3C00);      // tie: even
  EXPECT_EQ(float16(1.0f + 3 * 0x1p-11f).bits, 0x3C02);  // tie: even (up)
  EXPECT_EQ(static_cast<float>(float16::from_bits(0x0001)), 0x1p-24f);
  EXPECT_EQ(static_cast<float>(float16::from_bits(0x03FF)), 0x3FFp-24f);
  const float16 nan(std::bit_cast<float>(0xFF800001u));  // negative signalling NaN
  EXPECT_TRUE(std::isnan(static_cast<float>(nan)));
  EXPECT_EQ(nan.bits, 0xFE00);
}

TEST(Float16, EveryBitPatternWidensExactlyAndRoundTrips) {
  for (std::uint32_t b = 0; b <= 0xFFFF; ++b) {
    const auto h = float16::from_bits(static_cast<std::uint16_t>(b));
    const float wide = h;
    const std::uint32_t exponent = (b >> 10) & 0x1F, mantissa = b & 0x3FF;
    const double sign = (b & 0x8000) ? -1.0 : 1.0;
    if (exponent == 0x1F) {
      ASSERT_TRUE(mantissa ? std::isnan(wide) : std::isinf(wide)) << b;
      ASSERT_EQ(std::signbit(wide), (b & 0x8000) != 0) << b;
      ASSERT_EQ(float16(wide).bits, mantissa ? (b | 0x0200) : b) << b;
      continue;
    }
    // The value by definition, in double: (−1)^s · m · 2^(e−25) with the implicit bit.
    const double expected = exponent == 0 ? sign * std::ldexp(mantissa, -24)
                                          : sign * std::ldexp(mantissa + 1024.0, static_cast<int>(exponent) - 25);
    ASSERT_EQ(static_cast<double>(wide), expected) << b;
    ASSERT_EQ(std::signbit(wide), (b & 0x8000) != 0) << b;
    ASSERT_EQ(float16(wide).bits, b) << b;
  }
}

TEST(Float16, RoundsToNearestEvenAtEveryTie) {
  for (std::uint32_t sign : {0u, 0x8000u}) {
    for (std::uint32_t b = 0; b < 0x7BFF; ++b) {  // every pair of neighbours, subnormals too
      const auto lo = float16::from_bits(static_cast<std::uint16_t>(sign | b));
      const auto hi = float16::from_bits(static_cast<std::uint16_t>(sign | (b + 1)));
      const float mid = (static_cast<float>(lo) + static_cast<float>(hi)) / 2;  // exact
      const std::uint16_t even = (b & 1) ? hi.bits : lo.bits;
      ASSERT_EQ(float16(mid).bits, even) << b;
      ASSERT_EQ(float16(std::nextafter(mid, static_cast<float>(lo))).bits, lo.bits) << b;
      ASSERT_EQ(float16(std::nextafter(mid, static_cast<float>(hi))).bits, hi.bits) << b;
    }
  }
}

TEST(HalfTypes, AreConstexprAndStorageSized) {
  static_assert(bfloat16(1.0f).bits == 0x3F80);
  static_assert(float16(1.0f).bits == 0x3C00);
  static_assert(static_cast<float>(float16::from_bits(0x3555)) == 0x1.554p-2f);
  static_assert(storage_type_of<bfloat16> == StorageType::bfloat16);
  static_assert(storage_bytes(StorageType::float16) == 2);
  SUCCEED();
}

}  // namespace
}  // namespace qkv
