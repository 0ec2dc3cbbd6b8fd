#!/usr/bin/env bash
# Sets up and runs every test: the optimized build (warnings are errors, includes the
# install + find_package check, the CLI tests), the same suite under ASan + UBSan, the
# Python package (pip install ., pytest against PyTorch), then a bounded fuzz run.
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

# The .npy reader under libFuzzer (ASan + UBSan), for a bounded time.
bash scripts/fuzz_npy.sh 60
