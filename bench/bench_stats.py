#!/usr/bin/env python3
"""What attention health costs: qkv's forward with and without its softmax statistics.

For each shape, the same fp32 inputs (PyTorch's [B, H, N, d] layout) go through

  qkv            qkv.attention(q, k, v)                          (the baseline)
  qkv stats      qkv.attention(..., return_stats=True)           per-head statistics
  qkv row stats  qkv.attention(..., return_row_stats=True)       and per-row values
  torch hook     torch SDPA, plus the weights softmax(q·kᵀ/√d) materialized to get the
                 same statistics: what users bolt on today (O(N²) memory)

with the same thread count. The three qkv variants run interleaved (A, B, C, A, B, C,
...) so that a machine whose speed drifts (other jobs) charges all of them alike. Two
estimates of the overhead: "paired", the median over rounds of (variant time / baseline
time of the same round) − 1, and "best", (fastest variant run / fastest baseline run)
− 1, which on a loaded machine is the steadier one (interference only ever adds time).
Times shown are the fastest runs. With one thread the clock is the calling thread's
CPU time (qkv computes on the calling thread then), which time slices lost to other
processes do not inflate; with more, wall time. The target (issue 16): at most 3 % for
the statistics.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import keep_freed_memory  # noqa: E402

import qkv  # noqa: E402

SHAPES = [  # (B, H, N, d, causal)
    (1, 8, 4096, 64, False),
    (1, 8, 4096, 64, True),
    (4, 12, 512, 32, False),
    (4, 12, 512, 32, True),
]


def torch_hook(q, k, v, causal: bool):
    """SDPA, then the statistics from the materialized weights (a forward hook's way)."""
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    if causal:
        n = q.shape[-2]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    p = scores.softmax(dim=-1)
    largest = p.amax(dim=-1)
    entropy = -(p * p.clamp_min(1e-45).log()).sum(dim=-1)
    return out, largest.mean(-1), entropy.mean(-1), (largest > 0.99).float().mean(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count() or 1])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timed rounds")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch hook column")
    args = parser.parse_args()
    keep_freed_memory()

    print(f"# machine: {platform.machine()}, {os.cpu_count()} cpus; torch {torch.__version__}; "
          f"qkv {qkv.__version__}; rounds {args.rounds}")
    print("| shape | thr | qkv ms | + stats ms | overhead paired / best | + row stats ms "
          "| overhead paired / best | torch hook ms |")
    print("|---|---|---|---|---|---|---|---|")
    for batch, heads, n, d, causal in SHAPES:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(batch, heads, n, d, generator=g) for _ in range(3))
        mode = "top_left" if causal else None
        for threads in args.threads:
            torch.set_num_threads(threads)
            variants = {
                "plain": lambda: qkv.attention(q, k, v, causal=mode, threads=threads),
                "stats": lambda: qkv.attention(q, k, v, causal=mode, threads=threads,
                                               return_stats=True),
                "rows": lambda: qkv.attention(q, k, v, causal=mode, threads=threads,
                                              return_row_stats=True),
            }
            for fn in variants.values():
                fn()  # warm-up
            clock = time.thread_time if threads == 1 else time.perf_counter
            times = {name: [] for name in variants}
            for _ in range(args.rounds):
                for name, fn in variants.items():
                    start = clock()
                    fn()
                    times[name].append(clock() - start)

            def overhead(name):
                ratios = [t / p for t, p in zip(times[name], times["plain"])]
                best = min(times[name]) / min(times["plain"])
                return (f"{100 * (statistics.median(ratios) - 1):+.1f} % / "
                        f"{100 * (best - 1):+.1f} %")

            hook = "—"
            if not args.no_torch:
                torch_hook(q, k, v, causal)
                hook_times = []
                for _ in range(max(3, args.rounds // 5)):
                    start = time.perf_counter()
                    torch_hook(q, k, v, causal)
                    hook_times.append(time.perf_counter() - start)
                hook = f"{1e3 * min(hook_times):.1f}"
            ms = {name: 1e3 * min(t) for name, t in times.items()}
            label = f"B={batch} H={heads} N={n} d={d}{' causal' if causal else ''}"
            print(f"| {label} | {threads} | {ms['plain']:.1f} | {ms['stats']:.1f} | "
                  f"{overhead('stats')} | {ms['rows']:.1f} | {overhead('rows')} | {hook} |",
                  flush=True)


if __name__ == "__main__":
    main()
