#!/usr/bin/env python3
"""qkv.flex_attention against torch's FlexAttention and SDPA with the same mask given
densely, on the CPU: forward (qkv vs compiled torch flex_attention) and forward+backward
(qkv vs SDPA with the dense bool mask: torch 2.13's flex_attention has no CPU backward),
plus qkv's own native path for the pattern (varlen for documents, window= for the
sliding window; prefix-LM has none, so its row is qkv given the dense mask).

Masks, over N tokens, B = 1, H = 8, d = 64, float32, BLOCK_SIZE 128:
  document   5 documents (lengths from seed 0), causal inside each
  window     causal sliding window of 256 keys
  prefix     prefix-LM: the first N/4 tokens see each other, the rest causal

Peak RSS: each of `qkv flex fwd+bwd` and `sdpa dense fwd+bwd` in a process of its own:
how far the call's peak RSS rises above the RSS before it (MiB; the BlockMask or the
dense mask already built), so what grows like N² shows.

    python bench/bench_flex.py --n 1024 4096 [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import qkv

H, D, WINDOW = 8, 64, 256


def documents(n):
    g = torch.Generator().manual_seed(0)
    cuts = torch.randperm(n - 1, generator=g)[:4].add(1).sort().values.tolist()
    bounds = [0, *cuts, n]
    doc = torch.zeros(n, dtype=torch.int64)
    for index, (a, b) in enumerate(zip(bounds, bounds[1:])):
        doc[a:b] = index
    return doc, bounds


def mask_mod(kind, n):
    if kind == "document":
        doc, _ = documents(n)
        return lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv)
    if kind == "window":
        return lambda b, h, q, kv: (q >= kv) & (q - kv < WINDOW)
    prefix = n // 4
    return lambda b, h, q, kv: (kv < prefix) | (q >= kv)


def inputs(n, grad=False):
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(1, H, n, D, generator=g).requires_grad_(grad) for _ in range(4))


def dense(kind, n):
    i = torch.arange(n)
    return mask_mod(kind, n)(0, 0, i[:, None], i[None, :])


def native(kind, n, q, k, v):
    """qkv's own call for the pattern."""
    if kind == "document":
        _, bounds = documents(n)
        cu = torch.tensor(bounds)
        pack = [x[0].transpose(0, 1) for x in (q, k, v)]
        return lambda: qkv.varlen_attention(*pack, cu, cu, causal="top_left",
                                            threads=torch.get_num_threads())
    if kind == "window":
        return lambda: qkv.attention(q, k, v, causal="top_left", window=(WINDOW - 1, 0),
                                     threads=torch.get_num_threads())
    m = dense(kind, n)
    return lambda: qkv.attention(q, k, v, mask=m, threads=torch.get_num_threads())


def timed(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def fwd_bwd(f, q, k, v, dout):
    def run():
        out = f(q, k, v)
        torch.autograd.grad(out, (q, k, v), dout)
    return run


def _status(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field)) / 1024


def rss_child(impl, kind, n):
    """Prints how far the call's peak RSS rises above the RSS before it (MiB): the masks
    are built first (torch's create_block_mask itself materializes the N² mask while it
    runs), then the peak is reset (/proc/self/clear_refs 5) and the call made."""
    q, k, v, dout = inputs(n, grad=True)
    if impl == "qkv":
        bm = create_block_mask(mask_mod(kind, n), None, None, n, n, device="cpu")
        call = fwd_bwd(lambda q, k, v: qkv.flex_attention(q, k, v, block_mask=bm), q, k, v, dout)
    else:
        m = dense(kind, n)
        call = fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                       q, k, v, dout)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    before = _status("VmRSS")
    call()
    print(_status("VmHWM") - before)


def peak_rss(impl, kind, n):
    out = subprocess.run([sys.executable, __file__, "--rss", impl, kind, str(n)],
                         capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def row(kind, n, repeats):
    q, k, v, dout = inputs(n)
    bm = create_block_mask(mask_mod(kind, n), None, None, n, n, device="cpu")
    m = dense(kind, n)
    compiled = torch.compile(flex_attention)
    qkv_fwd = timed(lambda: qkv.flex_attention(q, k, v, block_mask=bm), repeats)
    try:
        torch_fwd = timed(lambda: compiled(q, k, v, block_mask=bm), repeats)
    except Exception as error:  # torch 2.13's inductor fails on some masks' C++ code
        torch_fwd = float("nan")
        print(f"(torch flex_attention, {kind} N={n}: {type(error).__name__})", file=sys.stderr)
    native_fwd = timed(native(kind, n, q, k, v), repeats)
    qkv._flex._TABLES.clear()
    start = time.perf_counter()
    qkv.flex_attention(q, k, v, block_mask=bm)
    first = (time.perf_counter() - start) * 1e3
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    qkv_fb = timed(fwd_bwd(lambda a, b, c: qkv.flex_attention(a, b, c, block_mask=bm),
                           qg, kg, vg, dout), repeats)
    sdpa_fb = timed(fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=m),
                            qg, kg, vg, dout), max(1, repeats // 2))
    rss = peak_rss("qkv", kind, n), peak_rss("sdpa", kind, n)
    print(f"| {kind} | {n} | {qkv_fwd:.1f} | {first:.1f} | {torch_fwd:.1f} | "
          f"{torch_fwd / qkv_fwd:.2f} | {native_fwd:.1f} | {qkv_fwd / native_fwd:.2f} | "
          f"{qkv_fb:.1f} | {sdpa_fb:.1f} | {sdpa_fb / qkv_fb:.2f} | {rss[0]:.0f} | {rss[1]:.0f} |",
          flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--masks", nargs="+", default=["document", "window", "prefix"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rss", nargs=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.rss:
        return rss_child(args.rss[0], args.rss[1], int(args.rss[2]))
    print(f"torch {torch.__version__}, qkv {qkv.__version__}, threads {args.threads}, "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| mask | N | qkv flex fwd ms | (first call, table built) | torch flex compiled fwd ms "
          "| torch/qkv | qkv native fwd ms | qkv flex/native | qkv flex fwd+bwd ms "
          "| sdpa dense fwd+bwd ms | sdpa/qkv | qkv fwd+bwd +RSS MiB | sdpa fwd+bwd +RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.n:
        for kind in args.masks:
            row(kind, n, args.repeats)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
