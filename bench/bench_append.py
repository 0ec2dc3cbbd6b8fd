#!/usr/bin/env python3
"""Rotary + cache append + attention in one qkv.BatchPlan.run against the three calls an
engine makes without it (issue 43 item 1): Llama-3-8B-shaped decode steps (32/8 heads,
d 128, rope_theta 500000), a bfloat16 paged pool (blocks of 16, shuffled), one layer.

    python bench/bench_append.py                       # threads 1 and 2
    python bench/bench_append.py --threads 2 --repeats 11 --chat-repeats 101 --steps chat batch

Steps (fixed seeds): "chat", one sequence with 1024 cached keys (latency-bound: the extra
passes and calls show); "batch", 48 sequences with 512…8192 cached keys. Each sequence
decodes one token, at position = its cached keys; the plan's cache_lengths count it.

The two paths, from the same unrotated float32 q [B, 32, 128], k and v [B, 8, 128] (the
projections' output) and the cos/sin [1, B, 128] transformers' LlamaRotaryEmbedding
returns for the new tokens' positions (made once per step, outside both timings):
  three calls  transformers' apply_rotary_pos_emb on q and k; k and v rounded to bfloat16
               and written into the pool through the block table (torch indexing on the
               pool's flat rows, the row numbers made once per step as vLLM's
               slot_mapping is); plan.run(q_rotated, k_pool, v_pool);
  fused        plan.run(q, k_pool, v_pool, k_new=k, v_new=v, rotary_cos=cos, rotary_sin=sin).
Columns (same process; qkv threads = torch.set_num_threads): the median of each over the
repeats, the two paths interleaved (bench_timing.interleaved_medians); the three calls'
parts timed alone the same way; "binding alone": the fused call's C++ half through qkv's
private binding with its arrays converted once (fused − it: the Python layer's cost);
load = the 1-minute load average before the row; others = the cores the rest of the machine
kept busy during the row (bench_timing.OthersBusy: a 2-thread row needs it near 0).

Correctness (once per row, each path from its own copy of the same pool, whose new-token
rows hold NaN so that a missed write shows): max |difference| of the outputs, and of the
whole pools (every row, so a write into a wrong row shows too). Expected: 0 for both. qkv
rotates in float32 and rounds as PyTorch's float32 `x * cos + rotate_half(x) * sin` does
(qkv/_rotary.py), so the rotated keys are bitwise transformers'; both paths round them to
bfloat16 to nearest even, so the pool rows are bitwise equal; and the attention is the same
plan over the same bits (batch_plan.hpp, "Appending": the result equals writing the rows
by hand and calling run with the rotated q, bitwise).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

import qkv
from bench_timing import OthersBusy, cpu_family_model, cpu_model, interleaved_medians, simd_target

HEADS, KV_HEADS, D, BLOCK = 32, 8, 128, 16
ROPE_THETA = 500000.0  # Llama-3-8B's
POOL_DTYPE = torch.bfloat16


class DecodeStep:
    """One decode token per sequence over a shuffled paged pool; `cached[b]` keys already
    in sequence b's cache, the new token the next row."""

    def __init__(self, cached, seed):
        g = torch.Generator().manual_seed(seed)
        self.lengths = [n + 1 for n in cached]
        blocks = [-(-n // BLOCK) for n in self.lengths]
        order = torch.randperm(sum(blocks), generator=g).to(torch.int32)
        self.table = torch.zeros(len(blocks), max(blocks), dtype=torch.int32)
        at = 0
        for b, n in enumerate(blocks):
            self.table[b, :n] = order[at:at + n]
            at += n
        positions = torch.tensor(cached, dtype=torch.int64)
        # The pool's flat row (block · BLOCK + offset) of each new token.
        self.slots = self.table[torch.arange(len(cached)), positions // BLOCK].long() * BLOCK + positions % BLOCK
        self.k_pool = torch.randn(sum(blocks), BLOCK, KV_HEADS, D, generator=g).to(POOL_DTYPE)
        self.v_pool = torch.randn(sum(blocks), BLOCK, KV_HEADS, D, generator=g).to(POOL_DTYPE)
        for pool in (self.k_pool, self.v_pool):
            pool.view(-1, KV_HEADS, D)[self.slots] = float("nan")  # a row neither path wrote shows
        self.q = torch.randn(len(cached), HEADS, D, generator=g)
        self.k = torch.randn(len(cached), KV_HEADS, D, generator=g)
        self.v = torch.randn(len(cached), KV_HEADS, D, generator=g)
        config = LlamaConfig(hidden_size=HEADS * D, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                             head_dim=D, max_position_embeddings=8192, rope_theta=ROPE_THETA)
        # [1, B, 128] each, float32 (the dtype of the q handed in), as a model's forward gets them.
        self.cos, self.sin = LlamaRotaryEmbedding(config)(self.q, positions[None])

    def plan(self, threads):
        cu = np.arange(len(self.lengths) + 1, dtype=np.int64)
        return qkv.BatchPlan(cu, self.lengths, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D,
                             block_table=self.table, block_size=BLOCK, threads=threads, dtype=POOL_DTYPE)

    def pools(self):
        return self.k_pool.clone(), self.v_pool.clone()

    # The three calls, and each alone (for the parts' columns).
    def rotate(self):
        # cos/sin [1, B, d] -> [B, 1, d]: broadcast over the heads of q [B, H, d].
        return apply_rotary_pos_emb(self.q, self.k, self.cos[0], self.sin[0], unsqueeze_dim=1)

    def write(self, k_rotated, k_pool, v_pool):
        k_pool.view(-1, KV_HEADS, D)[self.slots] = k_rotated.to(POOL_DTYPE)
        v_pool.view(-1, KV_HEADS, D)[self.slots] = self.v.to(POOL_DTYPE)

    def three_calls(self, plan, k_pool, v_pool):
        q_rotated, k_rotated = self.rotate()
        self.write(k_rotated, k_pool, v_pool)
        return plan.run(q_rotated, k_pool, v_pool)

    def fused(self, plan, k_pool, v_pool):
        return plan.run(self.q, k_pool, v_pool, k_new=self.k, v_new=self.v, rotary_cos=self.cos,
                        rotary_sin=self.sin)


def binding_call(step, plan, k_pool, v_pool):
    """The fused call's C++ half alone: qkv's private binding with the arrays converted once
    (what qkv/_rotary.py's eager_run hands it), so that fused − this is the Python layer's
    cost per call. A diagnostic on private names: None if they have changed."""
    try:
        from qkv import _qkv
        from qkv._decode_eager import _cache_array

        native = plan._plans["bfloat16"]
        k_lib, bits_as = _cache_array(k_pool, "k_cache", "bench")
        v_lib, _ = _cache_array(v_pool, "v_cache", "bench")
        q, k, v, cos, sin = (x.numpy() for x in (step.q, step.k, step.v, step.cos[0], step.sin[0]))
        out = np.empty((q.shape[0], HEADS, D), dtype=np.float32)

        def call():
            _qkv.batch_plan_run_appending(native, q, k_lib, v_lib, out, k, v, lse=None, bits_as=bits_as, k_scale=None,
                                          v_scale=None, indices=None, rotary_cos=cos, rotary_sin=sin, positions=None,
                                          rotary_interleaved=False, rotary_dim=None)

        call()
        return call
    except (AttributeError, KeyError, TypeError, ImportError):
        return None


def max_diff(a, b):
    """max |a − b| over float tensors of any dtype (NaN when either holds one: a missed write)."""
    return float((a.float() - b.float()).abs().max())


def differing(a, b):
    """How many elements differ bit for bit (NaN payloads compared as bits)."""
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[a.dtype]
    return int((a.view(bits) != b.view(bits)).sum())


def check(step, plan):
    """Both paths once, each from its own copy of the pool: (out max diff, out differing,
    pool max diff, pool differing, whether the fused call left q as it was)."""
    q_before = step.q.clone()
    k_three, v_three = step.pools()
    k_fused, v_fused = step.pools()
    out_three = step.three_calls(plan, k_three, v_three)
    out_fused = step.fused(plan, k_fused, v_fused)
    pool_diff = max(max_diff(k_three, k_fused), max_diff(v_three, v_fused))
    pool_bits = differing(k_three, k_fused) + differing(v_three, v_fused)
    return (max_diff(out_three, out_fused), differing(out_three, out_fused), pool_diff, pool_bits,
            differing(step.q, q_before) == 0)


def timings(step, plan, repeats):
    """Medians (s) of the three calls, the fused call, the three calls' parts alone, and the
    fused call's binding alone (None where its private names have changed)."""
    # One pool for every timed call: two copies of the same pool can read at speeds 10–15%
    # apart (one sequence of 8k keys, plan.run alone; where the pages landed), and both
    # paths write the same bits into the same rows (check() says so), so sharing it
    # changes no input.
    k_pool, v_pool = step.pools()
    q_rotated, k_rotated = step.rotate()
    step.write(k_rotated, k_pool, v_pool)  # the rows plan.run alone reads
    binding = binding_call(step, plan, k_pool, v_pool)
    times = interleaved_medians([
        lambda: step.three_calls(plan, k_pool, v_pool),
        lambda: step.fused(plan, k_pool, v_pool),
        step.rotate,
        lambda: step.write(k_rotated, k_pool, v_pool),
        lambda: plan.run(q_rotated, k_pool, v_pool),
        binding or (lambda: None)], repeats)
    return times[:-1] + [times[-1] if binding else None]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=31, help="rounds for the 48-sequence step")
    parser.add_argument("--chat-repeats", type=int, default=201, help="rounds for the one-sequence step")
    parser.add_argument("--steps", nargs="+", default=["chat", "batch"], choices=["chat", "batch"])
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {cpu_model()} ({cpu_family_model()}), "
          f"{os.cpu_count()} cpus; qkv SIMD target {simd_target()}; torch {torch.__version__}")
    print("| step | threads | load | others | three calls ms | fused ms | three / fused | rotary ms | write ms | "
          "plan.run ms | fused − plan.run ms | fused, binding alone ms | out max diff (bits differing) | "
          "pool max diff (bits differing) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    steps = {"chat": ([1024], args.chat_repeats, "chat (1 seq, 1024 cached)"),
             "batch": (rng.integers(512, 8193, 48).tolist(), args.repeats, "batch (48 seq, 512–8192 cached)")}
    for name in args.steps:
        cached, repeats, label = steps[name]
        step = DecodeStep(cached, seed=1)
        for threads in args.threads:
            torch.set_num_threads(threads)
            plan = step.plan(threads)
            load = os.getloadavg()[0]
            with OthersBusy() as others:
                out_diff, out_bits, pool_diff, pool_bits, q_kept = check(step, plan)
                t_three, t_fused, t_rotate, t_write, t_run, t_binding = timings(step, plan, repeats)
            if not q_kept:  # the contract: q is rotated into scratch, never in place
                print(f"!! {name}, {threads} threads: the fused call modified q")
            binding = "n/a" if t_binding is None else f"{t_binding * 1e3:.3f}"
            print(f"| {label} | {threads} | {load:.2f} | {others.cores:.2f} | "
                  f"{t_three * 1e3:.3f} | {t_fused * 1e3:.3f} | {t_three / t_fused:.2f}× | {t_rotate * 1e3:.3f} | "
                  f"{t_write * 1e3:.3f} | {t_run * 1e3:.3f} | {(t_fused - t_run) * 1e3:+.3f} | {binding} | "
                  f"{out_diff:.3g} ({out_bits}) | {pool_diff:.3g} ({pool_bits}) |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
