"""qkv.sparse_attention (DeepSeek sparse attention over top-k listed keys) against qkv's dense
causal attention and PyTorch SDPA with the equivalent boolean mask: same process, same
threads (torch.set_num_threads = qkv's threads), forward and forward + backward.

    python bench/bench_sparse.py [--threads 2] [--repeats 3] [--sizes 4096 8192]
                                 [--shapes mla gqa] [--dtypes float32 bfloat16]
                                 [--sdpa-max 4096] [--no-backward] [--values separate|latent]

Shapes (layout bshd, causal prefill Nq = Nk = N, topk 2048):
  mla: 16 query heads on one kv head, d 576, dv 512 (DeepSeek-V3.2's MQA/MLA mode)
  gqa: 32 query heads on 8 kv heads, d = dv = 128
both with one index list per query shared by every head ([B, N, topk]).

Index lists as the indexer produces them: row i lists its causal keys 0..i when there are
at most topk of them (then −1 padded), else a random subset of topk of them (the top-k of
random scores over the causal keys), in random order.

The ratio the DSA issue targets is dense / sparse (the dense causal time over the sparse
time): ideally about N / (2·topk) once N ≫ topk (dense attends N/2 keys per row on average).
SDPA materialises the N × N mask (N² bytes) and, in its math path, scores of Hq·N² floats:
it runs only for N ≤ --sdpa-max.
"""

from __future__ import annotations

import argparse
import os

import torch

import qkv
from bench_timing import best_of, cpu_model

SHAPES = {"mla": (16, 1, 576, 512), "gqa": (32, 8, 128, 128)}


def causal_topk_lists(n, topk, generator, chunk=512):
    """[1, n, topk] int32: row i's causal keys if i + 1 <= topk, else topk of them at random."""
    out = torch.full((n, topk), -1, dtype=torch.int32)
    cols = torch.arange(n)
    for start in range(0, n, chunk):
        rows = torch.arange(start, min(start + chunk, n))
        scores = torch.rand(len(rows), n, generator=generator)
        scores.masked_fill_(cols[None, :] > rows[:, None], -1.0)
        picked = scores.topk(min(topk, n), dim=-1)
        idx = picked.indices.to(torch.int32)
        idx[picked.values < 0] = -1  # fewer causal keys than topk
        out[start:start + len(rows), :idx.shape[1]] = idx
    return out.unsqueeze(0)


def boolean_mask(indices, n):
    """[n, n] bool: True where row i lists key j (−1 lists nothing)."""
    idx = indices[0].long()
    mask = torch.zeros(n, n + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(idx < 0, n, idx), True)
    return mask[:, :n]


def forward_and_backward(fn, inputs, dout):
    def run():
        for x in inputs:
            x.grad = None
        out = fn(*inputs)
        out.backward(dout)
    return run


def bench_case(shape, n, dtype, args):
    hq, hkv, d, dv = SHAPES[shape]
    g = torch.Generator().manual_seed(n)
    dt = getattr(torch, dtype)
    q = torch.randn(1, n, hq, d, generator=g).to(dt)
    k = torch.randn(1, n, hkv, d, generator=g).to(dt)
    v = torch.randn(1, n, hkv, dv, generator=g).to(dt)
    dout = torch.randn(1, n, hq, dv, generator=g).to(dt)
    latent = args.values == "latent" and shape == "mla"  # v = k's first dv channels, a view
    indices = causal_topk_lists(n, args.topk, g)
    th = args.threads
    repeats = 1 if n >= 16384 else args.repeats

    sparse = lambda q, k, v: qkv.sparse_attention(q, k, k[..., :dv] if latent else v, indices, causal="top_left",
                                                  layout="bshd", threads=th)
    dense = lambda q, k, v: qkv.attention(q, k, k[..., :dv] if latent else v, causal="top_left", layout="bshd",
                                          threads=th)
    rows = {}
    with torch.no_grad():
        rows["qkv sparse"] = [best_of(repeats, lambda: sparse(q, k, v))]
        rows["qkv dense causal"] = [best_of(repeats, lambda: dense(q, k, v))]
    mask = None
    if n <= args.sdpa_max:
        mask = boolean_mask(indices, n)
        # bhsd views of the same data; enable_gqa repeats kv heads inside SDPA
        sdpa = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), (k[..., :dv] if latent else v).transpose(1, 2), attn_mask=mask,
            enable_gqa=hq != hkv).transpose(1, 2)
        with torch.no_grad():
            rows["torch SDPA + bool mask"] = [best_of(repeats, lambda: sdpa(q, k, v))]
    if not args.no_backward:
        inputs = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        rows["qkv sparse"].append(best_of(repeats, forward_and_backward(sparse, inputs, dout)))
        rows["qkv dense causal"].append(best_of(repeats, forward_and_backward(dense, inputs, dout)))
        if mask is not None:
            rows["torch SDPA + bool mask"].append(best_of(repeats, forward_and_backward(sdpa, inputs, dout)))
    print(f"\n{shape} Hq={hq} Hkv={hkv} d={d} dv={dv} N={n} topk={args.topk} {dtype}"
          f"{' v = k[..., :dv]' if latent else ''} "
          f"(repeats {repeats}, load {os.getloadavg()[0]:.2f})")
    base = rows["qkv sparse"]
    for name, t in rows.items():
        cells = [f"fwd {t[0] * 1e3:9.1f} ms ({t[0] / base[0]:5.2f}x sparse)"]
        if len(t) > 1:
            cells.append(f"fwd+bwd {t[1] * 1e3:9.1f} ms ({t[1] / base[1]:5.2f}x sparse)")
        print(f"  {name:24s} " + "   ".join(cells))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--shapes", nargs="+", default=["mla", "gqa"], choices=sorted(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--sdpa-max", type=int, default=4096)
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--values", choices=["separate", "latent"], default="separate",
                        help="latent: the mla shape's v is k's first dv channels (a view, as DeepSeek's "
                             "latent cache is read; its gradient flows into k's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"cpu: {cpu_model()}; threads {args.threads}; load {os.getloadavg()}; "
          f"ratios: time / qkv sparse's time (dense / sparse is the issue's target)")
    for shape in args.shapes:
        for n in args.sizes:
            for dtype in args.dtypes:
                bench_case(shape, n, dtype, args)


if __name__ == "__main__":
    main()
