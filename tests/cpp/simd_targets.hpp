// Runs a test body once on every SIMD target this build compiled and this CPU runs.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "cpu/simd_target.hpp"
#include "hwy/targets.h"

namespace qkv::test {

// Puts back the targets in force when it was made — the real CPU's, or the one
// QKV_SIMD_TARGET forced — when it goes out of scope, so a failed ASSERT (which returns
// early) cannot leave later tests on another target.
class RestoreSimdTargets {
 public:
  RestoreSimdTargets() : before_(hwy::SupportedTargets()) {}
  RestoreSimdTargets(const RestoreSimdTargets&) = delete;
  RestoreSimdTargets& operator=(const RestoreSimdTargets&) = delete;
  ~RestoreSimdTargets() { hwy::SetSupportedTargetsForTest(before_); }

 private:
  int64_t before_;
};

// body(target) once per compiled target, forced through hwy::SetSupportedTargetsForTest,
// with the target's name in every failure message. Under QKV_SIMD_TARGET only that target:
// the override is applied first (the library applies it at its first call, which inside
// the loop would find only the loop's target supported and refuse the name).
template <class Body>
void for_each_simd_target(Body&& body) {
  cpu::apply_simd_target_override();
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
