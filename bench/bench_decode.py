#!/usr/bin/env python3
"""Decode: one query per head against a long KV cache — qkv.decode against PyTorch SDPA
(enable_gqa=True, the call transformers makes), in one process.

Per row: median time of --repeats calls after a warm-up; effective bandwidth = K+V bytes
read / time; the roofline limit = max(bytes / streaming bandwidth, flops / FMA peak),
both measured in the same run at the same thread count (build/release/bench/
qkv_decode_probe bandwidth T, build/release/bench/qkv_fma_peak); "of limit" = limit
time / qkv time; "vs torch" = torch time / qkv time (> 1: qkv is faster).

Bytes: B·N·Hkv·(d + dv)·(bytes per element). FLOPs: 4·B·Hq·Nq·N·d (scores and P·V).
The peer gets the same cache in its dtype (float32 rows: float32 SDPA; bfloat16 rows:
bfloat16 q/k/v SDPA). Paged rows: a shuffled pool of blocks (vLLM layout) with a block
table; torch has no paged SDPA, so its column repeats the contiguous time.

    python bench/bench_decode.py                 # the default grid (a few minutes)
    python bench/bench_decode.py --quick         # a handful of rows
    python bench/bench_decode.py --shapes 32/8/128 --lengths 32768 --batches 1 --threads 1
    python bench/bench_decode.py --window 4096 --window-only --shapes 32/8/128 --lengths 32768 131072
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import qkv

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.path.join(HERE, "..", "build", "release", "bench")


def probe(*args) -> dict:
    out = subprocess.run([os.path.join(BUILD, args[0]), *args[1:]], check=True, capture_output=True, text=True)
    values = {}
    for line in out.stdout.split("\n"):
        for item in line.split():
            if "=" in item:
                key, value = item.split("=", 1)
                values[key] = value
    return values


def median_time(fn, repeats: int, budget_s: float = 3.0) -> float:
    fn()  # warm-up: caches, page faults, thread pools
    times = []
    start = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s and len(times) >= 3:
            break
    return statistics.median(times)


def paged_copy(k, v, block: int, seed: int = 0):
    """(pool_k, pool_v, table) holding k, v [B, Hkv, N, d] in shuffled blocks."""
    batch, hkv, n, d = k.shape
    per_seq = (n + block - 1) // block
    order = torch.from_numpy(np.random.default_rng(seed).permutation(batch * per_seq).astype(np.int32))
    table = order.view(batch, per_seq)
    pool_k = torch.empty(batch * per_seq, block, hkv, d, dtype=k.dtype)
    pool_v = torch.empty_like(pool_k)
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [B, N, Hkv, d]
    for b in range(batch):
        for j in range(per_seq):
            rows = slice(j * block, min(n, (j + 1) * block))
            pool_k[table[b, j], : rows.stop - rows.start] = kt[b, rows]
            pool_v[table[b, j], : rows.stop - rows.start] = vt[b, rows]
    return pool_k, pool_v, table


def window_rows(args, shapes, lengths) -> None:
    """Sliding-window decode: qkv.decode(window=(W - 1, -1)) reads only the last W keys of
    each sequence; its time against the full cache's, its bandwidth over the window's
    bytes, and SDPA on the same W keys (a slice of the cache, no copy)."""
    w = args.window
    print(f"# sliding window of {w} keys, batch 1, contiguous [B, Hkv, N, d] cache")
    print("| threads | shape Hq/Hkv d | keys | cache | qkv window ms | qkv full ms | full/window | "
          "GB/s (window bytes) | torch on the window ms | vs torch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for hq, hkv, d in shapes:
        for n in lengths:
            if n <= w:
                continue
            for dtype in (torch.float32, torch.bfloat16):
                torch.manual_seed(0)
                q = torch.randn(1, hq, 1, d)
                k = torch.randn(1, hkv, n, d).to(dtype)
                v = torch.randn(1, hkv, n, d).to(dtype)
                lengths_t = torch.full((1,), n, dtype=torch.int64)
                window_bytes = w * hkv * 2 * d * (4 if dtype == torch.float32 else 2)
                kw, vw, qp = k[:, :, n - w:], v[:, :, n - w:], q.to(dtype)
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    win = median_time(lambda: qkv.decode(q, k, v, lengths_t, window=(w - 1, -1), threads=threads),
                                      args.repeats)
                    full = median_time(lambda: qkv.decode(q, k, v, lengths_t, threads=threads), args.repeats)
                    peer = median_time(lambda: F.scaled_dot_product_attention(qp, kw, vw, enable_gqa=True),
                                       args.repeats)
                    print(f"| {threads} | {hq}/{hkv} d{d} | {n} | {'fp32' if dtype == torch.float32 else 'bf16'} | "
                          f"{win * 1e3:.3f} | {full * 1e3:.2f} | {full / win:.1f}× | {window_bytes / win / 1e9:.1f} | "
                          f"{peer * 1e3:.3f} | {peer / win:.2f}× |", flush=True)
                del k, v


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--shapes", nargs="+", default=None, help="HQ/HKV/D, e.g. 32/8/128")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="cached keys")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--window", type=int, default=0,
                        help="also time a sliding window of this many keys (Mistral-style decode) "
                             "against the full cache and against SDPA on the window's keys (a view)")
    parser.add_argument("--window-only", action="store_true", help="only the sliding-window rows")
    parser.add_argument("--no-torch-above-gb", type=float, default=3.0,
                        help="skip torch where its GQA expansion of K/V would exceed this")
    args = parser.parse_args()

    shapes = [(12, 12, 64), (32, 8, 128), (64, 8, 128)]
    lengths = [4096, 32768, 131072]
    if args.quick:
        shapes, lengths = [(12, 12, 64), (32, 8, 128)], [4096, 32768]
    if args.shapes:
        shapes = [tuple(int(x) for x in shape.split("/")) for shape in args.shapes]
    if args.lengths:
        lengths = args.lengths

    bandwidth = {t: float(probe("qkv_decode_probe", "bandwidth", str(t))["bandwidth_gbs"]) for t in args.threads}
    fma = {}
    for line in subprocess.run([os.path.join(BUILD, "qkv_fma_peak"), str(max(args.threads))], check=True,
                               capture_output=True, text=True).stdout.splitlines():
        fields = dict(item.split("=") for item in line.split())
        fma[int(fields["threads"])] = float(fields["gflops"])
        target = fields["target"]
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, qkv SIMD target "
          f"{os.environ.get('QKV_SIMD_TARGET', target)}")
    print(f"# load average at start (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for t in args.threads:
        print(f"# threads={t}: streaming read {bandwidth[t]:.1f} GB/s, FMA peak {fma[t]:.0f} GFLOP/s")
    if args.window:
        window_rows(args, shapes, lengths)
        if args.window_only:
            return 0
    print("| threads | shape Hq/Hkv d | keys | B | cache | layout | qkv ms | GB/s | of limit | limit | torch ms | vs torch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for hq, hkv, d in shapes:
        for n in lengths:
            for batch in args.batches:
                for dtype in (torch.float32, torch.bfloat16):
                    element = 4 if dtype == torch.float32 else 2
                    cache_bytes = batch * n * hkv * 2 * d * element
                    if batch == 8 and (cache_bytes > 2.2e9 or args.quick):
                        continue
                    torch.manual_seed(0)
                    q = torch.randn(batch, hq, 1, d)
                    k = torch.randn(batch, hkv, n, d).to(dtype)
                    v = torch.randn(batch, hkv, n, d).to(dtype)
                    lengths_t = torch.full((batch,), n, dtype=torch.int64)
                    layouts = {"contiguous": None}
                    for block in (16, 128):
                        layouts[f"paged {block}"] = paged_copy(k, v, block)
                    flops = 4.0 * batch * hq * n * d
                    torch_expanded = cache_bytes * (hq // hkv) / 1e9
                    q_peer = q.to(dtype)
                    for threads in args.threads:
                        torch.set_num_threads(threads)
                        torch_ms = None
                        if torch_expanded <= args.no_torch_above_gb:
                            torch_ms = 1e3 * median_time(
                                lambda: F.scaled_dot_product_attention(q_peer, k, v, enable_gqa=True), args.repeats)
                        limit_s = max(cache_bytes / (bandwidth[threads] * 1e9), flops / (fma[threads] * 1e9))
                        bound = "bw" if cache_bytes / bandwidth[threads] >= flops / fma[threads] else "fma"
                        for layout, paged in layouts.items():
                            if paged is None:
                                call = lambda: qkv.decode(q, k, v, lengths_t, threads=threads)  # noqa: E731
                            else:
                                pk, pv, table = paged
                                call = lambda: qkv.decode(q, pk, pv, lengths_t, block_table=table,  # noqa: E731
                                                          threads=threads)
                            qkv_s = median_time(call, args.repeats)
                            torch_cell = "—" if torch_ms is None else f"{torch_ms:.2f}"
                            ratio = "—" if torch_ms is None else f"{torch_ms / (qkv_s * 1e3):.2f}×"
                            print(f"| {threads} | {hq}/{hkv} d{d} | {n} | {batch} | "
                                  f"{'fp32' if element == 4 else 'bf16'} | {layout} | {qkv_s * 1e3:.2f} | "
                                  f"{cache_bytes / qkv_s / 1e9:.1f} | {limit_s / qkv_s:.0%} | {bound} | "
                                  f"{torch_cell} | {ratio} |", flush=True)
                    del k, v, layouts
    print(f"# load average at end (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
