#!/usr/bin/env python3
"""Decode speed of each KV-cache storage: one query per head against a long qkv.KVCache
(cache.attend, bottom-right), float32 / bfloat16 / float16 / int8 with row scales / int8
with channel-scaled keys / int4 (with and without a float window), in one process at the
same thread count.

Per row: median time of --repeats attends after a warm-up; bytes = what the kernel
streams (every array of the cache: K and V elements, row scales, channel scales and zero
points per group of group_size tokens, int4 values' group scales); effective bandwidth = bytes / time; "vs int8
row" = int8-row time / this time (> 1: faster).

    python bench/bench_kv_storage.py                        # 32/8 and 12/12 heads, d = 128, 32k keys
    python bench/bench_kv_storage.py --lengths 131072 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import qkv

STORAGES = [("float32", {}), ("bfloat16", {}), ("float16", {}), ("int8", {}),
            ("int8", {"key_scales": "channel", "group_size": 32}),
            ("int4", {"group_size": 64, "scale_dtype": "float32"}),
            ("int4", {"group_size": 64, "float_window": 32, "scale_dtype": "float32"}),
            ("int4", {"group_size": 64, "scale_dtype": "float16"}),
            ("int4", {"group_size": 64, "float_window": 32, "scale_dtype": "float16"})]


def name_of(dtype, extra):
    if not extra:
        return dtype + (" row" if dtype == "int8" else "")
    window = f" + {extra['float_window']} float" if extra.get("float_window") else ""
    scales = " fp16 scales" if extra.get("scale_dtype") == "float16" else ""
    return f"{dtype}{scales} channel G={extra['group_size']}{window}"


def stream_bytes(cache):
    """Bytes decode reads: the cache's K and V arrays, row scales, channel scales and zero
    points, int4 values' group scales — every array it holds, filled to capacity (the
    float window's few rows left out)."""
    arrays = list(cache.storage()) + [a for a in (cache.scales() or ()) if a is not None]
    arrays += list(cache.channel_scales() or ())
    if cache.value_group_scales() is not None:
        arrays.append(cache.value_group_scales())
    return sum(a.nbytes for a in arrays)


def time_attend(cache, q, threads, repeats):
    cache.attend(q, threads=threads)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        cache.attend(q, threads=threads)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["32/8/128", "12/12/128"], help="Hq/Hkv/d")
    parser.add_argument("--lengths", nargs="+", type=int, default=[32768])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print(f"# KVCache.attend, 1 query per head, batch 1; load {os.getloadavg()[0]:.1f}; qkv {qkv.__version__}")
    print("| heads | keys | threads | storage | bytes/value | ms | GB/s | vs int8 row |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        hq, hkv, d = (int(x) for x in shape.split("/"))
        for n in args.lengths:
            torch.manual_seed(0)
            k, v = torch.randn(1, hkv, n, d), torch.randn(1, hkv, n, d)
            q = torch.randn(1, hq, 1, d)
            caches = []
            for dtype, extra in STORAGES:
                cache = qkv.KVCache(1, n, hkv, d, dtype=dtype, **extra)
                cache.append(k, v)
                caches.append((dtype, extra, cache))
            for threads in args.threads:
                times = [time_attend(cache, q, threads, args.repeats) for _, _, cache in caches]
                int8_row = times[3]
                for (dtype, extra, cache), t in zip(caches, times):
                    b = stream_bytes(cache)
                    print(f"| {hq}/{hkv} | {n} | {threads} | {name_of(dtype, extra)} | {b / (2 * n * hkv * d):.3f} | "
                          f"{t * 1e3:.2f} | {b / t / 1e9:.1f} | {int8_row / t:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
