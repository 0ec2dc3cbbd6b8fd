// Runs a test body once on every SIMD target this build compiled and this CPU runs.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "cpu/simd_target.hpp"
#include "hwy/targets.h"

namespace qkv::test {

// Puts the real CPU's targets back when it goes out of scope, so a failed ASSERT (which
// returns early) cannot leave later tests on a forced target.
class RestoreSimdTargets {
 public:
  RestoreSimdTargets() = default;
  RestoreSimdTargets(const RestoreSimdTargets&) = delete;
  RestoreSimdTargets& operator=(const RestoreSimdTargets&) = delete;
  ~RestoreSimdTargets() { hwy::SetSupportedTargetsForTest(0); }
};

// body(target) once per compiled target, forced through hwy::SetSupportedTargetsForTest,
// with the target's name in every failure message.
template <class Body>
void for_each_simd_target(Body&& body) {
  const std::vector<int64_t> targets = cpu::compiled_simd_targets();
  ASSERT_FALSE(targets.empty());
  const RestoreSimdTargets restore;
  for (int64_t target : targets) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(hwy::TargetName(target));
    body(target);
  }
}

}  // namespace qkv::test
