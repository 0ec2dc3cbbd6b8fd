// What the emulated aarch64 runs (scripts/test_arm.sh) rely on, checked inside them: the
// SIMD targets the tests' per-target loops visit and SVE's vector length are the ones
// the run was set up for, so that an emulator quietly offering a smaller CPU fails the
// run instead of testing less. The runs name what they expect in the environment (the
// arm64 test presets); elsewhere these tests are skipped.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "cpu/simd_target.hpp"
#include "hwy/targets.h"

#if defined(__aarch64__) && defined(__linux__)
#include <sys/prctl.h>
#endif

namespace qkv {
namespace {

TEST(Platform, SimdTargetsAreTheOnesThisRunExpects) {
  const char* expected = std::getenv("QKV_EXPECT_SIMD_TARGETS");
  if (expected == nullptr) GTEST_SKIP() << "QKV_EXPECT_SIMD_TARGETS is not set";
  std::string seen;
  for (int64_t target : cpu::compiled_simd_targets()) {
    if (!seen.empty()) seen += ',';
    seen += hwy::TargetName(target);
  }
  EXPECT_EQ(seen, expected);
}

// The SVE vector length in bits the kernels' SVE targets run with (0: the CPU has no
// SVE). Highway's Lanes() on SVE is this length over the lane size.
TEST(Platform, SveVectorLengthIsTheOneThisRunExpects) {
  const char* expected = std::getenv("QKV_EXPECT_SVE_BITS");
  if (expected == nullptr) GTEST_SKIP() << "QKV_EXPECT_SVE_BITS is not set";
#if defined(__aarch64__) && defined(__linux__)
  const int length = prctl(PR_SVE_GET_VL);  // bytes and flags; −1 without SVE
  const int bits = length < 0 ? 0 : (length & PR_SVE_VL_LEN_MASK) * 8;
  EXPECT_EQ(bits, std::atoi(expected));
#else
  FAIL() << "QKV_EXPECT_SVE_BITS=" << expected << " is only meaningful on aarch64 Linux";
#endif
}

}  // namespace
}  // namespace qkv
