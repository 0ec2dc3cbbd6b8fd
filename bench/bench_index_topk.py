"""qkv.index_topk against the PyTorch formula + torch.topk (transformers' DeepseekV32Indexer
math, the -1 padding aside), same process, same threads.

    python bench/bench_index_topk.py [--threads 2] [--repeats 3] [--cases prefill,decode,cache]

cases: "prefill" (Nq = Nk = 4096, causal), "decode" (Nq = 1 against 32k and 128k keys),
"decode-bf16" (the same with bfloat16 q and k, as a bf16 model hands them to its indexer:
qkv's default precision takes vdpbf16ps where that is the CPU's bf16 unit; PyTorch's formula
upcasts them to float32 as transformers does) and "cache" (the same decode step through
qkv.KVCache.index_topk over a bfloat16 cache of index keys, paged in blocks of 64, against
the formula on its stored keys; "cache-bf16" with bfloat16 q, vdpbf16ps as above).

FLOPs: 2·B·Hi·di·(allowed pairs) for the scores (the causal prefill counts only allowed
pairs for qkv; PyTorch's formula computes all Nq·Nk). Peak memory of the PyTorch formula:
its [B, Nq, Hi, Nk] float32 logits and their relu (two such tensors live at once).
"""

from __future__ import annotations

import argparse
import os

import torch

import qkv
from bench_timing import best_of, cpu_model


def torch_indexer(q, k, w, topk, causal_bottom_right):
    """The formula as transformers writes it, then torch.topk over the allowed keys."""
    nq, nk = q.shape[1], k.shape[1]
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * q.shape[-1] ** -0.5
    scores = torch.relu(scores)
    index_scores = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)
    if causal_bottom_right:
        i = torch.arange(nq)[:, None]
        j = torch.arange(nk)[None, :]
        index_scores = index_scores.masked_fill(j > i + nk - nq, float("-inf"))
    return index_scores.topk(min(topk, nk), dim=-1).indices.to(torch.int32)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default="prefill,decode,decode-bf16,cache,cache-bf16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"cpu: {cpu_model()}; threads {args.threads}; load {os.getloadavg()}")
    wanted = set(args.cases.split(","))
    cases = [("prefill causal", "prefill", 1, 4096, 4096, 64, 128, 2048, True),
             ("decode", "decode", 1, 1, 32768, 64, 128, 2048, True),
             ("decode", "decode", 1, 1, 131072, 64, 128, 2048, True),
             ("decode, bf16 q and k", "decode-bf16", 1, 1, 32768, 64, 128, 2048, True),
             ("decode, bf16 q and k", "decode-bf16", 1, 1, 131072, 64, 128, 2048, True),
             ("decode, bf16 paged cache", "cache", 1, 1, 32768, 64, 128, 2048, True),
             ("decode, bf16 paged cache", "cache", 1, 1, 131072, 64, 128, 2048, True),
             ("decode, bf16 paged cache, bf16 q", "cache-bf16", 1, 1, 32768, 64, 128, 2048, True),
             ("decode, bf16 paged cache, bf16 q", "cache-bf16", 1, 1, 131072, 64, 128, 2048, True)]
    for name, kind, batch, nq, nk, heads, di, topk, causal in cases:
        if kind not in wanted:
            continue
        g = torch.Generator().manual_seed(0)
        q = torch.randn(batch, nq, heads, di, generator=g)
        k = torch.randn(batch, nk, di, generator=g)
        w = torch.randn(batch, nq, heads, generator=g) * heads ** -0.5
        if kind == "decode-bf16":
            q, k = q.bfloat16(), k.bfloat16()
        if kind == "cache-bf16":
            q = q.bfloat16()
        if kind in ("cache", "cache-bf16"):  # the keys as the cache stores them (bfloat16), for both sides
            cache = qkv.KVCache(batch, nk, 1, di, v_dim=1, dtype="bfloat16", paged=True, block_size=64)
            cache.append(k[:, None], torch.zeros(batch, 1, nk, 1))
            k = torch.stack([torch.from_numpy(cache.stored(b)[0][0]) for b in range(batch)])
            run_qkv = lambda: cache.index_topk(q, w, topk, threads=args.threads)
        else:
            run_qkv = lambda: qkv.index_topk(q, k, w, topk, causal="bottom_right" if causal else None,
                                             threads=args.threads)
        run_torch = lambda: torch_indexer(q, k, w, topk, causal)
        run_qkv()
        run_torch()
        t_qkv = best_of(args.repeats, run_qkv)
        t_torch = best_of(args.repeats, run_torch)
        pairs = sum(min(nk, i + 1 + nk - nq) for i in range(nq)) if causal else nq * nk
        gflops = 2 * batch * heads * di * pairs / t_qkv / 1e9
        torch_peak = 2 * batch * nq * heads * nk * 4 / 2**20
        print(f"{name}: B={batch} Nq={nq} Nk={nk} Hi={heads} di={di} topk={topk}: "
              f"qkv {t_qkv * 1e3:.1f} ms ({gflops:.0f} GFLOP/s on allowed pairs), "
              f"torch {t_torch * 1e3:.1f} ms, speedup {t_torch / t_qkv:.2f}x; "
              f"torch formula's logits+relu {torch_peak:.0f} MiB")
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
