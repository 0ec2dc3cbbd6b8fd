// The SIMD target choice of simd_target.hpp. Compiled with the kernels' target
// definitions (src/CMakeLists.txt), so HWY_TARGETS here is the set the kernels have.
#include "cpu/simd_target.hpp"

#include <cstdlib>
#include <string>
#include <strings.h>

#include "hwy/targets.h"
#include "qkv/error.hpp"

namespace qkv::cpu {

void apply_simd_target_override() {
  // Applied once; a bad name throws on every call instead (the static stays unset).
  static const bool applied = [] {
    const char* wanted = std::getenv("QKV_SIMD_TARGET");
    if (wanted == nullptr || *wanted == '\0') return true;
    std::string available;
    for (int64_t target : compiled_simd_targets()) {
      if (strcasecmp(wanted, hwy::TargetName(target)) == 0) {
        hwy::SetSupportedTargetsForTest(target);
        return true;
      }
      available += std::string(available.empty() ? "" : ", ") + hwy::TargetName(target);
    }
    throw Error(std::string("QKV_SIMD_TARGET=") + wanted +
                ": not a SIMD target of this build that this CPU runs; choose one of " + available);
  }();
  (void)applied;
}

const char* simd_target_name() {
  apply_simd_target_override();
  // Highway numbers targets so that the best has the lowest bit.
  const int64_t usable = hwy::SupportedTargets() & HWY_TARGETS;
  return hwy::TargetName(usable & -usable);
}

std::vector<int64_t> compiled_simd_targets() {
  std::vector<int64_t> targets;
  for (int64_t rest = hwy::SupportedTargets() & HWY_TARGETS; rest != 0; rest &= rest - 1)
    targets.push_back(rest & -rest);
  return targets;
}

}  // namespace qkv::cpu
