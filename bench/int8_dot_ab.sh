#!/usr/bin/env bash
# Decode over an int8 cache: the float32 arithmetic (QKV_DOT_PRODUCTS=off) against the
# VNNI kernels (src/cpu/int8_dot.cpp, QKV_DOT_PRODUCTS=on), d 128, 8 kv heads, PyTorch's
# [B, Hkv, N, d] layout, 1 and 2 threads. Each row is the fastest of 5 alternating runs
# of each (the probe itself keeps the best of 15 calls), so a noisy neighbour slows both
# alike. Needs build/release/bench/qkv_decode_probe and a CPU with AVX512-VNNI.
#   bench/int8_dot_ab.sh [BUILD_DIR]
set -euo pipefail
P=${1:-build/release}/bench/qkv_decode_probe
echo "# $(date -u '+%Y-%m-%d %H:%M') UTC, load $(cut -d' ' -f1 /proc/loadavg)"
echo "| heads | keys | threads | fp32 FMAs ms | VNNI ms | VNNI speed-up |"
echo "|---|---|---|---|---|---|"
for thr in 1 2; do for hq in 32 64; do for n in 1024 4096 32768; do
  best_off=999999; best_on=999999
  for i in 1 2 3 4 5; do
    for m in off on; do
      t=$(QKV_DOT_PRODUCTS=$m $P decode $hq 8 128 $n i8 $thr -1 | head -1 | sed 's/.*decode_ms=\([0-9.]*\).*/\1/')
      if [[ $m == off ]]; then best_off=$(python3 -c "print(min($best_off, $t))"); else best_on=$(python3 -c "print(min($best_on, $t))"); fi
    done
  done
  echo "| $hq/8 | $n | $thr | $best_off | $best_on | $(python3 -c "print(f'{$best_off / $best_on:.2f}')")× |"
done; done; done
echo "# end $(date -u '+%H:%M') UTC, load $(cut -d' ' -f1 /proc/loadavg)"
