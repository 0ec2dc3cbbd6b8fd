#!/usr/bin/env python3
"""A continuous-batching step modeled on Llama-3-8B attention (32/8 heads, d 128, paged
blocks of 16): 2 prefill chunks (256 new tokens on an empty cache; 512 over a 2048-key
prefix) and 48 decode sequences with 512…8192 cached keys (fixed seed), one layer.

Columns, same process and threads (median of --repeats after a warm-up):
  torch/seq   PyTorch SDPA per sequence after gathering its K/V out of the pool (what an
              engine without a paged kernel does; the gather counted), enable_gqa=True;
  qkv calls   today's qkv: one batched qkv.decode for the 48 decode tokens plus one
              qkv.decode per prefill chunk, each over the pool;
  plan.run    qkv.BatchPlan: the whole step in one call (the plan made once, outside);
  plan make   building the plan (per step; amortized over --layers layers);
  decode roof the decode tokens alone in one plan: K/V bytes / time against the streaming
              bandwidth measured in this run (qkv_decode_probe bandwidth T);
  fixed       plan.run with fixed_key_split=True (decode steps reproduce prefill rows).
Then a model of the step on more cores (idle time per thread at 2, 16 and 64 threads):
the phases plan.run runs (the decode tokens' split-K tasks, then each chunk's tiled
tasks) against one pool of every task of the step.

    python bench/bench_serving.py                  # bf16 and fp32 caches, 1 and 2 threads
    python bench/bench_serving.py --dtypes bfloat16 --threads 2 --repeats 5
"""

from __future__ import annotations

import argparse
import heapq
import os
import statistics
import subprocess
import time

import numpy as np
import torch
import torch.nn.functional as F

import qkv

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.path.join(HERE, "..", "build", "release", "bench")
HEADS, KV_HEADS, D, BLOCK = 32, 8, 128, 16


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bandwidth(threads: int) -> float:
    out = subprocess.run([os.path.join(BUILD, "qkv_decode_probe"), "bandwidth", str(threads)], check=True,
                         capture_output=True, text=True).stdout
    for item in out.split():
        if item.startswith("bandwidth_gbs="):
            return float(item.split("=")[1]) * 1e9
    raise RuntimeError(f"qkv_decode_probe printed no bandwidth: {out!r}")


