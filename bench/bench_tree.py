#!/usr/bin/env python3
"""Speculative-decoding trees (issue 43 item 3): random draft trees verified in one
qkv.BatchPlan step over paged caches, against an fp64 dense-mask reference and PyTorch
SDPA with the same dense mask. Llama-3-8B-shaped (32/8 heads, d 128), a bfloat16 paged
pool (blocks of 16, shuffled), one layer.

    python bench/bench_tree.py                        # steps of 1 and 16 sequences, threads 1 and 2
    python bench/bench_tree.py --batch 16 --threads 2 --repeats 5

Trees (fixed seeds; our own generator, breadth-first as EAGLE-style drafts are laid out):
the root is the last accepted token, 2–6 levels, at most 64 nodes, each node's parent drawn
among the level above. Sequence b's tree tokens are its last n_b keys, after a cached prefix
of 1024–8192 keys. Each token sees the whole prefix and, among the tree tokens, itself and
its ancestors (the tree_mask rows); nothing else.

Errors (max |x − fp64|, over every sequence, row and head; the reference is the attention
with that dense [n_b, L_b] mask in torch float64 over the same stored values — the pool's
bfloat16 widened exactly — and the same float32 q):
  qkv          plan.run (float32 q, bfloat16 pool read in place);
  SDPA fp32    torch's scaled_dot_product_attention in float32 on the same inputs (the
               yardstick: DESIGN.md's "no larger than PyTorch SDPA's error in fp32");
  SDPA bf16    the same in bfloat16, q rounded to bfloat16 too, against the fp64 attention
               of its own (rounded) inputs: the contract's 16-bit rule (within 2× of it).
Times (median of --repeats rounds after a warm-up, same process, qkv threads =
torch.set_num_threads, the columns interleaved per round; load = the 1-minute load average
before the row; others = the cores the rest of the machine kept busy during the timings,
bench_timing.OthersBusy: a 2-thread row needs it near 0):
  qkv          plan.run over the pool (the plan, masks copied in, made once per step and run
               per layer: its making is the next column, once);
  GFLOP/s      qkv's, counting 4 · Hq · n_b · L_b · d per sequence (DESIGN.md's forward formula);
  causal       plan.run of the same step without trees (bottom-right causal): what the mask costs;
  SDPA bf16 / fp32  per sequence: its K/V gathered out of the pool (counted, as
               bench_serving.py's torch/seq), then SDPA with its dense boolean mask
               (built once per step, outside) and enable_gqa; fp32 widens the gathered K/V.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

import qkv
from bench_timing import OthersBusy, cpu_family_model, cpu_model, interleaved_medians, simd_target

HEADS, KV_HEADS, D, BLOCK = 32, 8, 128, 16
POOL_DTYPE = torch.bfloat16
MAX_NODES, MAX_LEVELS = 64, 6


def draft_tree(rng):
    """Parent pointers (−1 for the root) of a random tree in breadth-first order: 2–6 levels,
    ≤ 64 nodes, level widths a random split of the nodes below the root."""
    levels = int(rng.integers(2, MAX_LEVELS + 1))
    nodes = int(rng.integers(levels, MAX_NODES + 1))
    cuts = np.sort(rng.choice(np.arange(2, nodes), size=levels - 2, replace=False)) if levels > 2 else []
    bounds = [0, 1, *map(int, cuts), nodes]  # level l holds nodes bounds[l] .. bounds[l+1] − 1
    parent = [-1]
    for level in range(1, levels):
        above = range(bounds[level - 1], bounds[level])
        parent += [int(rng.choice(above)) for _ in range(bounds[level], bounds[level + 1])]
    return parent


def ancestor_mask(parent):
    """[n, n] bool: row i true at i and its ancestors. Breadth-first order puts a parent
    before its children, so a row is its parent's row plus the diagonal."""
    n = len(parent)
    mask = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(parent):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


