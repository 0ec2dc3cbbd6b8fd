#!/usr/bin/env bash
# Fuzzes qkv's .npy reader (src/io/npy.cpp) with libFuzzer under ASan + UBSan for a
# bounded time, starting from the NumPy-written files in tests/cli/data.
#
#   bash scripts/fuzz_npy.sh [SECONDS]     (default 60)
#
# Installs clang-14 and libclang-rt-14-dev (Debian 12) if missing; idempotent. Exits
# non-zero if the fuzzer finds a crash, a leak, undefined behaviour or a hang; the input
# that triggered it is left in build/fuzz/ (crash-*, leak-*, timeout-*).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"

packages=(clang-14 libclang-rt-14-dev)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$package")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "fuzz_npy: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

out=build/fuzz
mkdir -p "$out/corpus"
clang++-14 -std=c++20 -O1 -g -fno-omit-frame-pointer \
  -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -Iinclude src/io/npy.cpp tests/fuzz/npy_fuzzer.cpp -o "$out/npy_fuzzer"
cp tests/cli/data/*.npy "$out/corpus/"

echo "fuzz_npy: fuzzing the .npy reader for ${seconds} s"
export TMPDIR="$out"  # the target's scratch file (it also exercises the file reader)
trap 'rm -f "$out"/qkv_npy_fuzz_*.npy' EXIT
"$out/npy_fuzzer" "$out/corpus" \
  -dict=tests/fuzz/npy.dict -max_total_time="$seconds" -max_len=4096 \
  -timeout=10 -rss_limit_mb=2048 -artifact_prefix="$out/" -print_final_stats=1
