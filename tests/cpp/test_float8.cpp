// float8 storage (qkv/float8.hpp) and float8 KV caches: every code widened exactly (by
// the scalar conversion and by the decode kernel's vector one, on every SIMD target),
// narrowing to the nearest code with ties to even and saturation, decode over caches that
// hold every finite code, per-tensor scales, NaN codes behind the mask, and qkv::KVCache
// with float8 storage (given and first-append scales) against the fp64 reference over its
// stored values. The oracles here are written from the formats' definitions, not from
// the library's conversions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "qkv/decode.hpp"
#include "qkv/kv_cache.hpp"
#include "simd_targets.hpp"
#include "test_support.hpp"

namespace qkv {
namespace {

// The value of a code from the format's definition (exponent bits E, bias, mantissa bits M).
double definition(std::uint8_t code, int exponent_bits, int bias, int mantissa_bits, bool has_inf) {
  const int sign = code >> 7;
  const int e = (code >> mantissa_bits) & ((1 << exponent_bits) - 1);
  const int m = code & ((1 << mantissa_bits) - 1);
  const double s = sign ? -1.0 : 1.0;
  const int all_ones = (1 << exponent_bits) - 1;
  if (has_inf && e == all_ones) return m == 0 ? s * INFINITY : NAN;
  if (!has_inf && e == all_ones && m == (1 << mantissa_bits) - 1) return NAN;
  if (e == 0) return s * std::ldexp(m, 1 - bias - mantissa_bits);
  return s * std::ldexp(1.0 + std::ldexp(m, -mantissa_bits), e - bias);
}
double e4m3(std::uint8_t code) { return definition(code, 4, 7, 3, false); }
double e5m2(std::uint8_t code) { return definition(code, 5, 15, 2, true); }

void expect_same(double got, double want, int code) {
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(got)) << "code " << code;
  } else {
    EXPECT_EQ(got, want) << "code " << code;
    EXPECT_EQ(std::signbit(got), std::signbit(want)) << "code " << code;
  }
}

TEST(Float8, EveryCodeWidensExactly) {
  for (int code = 0; code < 256; ++code) {
    const auto c = static_cast<std::uint8_t>(code);
    expect_same(static_cast<float>(float8_e4m3fn::from_bits(c)), e4m3(c), code);
    expect_same(static_cast<float>(float8_e5m2::from_bits(c)), e5m2(c), code);
  }
}

// The nearest finite code by search (ties: the even code), saturating past the largest.
template <class T>
std::uint8_t nearest(float x, double (*value)(std::uint8_t)) {
  if (std::abs(x) > T::kMax) x = std::copysign(T::kMax, x);  // finite values saturate
  int best = -1;
  double best_distance = INFINITY;
  for (int code = 0; code < 256; ++code) {
    const double v = value(static_cast<std::uint8_t>(code));
    if (!std::isfinite(v) || std::signbit(v) != std::signbit(x)) continue;
    const double distance = std::abs(v - static_cast<double>(x));
    if (distance < best_distance || (distance == best_distance && code % 2 == 0)) {
      best = code;
      best_distance = distance;
    }
  }
  return static_cast<std::uint8_t>(best);
}

template <class T>
void expect_narrowing(double (*value)(std::uint8_t)) {
  std::mt19937 rng(3);
  std::vector<float> xs{0.0f, -0.0f, 1.0f, 3.0f, 1e-3f, -7.5f, 1e30f, -1e30f, std::numeric_limits<float>::denorm_min(),
                        T::kMax, -T::kMax, T::kMax * 1.1f};
  for (int code = 0; code < 256; ++code) {  // every code, and the midpoints to its neighbours
    const double v = value(static_cast<std::uint8_t>(code));
    if (!std::isfinite(v)) continue;
    xs.push_back(static_cast<float>(v));
    const double next = value(static_cast<std::uint8_t>(code + 1 < 256 ? code + 1 : code));
    if (std::isfinite(next) && std::signbit(next) == std::signbit(v)) xs.push_back(static_cast<float>((v + next) / 2));
  }
  for (int i = 0; i < 4000; ++i)
    xs.push_back(std::ldexp(std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng), std::uniform_int_distribution(-20, 18)(rng)));
  for (const float x : xs) EXPECT_EQ(T(x).bits, nearest<T>(x, value)) << x;
  // Non-finite inputs are never made finite.
  EXPECT_TRUE(std::isnan(static_cast<float>(T(std::nanf("")))));
  const float inf = std::numeric_limits<float>::infinity();
  if constexpr (std::is_same_v<T, float8_e5m2>) {
    EXPECT_EQ(static_cast<float>(T(inf)), inf);
    EXPECT_EQ(static_cast<float>(T(-inf)), -inf);
  } else {
    EXPECT_TRUE(std::isnan(static_cast<float>(T(inf))));
  }
}

