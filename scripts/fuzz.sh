#!/usr/bin/env bash
# Fuzzes qkv's file readers with libFuzzer under ASan + UBSan, each for a bounded time:
# the .npy reader (cli/npy.cpp, seeds: the NumPy-written files in tests/cli/data) and
# the safetensors reader (src/nn/checkpoint/safetensors.cpp and nlohmann/json, seeds:
# small files written below).
#
#   bash scripts/fuzz.sh [SECONDS_EACH]     (default 40: 80 s in all)
#
# Installs clang-14 and libclang-rt-14-dev (Debian 12) if missing; idempotent. Exits
# non-zero if a fuzzer finds a crash, a leak, undefined behaviour or a hang; the input
# that triggered it is left in build/fuzz/<target>/ (crash-*, leak-*, timeout-*).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-40}"
bash scripts/setup.sh  # nlohmann/json's headers

packages=(clang-14 libclang-rt-14-dev)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$package")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "fuzz: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

flags=(-std=c++20 -O1 -g -fno-omit-frame-pointer
       -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -Iinclude -Icli)

# A safetensors seed: the 8-byte little-endian header length, the header, the data.
write_seed() {  # file header data-bytes-as-printf-escapes
  local length=${#2} le="" i
  for ((i = 0; i < 8; i++)); do le+=$(printf '\\x%02x' $(((length >> (8 * i)) & 255))); done
  printf "${le}%s${3}" "$2" >"$1"
}

fuzz() {  # name source... -- fuzzer options...
  local name=$1 sources=() out
  shift
  while [ "$1" != "--" ]; do sources+=("$1"); shift; done
  shift
  out=build/fuzz/$name
  clang++-14 "${flags[@]}" "${sources[@]}" -o "$out/fuzzer"
  echo "fuzz: fuzzing the $name reader for ${seconds} s"
  # TMPDIR: the targets' scratch files (they also exercise the file readers).
  TMPDIR="$out" "$out/fuzzer" "$out/corpus" -max_total_time="$seconds" -timeout=10 \
    -rss_limit_mb=2048 -artifact_prefix="$out/" -print_final_stats=1 "$@"
}
trap 'rm -f build/fuzz/*/qkv_*_fuzz_*' EXIT

mkdir -p build/fuzz/npy/corpus build/fuzz/safetensors/corpus
cp tests/cli/data/*.npy build/fuzz/npy/corpus/
seeds=build/fuzz/safetensors/corpus
write_seed "$seeds/f32" '{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}' \
  '\x00\x00\x80\x3f\x00\x00\x00\xc0'
write_seed "$seeds/metadata" \
  '{"__metadata__":{"step":"12","caf\u00e9":"\n"},"b":{"dtype":"I64","shape":[1,1],"data_offsets":[8,16]},"a":{"dtype":"F64","shape":[],"data_offsets":[0,8]}}' \
  '\x00\x00\x00\x00\x00\x00\xf0\x3f\x07\x00\x00\x00\x00\x00\x00\x00'
write_seed "$seeds/empty" '{}' ''

fuzz npy cli/npy.cpp tests/fuzz/npy_fuzzer.cpp -- -dict=tests/fuzz/npy.dict -max_len=4096
fuzz safetensors src/nn/checkpoint/safetensors.cpp tests/fuzz/safetensors_fuzzer.cpp -- \
  -dict=tests/fuzz/safetensors.dict -max_len=4096
