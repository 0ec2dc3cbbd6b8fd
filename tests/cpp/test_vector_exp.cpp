// The kernels' vector exp (ExpKeepNaN in src/cpu/block_ops-inl.h) on every compiled SIMD
// target: its stated error bound against the fp64 exp, and the special values the
// kernels rely on (NaN stays NaN, −inf gives exactly 0, e^0 = 1 exactly).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "cpu/cpu_backend.hpp"
#include "simd_targets.hpp"

namespace qkv {
namespace {

// Distance in units of the float spacing at the exact value (ULPs of the result).
double ulps(float got, double exact) {
  const double spacing = std::nextafter(static_cast<float>(exact), std::numeric_limits<float>::infinity()) -
                         static_cast<float>(exact);
  return std::abs(static_cast<double>(got) - exact) / spacing;
}

TEST(VectorExp, WithinTwoUlpsOverTheSoftmaxRange) {
  // Every argument the kernels pass is ≤ 0 up to rounding: a dense sweep of [−87, 0.5]
  // (normal results) plus random points, odd count so the tail path runs too.
  std::vector<float> x;
  for (int i = 0; i <= 400'000; ++i) x.push_back(-87.0f + 87.5f * static_cast<float>(i) / 400'000.0f);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> any(-87.0f, 88.0f);
  for (int i = 0; i < 100'001; ++i) x.push_back(any(rng));
  for (float tiny : {1e-30f, -1e-30f, 1e-7f, -1e-7f, 0.34657f, -0.34657f, 0.34658f, -0.34658f})
    x.push_back(tiny);
  std::vector<float> out(x.size());
  test::for_each_simd_target([&](int64_t) {
    cpu::softmax_exp(x.data(), out.data(), x.size());
    double worst = 0.0;
    float worst_at = 0.0f;
    for (size_t i = 0; i < x.size(); ++i) {
      const double e = ulps(out[i], std::exp(static_cast<double>(x[i])));
      if (e > worst) worst = e, worst_at = x[i];
    }
    EXPECT_LE(worst, 2.0) << "at x = " << worst_at;

    std::printf("worst %.3f ULP at %g\n", worst, static_cast<double>(worst_at));
  });
}

TEST(VectorExp, SpecialValues) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> x{0.0f, -0.0f, -inf, nan, -88.0f, -100.0f, -1e30f, inf, 89.0f, 1e30f, -nan};
  std::vector<float> out(x.size());
  test::for_each_simd_target([&](int64_t) {
    cpu::softmax_exp(x.data(), out.data(), x.size());
    EXPECT_EQ(out[0], 1.0f);
    EXPECT_EQ(out[1], 1.0f);
    EXPECT_EQ(out[2], 0.0f);  // removed keys weigh exactly nothing
    EXPECT_TRUE(std::isnan(out[3]));  // a NaN score stays visible
    EXPECT_EQ(out[4], 0.0f);  // flushed below e^−88 (documented)
    EXPECT_EQ(out[5], 0.0f);
    EXPECT_EQ(out[6], 0.0f);
    EXPECT_EQ(out[7], inf);
    EXPECT_EQ(out[8], inf);
    EXPECT_EQ(out[9], inf);
    EXPECT_TRUE(std::isnan(out[10]));
  });
}

TEST(VectorExp, SubnormalResultsAreTinyAndNeverNegative) {
  // Between e^−88 and e^−87.3 the result may be flushed or subnormal: never more than
  // the smallest normal float away, never negative.
  std::vector<float> x;
  for (int i = 0; i <= 1000; ++i) x.push_back(-88.0f + 0.8f * static_cast<float>(i) / 1000.0f);
  std::vector<float> out(x.size());
  test::for_each_simd_target([&](int64_t) {
    cpu::softmax_exp(x.data(), out.data(), x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      EXPECT_GE(out[i], 0.0f);
      EXPECT_LE(std::abs(out[i] - std::exp(static_cast<double>(x[i]))),
                static_cast<double>(std::numeric_limits<float>::min()))
          << x[i];
    }
  });
}

}  // namespace
}  // namespace qkv