TEST(Float8, NarrowingRoundsToNearestEvenAndSaturates) {
  expect_narrowing<float8_e4m3fn>(e4m3);
  expect_narrowing<float8_e5m2>(e5m2);
}

// Decode over one sequence whose keys and values hold every finite code of the format (16
// per row, subnormals and ±0 included), on every SIMD target, per-tensor scale (strides 0
// on every axis), against the fp64 formula; the rows past the length hold NaN codes that
// must never be read.
template <class T>
void expect_decode_reads_every_code(double (*value)(std::uint8_t)) {
  std::vector<std::uint8_t> codes;
  for (int code = 0; code < 256; ++code)
    if (std::isfinite(value(static_cast<std::uint8_t>(code)))) codes.push_back(static_cast<std::uint8_t>(code));
  const int64_t d = 16, n = (static_cast<int64_t>(codes.size()) + d - 1) / d, capacity = n + 5, heads = 2;
  const float k_scale = 0.01f, v_scale = 0.375f;
  Tensor<T, 4> k({1, capacity, 1, d}), v({1, capacity, 1, d});
  const std::uint8_t nan_code = std::is_same_v<T, float8_e5m2> ? 0x7E : 0x7F;
  for (int64_t j = 0; j < capacity; ++j)
    for (int64_t c = 0; c < d; ++c) {
      const std::size_t i = static_cast<std::size_t>(j * d + c);
      const std::uint8_t code = j >= n ? nan_code : codes[(i * 7) % codes.size()];  // keys and values differ
      k(0, j, 0, c) = T::from_bits(code);
      v(0, j, 0, c) = T::from_bits(codes[(i * 11 + 3) % codes.size()]);
      if (j >= n) v(0, j, 0, c) = T::from_bits(nan_code);
    }
  Tensor<float, 4> q({1, 1, heads, d});
  std::mt19937 rng(5);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng);
  const std::vector<int64_t> lengths{n};
  const std::array<int64_t, 3> rows{1, capacity, 1}, one{0, 0, 0};

  // The fp64 formula over the stored values.
  std::vector<double> want(static_cast<std::size_t>(heads * d));
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int64_t h = 0; h < heads; ++h) {
    std::vector<double> s(static_cast<std::size_t>(n));
    double m = -INFINITY, l = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      double dot = 0.0;
      for (int64_t c = 0; c < d; ++c) dot += static_cast<double>(q(0, 0, h, c)) * value(k(0, j, 0, c).bits) * k_scale;
      s[static_cast<std::size_t>(j)] = dot * scale;
      m = std::max(m, dot * scale);
    }
    for (double& x : s) l += (x = std::exp(x - m));
    for (int64_t c = 0; c < d; ++c) {
      double acc = 0.0;
      for (int64_t j = 0; j < n; ++j) acc += s[static_cast<std::size_t>(j)] * value(v(0, j, 0, c).bits) * v_scale;
      want[static_cast<std::size_t>(h * d + c)] = acc / l;
    }
  }
  test::for_each_simd_target([&](int64_t) {
    Tensor<float, 4> out({1, 1, heads, d});
    DecodeArgs<T> a;
    a.q = q.cview();
    a.k_cache = k.cview();
    a.v_cache = v.cview();
    a.cache_lengths = lengths;
    a.k_scale = View3<const float>(&k_scale, rows, one);
    a.v_scale = View3<const float>(&v_scale, rows, one);
    a.out = out.view();
    decode(a);
    double largest = 0.0, error = 0.0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      largest = std::max(largest, std::abs(want[i]));
      error = std::max(error, std::abs(static_cast<double>(out[i]) - want[i]));
    }
    // float32 sums of n·d products: a few hundred ulps of the largest output at most.
    EXPECT_LE(error, 256.0 * std::numeric_limits<float>::epsilon() * largest) << "largest " << largest;
  });
}

