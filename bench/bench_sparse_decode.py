"""DeepSeek sparse attention's decode step on a cache: qkv.decode with top-k key lists
(indices=) against qkv's dense decode over the whole cache and against PyTorch SDPA with
the boolean top-k mask (what transformers' sdpa path does), same process, same threads.

    python bench/bench_sparse_decode.py [--cached 32768] [--topk 2048] [--threads 2]

Shapes: GQA 32/8, d 128, bfloat16 cache [1, cached, Hkv, d] ("bshd": a key's heads
contiguous, vLLM's layout), one query per sequence (batch 1). A sparse step is bound by
the latency of its 2·topk random row reads, so the layout matters: "bhsd" puts each
(key, head) row on its own page and measured ~2x slower (see docs/sparse.md)."""

import argparse

import numpy as np
import torch

import qkv
from bench_timing import best_of


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cached", type=int, default=32768)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    hq, hkv, d, n = 32, 8, 128, a.cached
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, n, hkv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(1, n, hkv, d, generator=g).to(torch.bfloat16)
    q = torch.randn(1, 1, hq, d, generator=g)
    lengths = torch.tensor([n])
    idx = torch.randperm(n, generator=g)[: a.topk].view(1, 1, a.topk)
    sparse = best_of(a.reps, lambda: qkv.decode(q, k, v, lengths, indices=idx, threads=a.threads, layout="bshd"))
    dense = best_of(a.reps, lambda: qkv.decode(q, k, v, lengths, threads=a.threads, layout="bshd"))
    mask = torch.zeros(1, 1, 1, n, dtype=torch.bool)
    mask[0, 0, 0, idx[0, 0]] = True
    # SDPA on CPU in float32, bhsd (the cache widened and transposed once, outside the timing).
    kf, vf, qf = k.float().transpose(1, 2).contiguous(), v.float().transpose(1, 2).contiguous(), q.transpose(1, 2)
    sdpa = best_of(a.reps, lambda: torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask,
                                                                          enable_gqa=True))
    print(f"cached {n}, topk {a.topk}, GQA {hq}/{hkv}, d {d}, bf16 cache, threads {a.threads}")
    print(f"  qkv sparse decode  {sparse * 1e3:8.3f} ms")
    print(f"  qkv dense decode   {dense * 1e3:8.3f} ms   ({dense / sparse:.1f}x)")
    print(f"  torch SDPA + mask  {sdpa * 1e3:8.3f} ms   ({sdpa / sparse:.1f}x)")


if __name__ == "__main__":
    main()
