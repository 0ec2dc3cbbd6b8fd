#!/usr/bin/env bash
# Bitwise comparison of one build's results with a saved baseline, per SIMD target
# (bench/bitwise_digest.cpp prints one hash line per case). Builds nothing.
#
#   bench/compare_digests.sh BUILD_DIR BASELINE_DIR [TARGET...]         compare
#   bench/compare_digests.sh --save BUILD_DIR BASELINE_DIR [TARGET...]  write the baseline
#
# BUILD_DIR/bench/qkv_bitwise_digest must exist (cmake --build BUILD_DIR --target
# qkv_bitwise_digest). BASELINE_DIR holds baseline_digests_<TARGET>.txt. Targets default
# to AVX3 and AVX2 (QKV_SIMD_TARGET names, as the library reads them). QKV_DIGEST_THREADS
# (default 1) is passed as --threads: results must not depend on it, so any value must
# match a 1-thread baseline.
# The baseline must come from the same digest source: to make one for an older tree, copy
# bench/bitwise_digest*.cpp, digest_support.hpp, bench_inputs.hpp and their CMake lines
# into it and build there (only the public headers are used).
# Exit status: 0 every case bitwise equal, 1 some case differs (the lines are printed),
# 2 usage error, missing file or a failed run.
set -euo pipefail

usage() {
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

save=0
if [[ ${1:-} == --save ]]; then
  save=1
  shift
fi
[[ $# -ge 2 ]] || usage
build=$1
dir=$2
shift 2
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(AVX3 AVX2)

exe=$build/bench/qkv_bitwise_digest
if [[ ! -x $exe ]]; then
  echo "compare_digests: $exe not found (build the target qkv_bitwise_digest first)" >&2
  exit 2
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

status=0
for target in "${targets[@]}"; do
  baseline=$dir/baseline_digests_$target.txt
  current=$work/$target.txt
  start=$SECONDS
  if ! QKV_SIMD_TARGET=$target "$exe" --threads "${QKV_DIGEST_THREADS:-1}" >"$current"; then
    echo "compare_digests: $exe failed for QKV_SIMD_TARGET=$target" >&2
    exit 2
  fi
  cases=$(grep -vc '^#' "$current" || true)
  if [[ $save == 1 ]]; then
    mkdir -p "$dir"
    cp "$current" "$baseline"
    echo "$target: saved $cases cases to $baseline ($((SECONDS - start)) s)"
    continue
  fi
  if [[ ! -f $baseline ]]; then
    echo "compare_digests: no baseline $baseline (make one with --save from the old build)" >&2
    exit 2
  fi
  if diff "$baseline" "$current" >"$work/diff"; then
    echo "$target: $cases cases, every one bitwise equal to $baseline ($((SECONDS - start)) s)"
  else
    status=1
    echo "$target: $(grep -c '^<' "$work/diff" || true) of $(grep -vc '^#' "$baseline") baseline lines differ" \
         "(< baseline, > $build):"
    head -n 60 "$work/diff"
  fi
done
exit $status
