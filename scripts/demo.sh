#!/usr/bin/env bash
# Sets up, builds qkv (release) and runs the main job: `qkv demo` trains a small
# transformer on Alice in Wonderland with qkv's attention (extra arguments go to it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release --target qkv_cli
./build/release/cli/qkv demo "$@"
