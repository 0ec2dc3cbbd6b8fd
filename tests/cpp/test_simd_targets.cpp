// The test support's per-target loop (simd_targets.hpp): every compiled target in turn,
// and the real CPU's targets back afterwards, even when the body stops on a failed ASSERT.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "simd_targets.hpp"

namespace qkv {
namespace {

int64_t real_targets() {
  hwy::SetSupportedTargetsForTest(0);
  return hwy::SupportedTargets();
}

TEST(ForEachSimdTarget, VisitsEveryCompiledTargetAndRestoresTheCpu) {
  const int64_t real = real_targets();
  std::vector<int64_t> seen;
  test::for_each_simd_target([&](int64_t target) {
    seen.push_back(target);
    EXPECT_STREQ(cpu::simd_target_name(), hwy::TargetName(target));
  });
  EXPECT_EQ(seen, cpu::compiled_simd_targets());
  EXPECT_EQ(hwy::SupportedTargets(), real);
}

TEST(ForEachSimdTarget, RestoresTheCpuAfterAFailedAssert) {
  const int64_t real = real_targets();
  static int calls;  // EXPECT_FATAL_FAILURE's statement may not use locals
  calls = 0;
  EXPECT_FATAL_FAILURE(test::for_each_simd_target([](int64_t) {
                         if (calls++ == 0) FAIL() << "stopped on the first target";
                       }),
                       "stopped on the first target");
  EXPECT_EQ(calls, static_cast<int>(cpu::compiled_simd_targets().size()));
  EXPECT_EQ(hwy::SupportedTargets(), real);
}

}  // namespace
}  // namespace qkv