// One visible key: its weight is exactly 1, so out is the value row widened, bit for bit,
// through the decode kernel's vector widening (WidenFloat8: through float16 where the
// target converts float16 in hardware, by integer lanes elsewhere). The value row holds
// all 256 codes (NaN and e5m2's ±inf included: each stays in its own channel), scale 1;
// only ±0 lose their sign (the weighted sum starts from +0).
template <class T>
void expect_decode_widens_every_code_exactly(double (*value)(std::uint8_t)) {
  const int64_t d = 256;
  Tensor<T, 4> k({1, 1, 1, d}), v({1, 1, 1, d});
  for (int64_t c = 0; c < d; ++c) {
    k(0, 0, 0, c) = T::from_bits(0);
    v(0, 0, 0, c) = T::from_bits(static_cast<std::uint8_t>(c));
  }
  Tensor<float, 4> q({1, 1, 1, d});
  const std::vector<int64_t> lengths{1};
  const float one = 1.0f;
  const std::array<int64_t, 3> rows{1, 1, 1}, zero_strides{0, 0, 0};
  test::for_each_simd_target([&](int64_t) {
    Tensor<float, 4> out({1, 1, 1, d});
    DecodeArgs<T> a;
    a.q = q.cview();
    a.k_cache = k.cview();
    a.v_cache = v.cview();
    a.cache_lengths = lengths;
    a.k_scale = View3<const float>(&one, rows, zero_strides);
    a.v_scale = View3<const float>(&one, rows, zero_strides);
    a.out = out.view();
    decode(a);
    for (int code = 0; code < 256; ++code) {
      const double want = value(static_cast<std::uint8_t>(code));
      if (want == 0.0) {
        EXPECT_EQ(out(0, 0, 0, code), 0.0f) << "code " << code;  // −0 sums to +0 from a zero accumulator
      } else {
        expect_same(out(0, 0, 0, code), want, code);
      }
    }
  });
}

TEST(Float8, DecodeWidensEveryCodeExactlyOnEveryTarget) {
  expect_decode_widens_every_code_exactly<float8_e4m3fn>(e4m3);
  expect_decode_widens_every_code_exactly<float8_e5m2>(e5m2);
}

TEST(Float8, DecodeReadsEveryCodeOnEveryTarget) {
  expect_decode_reads_every_code<float8_e4m3fn>(e4m3);
  expect_decode_reads_every_code<float8_e5m2>(e5m2);
}

