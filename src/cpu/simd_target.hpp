// Which compiled SIMD target the fused kernels run on: process-wide, because Highway's
// dynamic dispatch reads one process-wide mask of supported targets.
#pragma once

#include <cstdint>
#include <vector>

namespace qkv::cpu {

// Environment variable QKV_SIMD_TARGET (e.g. AVX2, case-insensitive): run the kernels on
// that compiled target instead of the best one the CPU has — for measuring a lower
// target on a newer machine, like PyTorch's ATEN_CPU_CAPABILITY. Read once, at the first
// kernel call; a name this build or CPU lacks makes every call throw qkv::Error. The
// kernel entry points call it themselves.
void apply_simd_target_override();

// Name of the SIMD target the next call will use (e.g. "AVX3", "AVX2"), for benchmarks
// and tests.
const char* simd_target_name();

// The Highway targets compiled into qkv that this CPU supports, best first; tests run
// every one of them through hwy::SetSupportedTargetsForTest.
std::vector<int64_t> compiled_simd_targets();

}  // namespace qkv::cpu
