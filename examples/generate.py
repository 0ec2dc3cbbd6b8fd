#!/usr/bin/env python3
"""Greedy generation with a small causal language model whose attention reads qkv's
KV cache — the decode loop an LLM runs, in ~100 lines of plain PyTorch.

The model is randomly initialised (no download): token embedding, N pre-norm blocks of
grouped-query attention (rotary-free, learned positions) and an MLP, tied output head.
Each step appends the new token's keys and values to a qkv.KVCache (bfloat16 by
default) and attends one query per head against everything cached. The same tokens
are generated again without any cache, by full causal SDPA over the whole sequence in
float32 on the cache-rounded keys/values, and the two must agree.

    python examples/generate.py --tokens 32 --cache-dtype bfloat16 --paged
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import qkv


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.q = torch.nn.Linear(dim, dim, bias=False)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def qkv_heads(self, x):
        b, t, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, t, 2, self.kv_heads, self.head_dim).unbind(2)
        return q, k.transpose(1, 2), v.transpose(1, 2)

    def finish(self, x, attended):
        b, _, t, _ = attended.shape
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.norm2(x))

    def forward_cached(self, x, cache: qkv.KVCache):
        q, k, v = self.qkv_heads(x)
        cache.append(k, v)
        return self.finish(x, cache.attend(q))

    def forward_full(self, x, round_to):
        q, k, v = self.qkv_heads(x)
        # The cache stores k and v rounded once; attend to the same values.
        k, v = k.to(round_to).float(), v.to(round_to).float()
        return self.finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=256, dim=128, layers=2, heads=8, kv_heads=2, context=512):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.position = torch.nn.Embedding(context, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)  # untied: a tied head repeats the last token

    def logits(self, x):
        return self.head(self.norm(x))

    def step(self, tokens, start: int, caches):
        """Logits of the last position after feeding `tokens` [B, T] at positions start.."""
        x = self.embed(tokens) + self.position(torch.arange(start, start + tokens.shape[1]))
        for block, cache in zip(self.blocks, caches):
            x = block.forward_cached(x, cache)
        return self.logits(x[:, -1])

    def full(self, tokens, round_to):
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block.forward_full(x, round_to)
        return self.logits(x[:, -1])


@torch.no_grad()
def generate(model: TinyLM, prompt, new_tokens: int, cache_dtype: str, paged: bool, block_size: int):
    batch = prompt.shape[0]
    head = model.blocks[0]
    capacity = prompt.shape[1] + new_tokens
    caches = [qkv.KVCache(batch, capacity, head.kv_heads, head.head_dim, dtype=cache_dtype, paged=paged,
                          block_size=block_size) for _ in model.blocks]
    tokens, steps = prompt, []
    logits = model.step(prompt, 0, caches)  # prefill: the whole prompt at once
    for _ in range(new_tokens):
        steps.append(logits)
        nxt = logits.argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
        logits = model.step(nxt, tokens.shape[1] - 1, caches)
    return tokens, steps


@torch.no_grad()
def generate_without_cache(model: TinyLM, prompt, new_tokens: int, round_to):
    tokens, steps = prompt, []
    for _ in range(new_tokens):
        steps.append(model.full(tokens, round_to))
        tokens = torch.cat([tokens, steps[-1].argmax(-1, keepdim=True)], dim=1)
    return tokens, steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=24, help="new tokens per sequence")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=12, help="prompt length")
    parser.add_argument("--cache-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--paged", action="store_true", help="a paged cache (vLLM layout)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    model = TinyLM().eval()
    prompt = torch.randint(0, 256, (args.batch, args.prompt))
    start = time.perf_counter()
    tokens, logits = generate(model, prompt, args.tokens, args.cache_dtype, args.paged, args.block_size)
    seconds = time.perf_counter() - start
    round_to = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.cache_dtype]
    expected, expected_logits = generate_without_cache(model, prompt, args.tokens, round_to)
    same = torch.equal(tokens, expected)
    # float32 logits of O(1): both paths round differently only in the last bits.
    worst = max((a - b).abs().max().item() for a, b in zip(logits, expected_logits))
    print(f"generated {args.batch}×{args.tokens} tokens in {seconds * 1e3:.1f} ms "
          f"({args.cache_dtype} {'paged' if args.paged else 'contiguous'} cache)")
    for row in tokens.tolist():
        print(" ".join(str(t) for t in row[args.prompt:]))
    print("same tokens as full causal SDPA without a cache:", "yes" if same else "NO",
          f"(largest logit difference {worst:.2e})")
    return 0 if same and worst < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
