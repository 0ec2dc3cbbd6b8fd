#!/usr/bin/env python3
"""Attention variants: what each costs over a plain call, and the sliding window's
skipping, measured in one process (qkv's cpu backend; PyTorch has none of these fused on
the CPU, so the ratios are qkv against qkv).

Rows:
  - [1,8,N,64] causal, plain vs ALiBi, soft-cap, sinks, dropout 0.1 (each alone), fwd and
    fwd+bwd: time / plain time (target ≤ 1.15).
  - Window 512 at N = 16384 causal against a dense causal call at N = 1024, per query
    block: the window's time / (16 × the N = 1024 time) (target ≤ 1.3: the work grows
    with N·window, not N²).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_attention  # noqa: E402
from bench_attention import keep_freed_memory, median_time  # noqa: E402

import qkv  # noqa: E402


def timed(q, k, v, dout, backward, threads, repeats, **kw):
    def run():
        out, lse = qkv.attention(q, k, v, return_lse=True, backend="cpu", threads=threads, **kw)
        if backward:
            qkv.attention_backward(q, k, v, out, lse, dout, backend="cpu", threads=threads,
                                   seed=kw.get("seed"), **{x: y for x, y in kw.items() if x != "seed"})
    return median_time(run, repeats)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--window-n", type=int, default=16384)
    parser.add_argument("--clock", default="wall", choices=tuple(bench_attention.CLOCK),
                        help="thread: the calling thread's CPU time, fastest run (with "
                             "--threads 1; see bench_attention.py --clock)")
    args = parser.parse_args()
    if args.clock == "thread":
        if args.threads != 1:
            parser.error("--clock thread needs --threads 1")
        bench_attention.clock, bench_attention.summary = bench_attention.CLOCK["thread"], min
    keep_freed_memory()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    n, heads, d = args.n, 8, 64
    q, k, v, dout = (torch.randn(1, heads, n, d, generator=g) for _ in range(4))
    variants = {
        "alibi": dict(alibi_slopes=[2.0 ** (-(h + 1)) for h in range(heads)]),
        "softcap 30": dict(softcap=30.0),
        "sinks": dict(sinks=[0.5] * heads),
        "dropout 0.1": dict(dropout_p=0.1, seed=1),
    }
    print(f"# qkv {qkv.__version__}, {args.threads} threads, clock {args.clock}, "
          f"[1,{heads},{n},{d}] causal")
    print("| variant | pass | plain ms | variant ms | variant/plain |")
    print("|---|---|---|---|---|")
    for backward in (False, True):
        plain = timed(q, k, v, dout, backward, args.threads, args.repeats, causal="top_left")
        for name, kw in variants.items():
            t = timed(q, k, v, dout, backward, args.threads, args.repeats, causal="top_left", **kw)
            print(f"| {name} | {'fwd+bwd' if backward else 'fwd'} | {plain * 1e3:.1f} | "
                  f"{t * 1e3:.1f} | {t / plain:.2f} |", flush=True)

    wn = args.window_n
    qw, kw_, vw, dw = (torch.randn(1, heads, wn, d, generator=g) for _ in range(4))
    q1, k1, v1, d1 = (x[:, :, :1024].contiguous() for x in (qw, kw_, vw, dw))
    print(f"\n# window 512 at N={wn} causal vs dense causal N=1024 (×{wn // 1024} query blocks)")
    print("| pass | window ms | dense 1024 ms × blocks | ratio |")
    print("|---|---|---|---|")
    for backward in (False, True):
        t_window = timed(qw, kw_, vw, dw, backward, args.threads, args.repeats, causal="top_left",
                         window=(512, 0))
        t_dense = timed(q1, k1, v1, d1, backward, args.threads, args.repeats, causal="top_left")
        scaled = t_dense * (wn // 1024)
        print(f"| {'fwd+bwd' if backward else 'fwd'} | {t_window * 1e3:.1f} | {scaled * 1e3:.1f} | "
              f"{t_window / scaled:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
