#!/usr/bin/env bash
# Before/after timing of two build directories on both SIMD targets: see before_after.py.
#   bench/before_after.sh BASE_BUILD NEW_BUILD [--quick] [--targets AVX3 AVX2] [--threads 1 2]
exec python3 "$(dirname "$0")/before_after.py" "$@"