class Step:
    def __init__(self, dtype, seed=0):
        rng = np.random.default_rng(seed)
        decode_lengths = rng.integers(512, 8193, 48).tolist()
        self.queries = [256, 512] + [1] * 48
        self.lengths = [256, 2048 + 512] + decode_lengths
        per = [-(-n // BLOCK) for n in self.lengths]
        total_blocks = sum(per)
        order = torch.randperm(total_blocks, generator=torch.Generator().manual_seed(seed))
        self.table = torch.full((len(per), max(per)), 0, dtype=torch.int32)
        at = 0
        for b, n in enumerate(per):
            self.table[b, :n] = order[at:at + n].to(torch.int32)
            at += n
        g = torch.Generator().manual_seed(seed + 1)
        self.k = torch.randn(total_blocks, BLOCK, KV_HEADS, D, generator=g).to(dtype)
        self.v = torch.randn(total_blocks, BLOCK, KV_HEADS, D, generator=g).to(dtype)
        self.cu = np.concatenate([[0], np.cumsum(self.queries)]).astype(np.int64)
        self.q = torch.randn(int(self.cu[-1]), HEADS, D, generator=g)
        self.dtype = dtype

    def plan(self, threads, sequences=None, fixed_key_split=False):
        sequences = range(len(self.queries)) if sequences is None else sequences
        queries = [self.queries[b] for b in sequences]
        cu = np.concatenate([[0], np.cumsum(queries)]).astype(np.int64)
        return qkv.BatchPlan(cu, [self.lengths[b] for b in sequences], num_heads=HEADS, num_kv_heads=KV_HEADS,
                             head_dim=D, block_table=self.table[list(sequences)], block_size=BLOCK,
                             threads=threads, dtype=self.dtype, fixed_key_split=fixed_key_split)

    def rows(self, b):
        return slice(int(self.cu[b]), int(self.cu[b + 1]))

    def gathered(self, b):
        """Sequence b's keys and values out of the pool, [1, Hkv, L, d] (a copy)."""
        n = self.lengths[b]
        blocks = self.table[b, : -(-n // BLOCK)].long()
        k = self.k[blocks].reshape(-1, KV_HEADS, D)[:n]
        v = self.v[blocks].reshape(-1, KV_HEADS, D)[:n]
        return k.transpose(0, 1)[None], v.transpose(0, 1)[None]

    def torch_per_sequence(self):
        for b, n in enumerate(self.queries):
            k, v = self.gathered(b)
            q = self.q[self.rows(b)].to(self.dtype).transpose(0, 1)[None]
            mask = None
            if n > 1:  # bottom-right causal over the prefix
                length = self.lengths[b]
                mask = torch.arange(length)[None, :] <= torch.arange(n)[:, None] + (length - n)
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def qkv_calls(self, threads):
        decode_rows = slice(int(self.cu[2]), int(self.cu[-1]))
        qkv.decode(self.q[decode_rows][:, None], self.k, self.v, self.lengths[2:], block_table=self.table[2:],
                   layout="bshd", threads=threads)
        for b in (0, 1):
            qkv.decode(self.q[self.rows(b)][None], self.k, self.v, [self.lengths[b]], block_table=self.table[b:b + 1],
                       layout="bshd", threads=threads)


def makespan(costs, threads):
    """Greedy list scheduling, costliest first, onto `threads` (the plan's dynamic loop)."""
    free = [0.0] * threads
    for c in sorted(costs, reverse=True):
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}; torch {torch.__version__}, {torch.get_num_threads()} threads max")
    print("| cache | threads | torch/seq ms | qkv calls ms | plan.run ms | vs torch | vs qkv calls | plan make ms "
          "(per step / 30 layers) | decode GB/s | of bandwidth | fixed_key_split ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    models = {}
    for name in args.dtypes:
        step = Step(getattr(torch, name))
        decode_only = list(range(2, 50))
        decode_bytes = sum(step.lengths[b] for b in decode_only) * KV_HEADS * 2 * D * step.k.element_size()
        for threads in args.threads:
            torch.set_num_threads(threads)
            plan = step.plan(threads)
            t_torch = median_time(step.torch_per_sequence, args.repeats)
            t_calls = median_time(lambda: step.qkv_calls(threads), args.repeats)
            t_plan = median_time(lambda: plan.run(step.q, step.k, step.v), args.repeats)
            t_make = median_time(lambda: step.plan(threads), args.repeats)
            fixed = step.plan(threads, fixed_key_split=True)
            t_fixed = median_time(lambda: fixed.run(step.q, step.k, step.v), args.repeats)
            decode_plan = step.plan(threads, decode_only)
            q_decode = step.q[int(step.cu[2]):]
            t_decode = median_time(lambda: decode_plan.run(q_decode, step.k, step.v), args.repeats)
            rate = decode_bytes / t_decode
            print(f"| {name} | {threads} | {t_torch * 1e3:.1f} | {t_calls * 1e3:.1f} | {t_plan * 1e3:.1f} | "
                  f"{t_torch / t_plan:.2f}× | {t_calls / t_plan:.2f}× | {t_make * 1e3:.3f} "
                  f"({100 * t_make / (args.layers * t_plan):.3f}% of {args.layers} runs) | {rate / 1e9:.1f} | "
                  f"{100 * rate / bandwidth(threads):.0f}% | {t_fixed * 1e3:.1f} ({t_fixed / t_plan:.2f}×) |")
            if threads == 1:
                models[name] = (plan, t_plan, step)
    print()
    print("Model of the step on more cores (costs: the plan's cost model for the split-K tasks, 2·64·keys·(d+dv)")
    print("per (64-query block, head) tile task of a chunk; scaled so that their sum is the 1-thread plan.run")
    print("time): plan.run runs the decode tasks, then each chunk, each phase waiting for its slowest task (as")
    print("today's separate calls do); one pool would hand every task of the step to the threads at once.")
    print("| cache | threads | phases (plan.run, separate calls): ms | idle | one pool: ms | idle |")
    print("|---|---|---|---|---|---|")
    for name, (plan, t_one, step) in models.items():
        decode_costs = plan.task_costs()
        chunk_costs = []
        for b in (0, 1):
            n, length = step.queries[b], step.lengths[b]
            tasks = []
            for first in range(0, n, 64):
                rows = min(64, n - first)
                keys = length - n + first + rows  # bottom-right causal: the block's last row sees this many
                tasks += [2.0 * rows * keys * 2 * D] * HEADS
            chunk_costs.append(tasks)
        scale = t_one / (sum(decode_costs) + sum(sum(c) for c in chunk_costs))
        busy = t_one
        for threads in (2, 16, 64):
            phases = (makespan(decode_costs, threads) + sum(makespan(c, threads) for c in chunk_costs)) * scale
            pool = makespan(decode_costs + [x for c in chunk_costs for x in c], threads) * scale
            print(f"| {name} | {threads} | {phases * 1e3:.2f} | {100 * (1 - busy / (threads * phases)):.0f}% | "
                  f"{pool * 1e3:.2f} | {100 * (1 - busy / (threads * pool)):.0f}% |")


if __name__ == "__main__":
    main()
