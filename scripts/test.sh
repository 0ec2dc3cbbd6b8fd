#!/usr/bin/env bash
# Sets up and runs every test: the optimized build (warnings are errors, includes the
# install + find_package check, the CLI tests), the same suite under ASan + UBSan, the
# Python package (pip install ., pytest against PyTorch), the core's suite for aarch64
# under emulation, then bounded fuzz runs. Every compile goes through ccache (CMakeLists.txt),
# and each stage prints its time, so a slow stage shows in CI's log.
set -euo pipefail
cd "$(dirname "$0")/.."

started=$SECONDS
stage() {  # stage NAME COMMAND...: runs the command, then prints its time and the total
  local name=$1 begin=$SECONDS
  shift
  echo "=== qkv test stage: $name"
  "$@"
  echo "=== qkv test stage: $name took $((SECONDS - begin)) s (total $((SECONDS - started)) s)"
}

stage setup bash scripts/setup.sh

stage "release build" eval "cmake --preset release && cmake --build --preset release"
stage "release tests" ctest --preset release

stage "asan build" eval "cmake --preset asan && cmake --build --preset asan"
stage "asan tests" ctest --preset asan

stage python bash scripts/test_python.sh

# The core and its C++ tests cross-built for aarch64, run under qemu (NEON, then SVE).
stage arm bash scripts/test_arm.sh

# The .npy and safetensors readers under libFuzzer (ASan + UBSan), 40 s each.
stage fuzz bash scripts/fuzz.sh 40

if command -v ccache >/dev/null 2>&1; then ccache --show-stats | head -n 12; fi
