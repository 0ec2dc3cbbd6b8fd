"""Continuous batching over one paged KV cache with qkv.BatchPlan — a few serving steps.

Requests arrive with prompts of different lengths; each step prefills the waiting prompts
in chunks of at most CHUNK tokens and decodes one token for every running sequence, all in
ONE attention call per layer (qkv.BatchPlan: planned once per step, run per layer). Finished
sequences leave and their blocks go back to the pool. Every step is checked against plain
per-sequence attention (PyTorch SDPA in float64 over the keys gathered from the pool).

    python examples/serve_step.py [--steps 12] [--layers 4]

The model is random (one projection-free "layer" draws its own q/k/v per token): the point
is the cache and batch bookkeeping an engine does around qkv, not text.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import qkv

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 64, 16
CHUNK = 48  # the most prompt tokens of one sequence prefilled per step


def attend_alone(q, keys, values):
    """Reference for one sequence: q [n, Hq, d] (its newest tokens) against its keys."""
    g = HEADS // KV_HEADS
    k = keys.double().transpose(0, 1).repeat_interleave(g, 0)
    v = values.double().transpose(0, 1).repeat_interleave(g, 0)
    n, length = q.shape[0], keys.shape[0]
    allowed = torch.arange(length)[None, :] <= torch.arange(n)[:, None] + (length - n)
    out = torch.nn.functional.scaled_dot_product_attention(q.double().transpose(0, 1), k, v, attn_mask=allowed)
    return out.transpose(0, 1)


def main(steps: int, layers: int, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    slots = 6
    caches = [qkv.KVCache(slots, 1024, KV_HEADS, HEAD_DIM, dtype="bfloat16", paged=True, block_size=BLOCK,
                          num_blocks=slots * 24, layout="bshd") for _ in range(layers)]
    history = [[{"k": [], "v": []} for _ in range(slots)] for _ in range(layers)]  # float keys, for the check
    waiting = {s: int(rng.integers(5, 140)) for s in range(slots)}  # slot -> prompt tokens left
    decoding = {}  # slot -> tokens still to generate
    worst = 0.0
    for step in range(steps):
        # This step's new tokens per slot: a prefill chunk, or one decode token.
        new = np.zeros(slots, dtype=np.int64)
        for s in list(waiting):
            new[s] = min(CHUNK, waiting[s])
        for s in decoding:
            new[s] = 1
        cu = np.concatenate([[0], np.cumsum(new)])
        total = int(cu[-1])
        lengths_after = [caches[0].lengths[s] + int(new[s]) for s in range(slots)]
        plan = None
        for layer in range(layers):
            cache = caches[layer]
            q = torch.randn(total, HEADS, HEAD_DIM)
            k, v = torch.randn(total, KV_HEADS, HEAD_DIM), torch.randn(total, KV_HEADS, HEAD_DIM)
            cache.append_varlen(k, v, cu)
            if plan is None:  # once per step: every layer's cache has the same lengths and blocks
                plan = qkv.BatchPlan(cu, cache.lengths, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                     block_table=torch.from_numpy(cache.block_table().copy()), block_size=BLOCK,
                                     dtype="bfloat16")
            keys, values = cache.torch_storage()
            out = plan.run(q, keys, values)
            for s in range(slots):
                rows = slice(int(cu[s]), int(cu[s + 1]))
                history[layer][s]["k"].append(k[rows].to(torch.bfloat16))
                history[layer][s]["v"].append(v[rows].to(torch.bfloat16))
                if new[s] == 0:
                    continue
                exact = attend_alone(q[rows], torch.cat(history[layer][s]["k"]), torch.cat(history[layer][s]["v"]))
                worst = max(worst, (out[rows].double() - exact).abs().max().item())
        assert plan.total_queries == total and cache.lengths == lengths_after
        # Bookkeeping: decodes count down (finished sequences leave, a new request takes
        # the slot), then the prompts prefilled this step advance.
        prefilled = list(waiting)
        for s in list(decoding):
            decoding[s] -= 1
            if decoding[s] == 0:
                del decoding[s]
                for layer in range(layers):
                    caches[layer].reset(s)
                    history[layer][s] = {"k": [], "v": []}
                waiting[s] = int(rng.integers(5, 140))
        for s in prefilled:
            waiting[s] -= int(new[s])
            if waiting[s] == 0:
                del waiting[s]
                decoding[s] = int(rng.integers(2, 6))
        print(f"step {step:2d}: {int(sum(new > 1))} prefill chunks, {int(sum(new == 1))} decode tokens, "
              f"{total} queries, free blocks {caches[0].free_blocks}, max |qkv - reference| so far {worst:.1e}")
    return worst


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    error = main(args.steps, args.layers)
    # float32 arithmetic over values of size ~1 (the references are exact over the same
    # bf16 keys): anything past 1e-5 is a bug, not rounding.
    if error > 1e-5:
        raise SystemExit(f"qkv differs from per-sequence attention by {error:.1e}")
    print(f"every step matched per-sequence attention (max abs error {error:.1e})")
