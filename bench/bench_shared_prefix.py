#!/usr/bin/env python3
"""Shared prefixes (issue 43 item 4): a decode step of sequences that share one cached
prefix — parallel sampling or a common system prompt — with qkv.BatchPlan planned plain
and with shared_prefixes=True, same process, same threads.

Workload (default): Llama-3-8B attention (32/8 heads, d 128), a bfloat16 paged pool
(blocks of 16), 32 sequences sharing a 16384-key prefix, each with 256–1024 keys of its own
(fixed seed), one new token each; one layer.

Columns: plan.run time plain and shared (median of --repeats after a warm-up) and their
ratio (interleaved rounds: bench_timing); K/V bytes each reads (plain: every sequence's keys; shared: the prefix once per
16-query tile of the group's pass, ⌈32/16⌉ = 2 times, plus each sequence's own keys); the
arithmetic (the same for both: every row still meets every key) as GFLOP/s and share of
the FMA peak (qkv_fma_peak, this run) — the limit once the traffic is gone — and the
roofline limit max(bytes / streaming bandwidth, flops / FMA peak) for each; max |shared −
plain| of out and lse (the contract: within float32 rounding).

    python bench/bench_shared_prefix.py                     # threads 1 and 2
    python bench/bench_shared_prefix.py --threads 1 --sequences 32 --prefix 16384 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_timing import cpu_family_model, cpu_model, interleaved_medians  # noqa: E402

import qkv  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.path.join(HERE, "..", "build", "release", "bench")
HEADS, KV_HEADS, D, BLOCK = 32, 8, 128, 16


def probe_fields(*command) -> dict:
    out = subprocess.run([os.path.join(BUILD, command[0]), *command[1:]], check=True, capture_output=True,
                         text=True).stdout
    return [dict(item.split("=") for item in line.split()) for line in out.splitlines() if "=" in line]


def step(sequences: int, prefix: int, seed: int):
    """The pool, block table and lengths: the prefix's blocks first in every table, then each
    sequence's own blocks (shuffled pool order)."""
    rng = np.random.default_rng(seed)
    own = rng.integers(256, 1025, sequences)
    prefix_blocks = prefix // BLOCK
    own_blocks = [-(-int(n) // BLOCK) for n in own]
    pool = prefix_blocks + sum(own_blocks)
    ids = rng.permutation(pool).astype(np.int32)
    table = np.zeros((sequences, prefix_blocks + max(own_blocks)), np.int32)
    start = prefix_blocks
    for b, blocks in enumerate(own_blocks):
        table[b, :prefix_blocks] = ids[:prefix_blocks]
        table[b, prefix_blocks:prefix_blocks + blocks] = ids[start:start + blocks]
        start += blocks
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(pool, BLOCK, KV_HEADS, D, generator=g).bfloat16()
    v = torch.randn(pool, BLOCK, KV_HEADS, D, generator=g).bfloat16()
    q = torch.randn(sequences, HEADS, D, generator=g)
    lengths = (prefix + own).astype(np.int32)
    return q, k, v, table, lengths, own


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=16384, help="shared keys (a multiple of 16)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    q, k, v, table, lengths, own = step(args.sequences, args.prefix, args.seed)
    cu = np.arange(args.sequences + 1, dtype=np.int32)
    row_bytes = KV_HEADS * 2 * D * 2  # K and V, bf16
    plain_bytes = float(lengths.sum()) * row_bytes
    tiles = -(-args.sequences // 16)  # the group's pass: one read of the prefix per 16-query tile
    shared_bytes = (args.prefix * tiles + float(own.sum())) * row_bytes
    flops = 4.0 * float(lengths.sum()) * HEADS * D  # QK and PV, 2 flops per multiply-add
    fma = {int(f["threads"]): float(f["gflops"]) for f in probe_fields("qkv_fma_peak", str(max(args.threads)))}
    target = probe_fields("qkv_fma_peak", "1")[0].get("target", "?")
    bandwidth = {t: float(probe_fields("qkv_decode_probe", "bandwidth", str(t))[0]["bandwidth_gbs"]) for t in args.threads}
    print(f"# {cpu_model()} ({cpu_family_model()}), qkv SIMD target {os.environ.get('QKV_SIMD_TARGET', target)}, torch {torch.__version__}")
    print(f"# load average at start (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"# {args.sequences} sequences, {args.prefix}-key shared prefix, own keys {own.min()}–{own.max()} "
          f"(mean {own.mean():.0f}); 32/8 heads, d 128, bf16 pool, blocks of 16")
    for t in args.threads:
        print(f"# threads={t}: streaming read {bandwidth[t]:.1f} GB/s, FMA peak {fma[t]:.0f} GFLOP/s")
    print("| threads | plain ms | shared ms | shared vs plain | plain MB read | shared MB read | "
          "plain GFLOP/s (of FMA peak) | shared GFLOP/s (of FMA peak) | limit plain ms | limit shared ms | "
          "max Δ out | max Δ lse |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for t in args.threads:
        kw = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D, block_table=table, block_size=BLOCK,
                  dtype=torch.bfloat16, threads=t)
        plain = qkv.BatchPlan(cu, lengths, **kw)
        shared = qkv.BatchPlan(cu, lengths, shared_prefixes=True, **kw)
        assert [len(m) for m, _ in shared.prefix_groups] == [args.sequences], shared.prefix_groups
        torch.set_num_threads(t)
        out_plain, lse_plain = plain.run(q, k, v, return_lse=True)
        out_shared, lse_shared = shared.run(q, k, v, return_lse=True)
        t_plain, t_shared = interleaved_medians([lambda: plain.run(q, k, v), lambda: shared.run(q, k, v)],
                                                args.repeats)
        limit = [max(b / (bandwidth[t] * 1e9), flops / (fma[t] * 1e9)) for b in (plain_bytes, shared_bytes)]
        gflops = [flops / s / 1e9 for s in (t_plain, t_shared)]
        print(f"| {t} | {t_plain * 1e3:.1f} | {t_shared * 1e3:.1f} | {t_plain / t_shared:.2f}× | "
              f"{plain_bytes / 1e6:.0f} | {shared_bytes / 1e6:.0f} | "
              f"{gflops[0]:.0f} ({gflops[0] / fma[t]:.0%}) | {gflops[1]:.0f} ({gflops[1] / fma[t]:.0%}) | "
              f"{limit[0] * 1e3:.1f} | {limit[1] * 1e3:.1f} | "
              f"{(out_shared - out_plain).abs().max().item():.1e} | {(lse_shared - lse_plain).abs().max().item():.1e} |")
    print(f"# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