class TreeStep:
    """`batch` sequences, each a cached prefix of 1024–8192 keys and a draft tree's tokens."""

    def __init__(self, batch, seed):
        rng = np.random.default_rng(seed)
        g = torch.Generator().manual_seed(seed)
        self.masks = [ancestor_mask(draft_tree(rng)) for _ in range(batch)]
        self.queries = [len(m) for m in self.masks]
        self.lengths = [int(rng.integers(1024, 8193)) + n for n in self.queries]
        self.cu = np.concatenate([[0], np.cumsum(self.queries)]).astype(np.int64)
        self.offsets = np.cumsum([0] + [n * n for n in self.queries[:-1]]).astype(np.int64)  # masks back to back
        self.tree_mask = np.concatenate([m.ravel() for m in self.masks])
        blocks = [-(-n // BLOCK) for n in self.lengths]
        order = torch.randperm(sum(blocks), generator=g).to(torch.int32)
        self.table = torch.zeros(batch, max(blocks), dtype=torch.int32)
        at = 0
        for b, n in enumerate(blocks):
            self.table[b, :n] = order[at:at + n]
            at += n
        self.k = torch.randn(sum(blocks), BLOCK, KV_HEADS, D, generator=g).to(POOL_DTYPE)
        self.v = torch.randn(sum(blocks), BLOCK, KV_HEADS, D, generator=g).to(POOL_DTYPE)
        self.q = torch.randn(int(self.cu[-1]), HEADS, D, generator=g)
        # Each sequence's dense mask [n, L]: the prefix all visible, then its tree.
        self.dense = []
        for mask, length in zip(self.masks, self.lengths):
            seen = torch.ones(len(mask), length, dtype=torch.bool)
            seen[:, length - len(mask):] = torch.from_numpy(mask)
            self.dense.append(seen)

    def plan(self, threads, trees=True):
        extra = dict(tree_mask=self.tree_mask, tree_mask_offsets=self.offsets) if trees else {}
        return qkv.BatchPlan(self.cu, self.lengths, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D,
                             block_table=self.table, block_size=BLOCK, threads=threads, dtype=POOL_DTYPE, **extra)

    def rows(self, b):
        return slice(int(self.cu[b]), int(self.cu[b + 1]))

    def gathered(self, b, dtype):
        """Sequence b's keys and values out of the pool as [1, Hkv, L, d] in `dtype` (a copy)."""
        length = self.lengths[b]
        blocks = self.table[b, : -(-length // BLOCK)].long()
        k = self.k[blocks].reshape(-1, KV_HEADS, D)[:length]
        v = self.v[blocks].reshape(-1, KV_HEADS, D)[:length]
        return k.transpose(0, 1)[None].to(dtype), v.transpose(0, 1)[None].to(dtype)

    def sdpa(self, b, dtype):
        """SDPA of sequence b in `dtype` with its dense mask: [n, Hq, d] in `dtype`."""
        k, v = self.gathered(b, dtype)
        q = self.q[self.rows(b)].to(dtype).transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.dense[b], enable_gqa=True)
        return out[0].transpose(0, 1)

    def torch_per_sequence(self, dtype):
        for b in range(len(self.queries)):
            self.sdpa(b, dtype)

    def exact(self, b, q):
        """fp64 attention of q [n, Hq, d] (any float dtype, widened) over sequence b's stored
        K/V with its dense mask, written out: scores, −inf where hidden, softmax, ·V."""
        k, v = (x[0].double() for x in self.gathered(b, torch.float64))  # [Hkv, L, d]
        group = HEADS // KV_HEADS  # query head h reads kv head h // group
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = q.double().transpose(0, 1) @ k.transpose(1, 2) / D ** 0.5  # [Hq, n, L]
        scores = scores.masked_fill(~self.dense[b][None], float("-inf"))
        return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)  # [n, Hq, d]


def errors(step, out):
    """(qkv, SDPA fp32, SDPA bf16) max |x − fp64| over the step, as the docstring says."""
    ours = theirs32 = theirs16 = 0.0
    for b in range(len(step.queries)):
        q = step.q[step.rows(b)]
        exact = step.exact(b, q)
        ours = max(ours, float((out[step.rows(b)].double() - exact).abs().max()))
        theirs32 = max(theirs32, float((step.sdpa(b, torch.float32).double() - exact).abs().max()))
        exact16 = step.exact(b, q.to(torch.bfloat16))
        theirs16 = max(theirs16, float((step.sdpa(b, torch.bfloat16).double() - exact16).abs().max()))
    return ours, theirs32, theirs16


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 16], help="sequences per step")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {cpu_model()} ({cpu_family_model()}), "
          f"{os.cpu_count()} cpus; qkv SIMD target {simd_target()}; torch {torch.__version__}")
    print("| seqs (tree tokens; prefix keys) | threads | load | others | qkv err | SDPA fp32 err | qkv / SDPA fp32 | "
          "SDPA bf16 err | qkv ms | qkv GFLOP/s | causal ms | SDPA bf16 ms | SDPA fp32 ms | vs bf16 | vs fp32 | "
          "plan make ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for batch in args.batch:
        step = TreeStep(batch, seed=batch)
        prefixes = [length - n for length, n in zip(step.lengths, step.queries)]
        shape = (f"{batch} ({min(step.queries)}–{max(step.queries)}, {sum(step.queries)} in all; "
                 f"{min(prefixes)}–{max(prefixes)})") if batch > 1 else f"1 ({step.queries[0]}; {prefixes[0]})"
        # Every row against every key of its sequence, as a dense call (the hidden tree keys,
        # < 1% of a row's keys, counted too): 4 · Hq · n_b · L_b · d per sequence.
        flops = sum(4 * HEADS * n * length * D for n, length in zip(step.queries, step.lengths))
        first_out = None
        for threads in args.threads:
            torch.set_num_threads(threads)
            load = os.getloadavg()[0]
            plan, causal = step.plan(threads), step.plan(threads, trees=False)
            out = plan.run(step.q, step.k, step.v)
            # Determinism: qkv's bits do not depend on the thread count.
            same = "" if first_out is None or torch.equal(out, first_out) else " (bits differ across threads!)"
            first_out = out if first_out is None else first_out
            ours, theirs32, theirs16 = errors(step, out)
            with OthersBusy() as others:
                t_qkv, t_causal, t_bf16, t_fp32 = interleaved_medians([
                    lambda: plan.run(step.q, step.k, step.v),
                    lambda: causal.run(step.q, step.k, step.v),
                    lambda: step.torch_per_sequence(torch.bfloat16),
                    lambda: step.torch_per_sequence(torch.float32)], args.repeats)
                (t_make,) = interleaved_medians([lambda: step.plan(threads)], args.repeats)
            print(f"| {shape} | {threads} | {load:.2f} | {others.cores:.2f} | {ours:.2e}{same} | {theirs32:.2e} | "
                  f"{ours / theirs32:.2f} | {theirs16:.2e} | {t_qkv * 1e3:.2f} | {flops / t_qkv / 1e9:.1f} | "
                  f"{t_causal * 1e3:.2f} | {t_bf16 * 1e3:.2f} | {t_fp32 * 1e3:.2f} | {t_bf16 / t_qkv:.2f}× | "
                  f"{t_fp32 / t_qkv:.2f}× | {t_make * 1e3:.3f} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
