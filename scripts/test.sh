#!/usr/bin/env bash
# Sets up and runs every test: the optimized build (warnings are errors, includes the
# install + find_package check, the CLI tests), the same suite under ASan + UBSan, the
# Python package (pip install ., pytest against PyTorch), the core's suite for aarch64
# under emulation, then bounded fuzz runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

cmake --preset release
cmake --build --preset release
ctest --preset release

cmake --preset asan
cmake --build --preset asan
ctest --preset asan

bash scripts/test_python.sh

# The core and its C++ tests cross-built for aarch64, run under qemu (NEON, then SVE).
bash scripts/test_arm.sh

# The .npy and safetensors readers under libFuzzer (ASan + UBSan), 40 s each.
bash scripts/fuzz.sh 40
