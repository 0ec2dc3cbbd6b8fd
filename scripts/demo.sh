#!/usr/bin/env bash
# Sets up, builds qkv (release) and runs the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release --target quickstart
./build/release/examples/quickstart/quickstart
