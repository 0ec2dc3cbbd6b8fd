#!/usr/bin/env python3
"""What a KV cache's storage type costs in accuracy: attention of one query per head
against a cache stored as float32, bfloat16, float16 or int8 (qkv.KVCache quantizes per
row), against float64 attention on the original, unrounded keys and values.

Two kinds of K/V: N(0, 1), and keys with a few outlier channels (x20), as real models'
keys have (the case per-token int8 scales handle worst).

    python bench/kv_quantization_error.py [--heads 32/8] [--dim 128] [--keys 4096]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import qkv


def errors(kind: str, hq: int, hkv: int, d: int, n: int) -> dict:
    torch.manual_seed(0)
    k, v = torch.randn(1, hkv, n, d), torch.randn(1, hkv, n, d)
    if kind == "outlier channels":
        k[..., :4] *= 20
    q = torch.randn(1, hq, 1, d)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
    result = {}
    for dtype in ("float32", "bfloat16", "float16", "int8"):
        cache = qkv.KVCache(1, n, hkv, d, dtype=dtype)
        cache.append(k, v)
        diff = cache.attend(q).double() - exact
        result[dtype] = (diff.abs().max().item(), (diff.norm() / exact.norm()).item())
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default="32/8")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--keys", type=int, default=4096)
    args = parser.parse_args()
    hq, hkv = (int(x) for x in args.heads.split("/"))
    print(f"# {hq}/{hkv} heads, d = {args.dim}, {args.keys} keys, one query per head")
    print("| K/V | measure | float32 | bfloat16 | float16 | int8 (per-row scale) |")
    print("|---|---|---|---|---|---|")
    for kind in ("N(0, 1)", "outlier channels"):
        result = errors(kind, hq, hkv, args.dim, args.keys)
        for index, measure in enumerate(("max abs error", "relative (L2)")):
            cells = " | ".join(f"{result[t][index]:.1e}" for t in ("float32", "bfloat16", "float16", "int8"))
            print(f"| {kind} | {measure} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