// qkv::KVCache with float8 storage: the first append's per-head scales (max |x| / the
// largest finite), or given per-tensor ones; stored() equal to float8(x / s) · s; attend
// equal to the reference backend over the cache; reset keeps the scales.
TEST(Float8, KVCacheStoresAndAttends) {
  for (const StorageType type : {StorageType::float8_e4m3fn, StorageType::float8_e5m2}) {
    for (const bool paged : {false, true}) {
      SCOPED_TRACE(std::string(storage_name(type)) + (paged ? " paged" : " contiguous"));
      const float largest = type == StorageType::float8_e5m2 ? float8_e5m2::kMax : float8_e4m3fn::kMax;
      KVCache cache({.batch = 2, .capacity = 40, .kv_heads = 2, .head_dim = 8, .dtype = type, .paged = paged,
                     .block_size = 8});
      EXPECT_TRUE(cache.k_scales().empty());
      Tensor<float, 4> k({2, 5, 2, 8}), v({2, 5, 2, 8});
      std::mt19937 rng(9);
      for (std::size_t i = 0; i < k.size(); ++i) {
        const float head = static_cast<float>(i / 8 % 2) * 9.0f + 1.0f;  // head 1's values 10× head 0's
        k[i] = head * std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng);
        v[i] = head * std::uniform_real_distribution<float>(-2.0f, 2.0f)(rng);
      }
      cache.append(k.cview(), v.cview());
      ASSERT_EQ(cache.k_scales().size(), 2u);
      for (int64_t h = 0; h < 2; ++h) {
        float k_max = 0.0f;
        for (int64_t b = 0; b < 2; ++b)
          for (int64_t t = 0; t < 5; ++t)
            for (int64_t c = 0; c < 8; ++c) k_max = std::max(k_max, std::abs(k(b, t, h, c)));
        EXPECT_EQ(cache.k_scales()[static_cast<std::size_t>(h)], k_max / largest);
      }
      const auto [ks, vs] = cache.stored(1);
      for (int64_t t = 0; t < 5; ++t)
        for (int64_t h = 0; h < 2; ++h)
          for (int64_t c = 0; c < 8; ++c) {
            const float s = cache.k_scales()[static_cast<std::size_t>(h)];
            const float x = k(1, t, h, c) / s;
            const float want = (type == StorageType::float8_e5m2 ? static_cast<float>(float8_e5m2(x))
                                                                 : static_cast<float>(float8_e4m3fn(x))) * s;
            EXPECT_EQ(ks[static_cast<std::size_t>((t * 2 + h) * 8 + c)], want);
          }
      // A later token 100× the first ones saturates at the largest finite value · scale.
      Tensor<float, 4> big({2, 1, 2, 8}), big_v({2, 1, 2, 8});
      for (std::size_t i = 0; i < big.size(); ++i) big[i] = big_v[i] = 1000.0f;
      cache.append(big.cview(), big_v.cview());
      EXPECT_EQ(cache.stored(0).first[static_cast<std::size_t>(5 * 2 * 8)], largest * cache.k_scales()[0]);

      Tensor<float, 4> q({2, 2, 4, 8});
      for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng);
      Tensor<float, 4> out({2, 2, 4, 8}), ref({2, 2, 4, 8});
      AttentionOptions options;
      options.causal = Causal::bottom_right;
      cache.attend(q.cview(), out.view(), {}, options);
      options.execution.backend = Backend::reference;
      cache.attend(q.cview(), ref.view(), {}, options);
      for (std::size_t i = 0; i < out.size(); ++i)
        EXPECT_NEAR(out[i], ref[i], 1e-5 * (1.0 + std::abs(ref[i])));

      const std::vector<float> scales(cache.k_scales().begin(), cache.k_scales().end());
      cache.reset();
      cache.append(big.cview(), big_v.cview());
      EXPECT_EQ(std::vector<float>(cache.k_scales().begin(), cache.k_scales().end()), scales);  // kept
    }
  }
  // Given scales: one per tensor is repeated per head.
  KVCache given({.batch = 1, .capacity = 4, .kv_heads = 3, .head_dim = 4, .dtype = StorageType::float8_e4m3fn,
                 .k_scale = {0.5f}, .v_scale = {1.0f, 2.0f, 4.0f}});
  EXPECT_EQ(std::vector<float>(given.k_scales().begin(), given.k_scales().end()), std::vector<float>(3, 0.5f));
  EXPECT_EQ(std::vector<float>(given.v_scales().begin(), given.v_scales().end()), (std::vector<float>{1, 2, 4}));
}

TEST(Float8, BadScalesAreNamed) {
  const auto config = [](std::vector<float> k, std::vector<float> v, StorageType type = StorageType::float8_e4m3fn) {
    return KVCacheConfig{.batch = 1, .capacity = 4, .kv_heads = 2, .head_dim = 4, .dtype = type,
                         .k_scale = std::move(k), .v_scale = std::move(v)};
  };
  test::expect_error([&] { KVCache{config({1, 2, 3}, {1})}; }, "config.k_scale: expected 1 (per tensor) or 2");
  test::expect_error([&] { KVCache{config({1}, {0})}; }, "config.v_scale[0]: expected a positive finite scale");
  test::expect_error([&] { KVCache{config({NAN}, {1})}; }, "config.k_scale[0]: expected a positive finite scale");
  test::expect_error([&] { KVCache{config({1}, {})}; }, "config.v_scale: given without the other");
  test::expect_error([&] { KVCache{config({1}, {1}, StorageType::int8)}; },
                     "config.k_scale: only float8 caches take given scales");
  // decode without scales for a float8 cache.
  Tensor<float8_e4m3fn, 4> k({1, 4, 1, 4}), v({1, 4, 1, 4});
  Tensor<float, 4> q({1, 1, 1, 4}), out({1, 1, 1, 4});
  const std::vector<int64_t> lengths{4};
  DecodeArgs<float8_e4m3fn> a{.q = q.cview(), .k_cache = k.cview(), .v_cache = v.cview(), .cache_lengths = lengths,
                              .out = out.view()};
  test::expect_error([&] { decode(a); }, "k_scale: expected one float32 scale per cached row for a float8 cache");
}

}  // namespace
}  // namespace qkv
