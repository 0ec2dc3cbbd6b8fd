"""Absorbed MLA decode (qkv.mla_decode) against PyTorch's absorbed formula, in one process,
same threads: DeepSeek's latent shapes (dc 512, dr 64; 128 heads and a 16-head tensor-
parallel shard), caches of 4k and 32k tokens, batch 1 and 8, fp32 and bf16 caches; and with
top-k lists (DSA's 2048) at 32k against the dense latent decode. Reports each call's time,
qkv's speed-up over PyTorch, and its share of the peak probed in the same run, before and
after the rows, the higher probe taken (bench/fma_peak.cpp via bench_attention.fma_peak): the
fp32 FMA peak, or for a bf16 cache
the peak of the bf16 unit the call runs on, vdpbf16ps or the AMX tiles (precision "fast"
takes the dot products there: q rounded to bf16 once, P once); the bf16 row's time against the fp32 cache's; its
max error against the fp64 formula over the stored values, as a ratio to PyTorch's bf16
formula's error (the bf16 contract: ≤ 2).

    PYTHONPATH=python python3 bench/bench_mla_decode.py [--threads 2] [--quick]

PyTorch's formula, per batch (what an engine writes without a kernel):
    s = (q_nope @ ckv.T + q_pe @ kpe.T) * scale;  out = softmax(s) @ ckv
in the cache's dtype (bf16 matmuls for a bf16 cache), float32 softmax.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import bf16_unit_peak, fma_peak  # noqa: E402
from bench_timing import best_of, cpu_model  # noqa: E402

import qkv  # noqa: E402

DC, DR = 512, 64
SCALE = 1.0 / (192 ** 0.5)


def torch_absorbed(q_nope, q_pe, ckv, kpe):
    """[B, 1, H, dc] out by matmul + softmax + matmul, the cache's dtype."""
    qn = q_nope[:, 0].to(ckv.dtype)  # [B, H, dc]
    qp = q_pe[:, 0].to(ckv.dtype)
    s = (torch.matmul(qn, ckv.transpose(1, 2)) + torch.matmul(qp, kpe.transpose(1, 2))).float() * SCALE
    p = torch.softmax(s, dim=-1).to(ckv.dtype)
    return torch.matmul(p, ckv).unsqueeze(1)


def flops(batch, heads, keys):
    return 2.0 * batch * heads * keys * (DC + DR + DC)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--quick", action="store_true", help="4k caches and batch 1 only")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    threads = args.threads
    torch.set_num_threads(threads)
    # The peaks are probed before and after the rows, and the higher of the two taken: on a
    # shared host one probe can read 20% low (another tenant on the core), which would
    # overstate every share.
    peak, target = fma_peak(threads)
    bf16_name, bf16_peak = bf16_unit_peak(threads)
    load = os.getloadavg()[0]
    rows = []  # (fields before the share, gflops, unit, fields after)
    rng = torch.Generator().manual_seed(0)
    lengths_of = (4096,) if args.quick else (4096, 32768)
    batches = (1,) if args.quick else (1, 8)
    for heads in (128, 16):
        for keys in lengths_of:
            for batch in batches:
                q_nope = torch.randn(batch, 1, heads, DC, generator=rng)
                q_pe = torch.randn(batch, 1, heads, DR, generator=rng)
                ckv32 = torch.randn(batch, keys, DC, generator=rng)
                kpe32 = torch.randn(batch, keys, DR, generator=rng)
                lengths = torch.full((batch,), keys, dtype=torch.int64)
                fp32_time = None
                for dtype in (torch.float32, torch.bfloat16):
                    ckv, kpe = ckv32.to(dtype), kpe32.to(dtype)
                    ours = best_of(args.repeats, lambda: qkv.mla_decode(q_nope, q_pe, ckv, kpe, lengths, scale=SCALE,
                                                                        threads=threads))
                    theirs = best_of(args.repeats, lambda: torch_absorbed(q_nope, q_pe, ckv, kpe))
                    got = qkv.mla_decode(q_nope, q_pe, ckv, kpe, lengths, scale=SCALE, threads=threads)
                    want = torch_absorbed(q_nope, q_pe, ckv.float(), kpe.float())
                    err = (got - want).abs().max().item()
                    # (a bf16 cache on the dot products is held to the bf16 contract below instead)
                    assert dtype != torch.float32 or err < 1e-3, f"qkv and the formula differ by {err}"
                    gflops = flops(batch, heads, keys) / ours / 1e9
                    name = str(dtype).replace("torch.", "")
                    versus, ratio = "", ""
                    unit = "fma"
                    if dtype == torch.float32:
                        fp32_time = ours
                    else:
                        versus = f"{fp32_time / ours:.2f}x"
                        unit = "bf16" if bf16_peak > 0 else "fma"
                        exact = torch_absorbed(q_nope.double(), q_pe.double(), ckv.double(), kpe.double())
                        peer = torch_absorbed(q_nope, q_pe, ckv, kpe).double()
                        ratio = f"{(got.double() - exact).abs().max().item() / (peer - exact).abs().max().item():.2f}"
                    rows.append((f"| {heads} | {keys} | {batch} | {name} | {ours * 1e3:.2f} | {theirs * 1e3:.2f} | "
                                 f"{theirs / ours:.2f}x | {gflops:.1f} |", gflops, unit, f" {versus} | {ratio} |"))
                    print(f"# {rows[-1][0]}", flush=True)  # progress
                del ckv32, kpe32
    again, _ = fma_peak(threads)
    bf16_name, bf16_again = bf16_unit_peak(threads)
    print(f"# {cpu_model()}, {threads} threads, SIMD target {target}, FMA peak {max(peak, again):.1f} GFLOP/s "
          f"(fp32; probes before and after the rows {peak:.1f} and {again:.1f}), load {load:.1f}")
    peak, bf16_peak = max(peak, again), max(bf16_peak, bf16_again)
    if bf16_peak > 0:
        print(f"# bf16 unit: {bf16_name}, its peak {bf16_peak:.1f} GFLOP/s ({threads} threads; the bf16 rows' share)")
    else:
        print("# bf16 unit: none, the fp32 FMAs (the bf16 rows' share is of the FMA peak)")
    print("| heads | cache | batch | dtype | qkv ms | torch ms | qkv / torch | qkv GFLOP/s | share of peak | "
          "vs fp32 cache | error / torch bf16's |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for before, gflops, unit, after in rows:
        print(f"{before} {gflops / (bf16_peak if unit == 'bf16' else peak):.0%} |{after}")
    # DSA: top-k 2048 lists at 32k keys against the dense latent decode (bf16 cache, 128 heads).
    keys, topk, heads = (4096, 512, 128) if args.quick else (32768, 2048, 128)
    q_nope = torch.randn(1, 1, heads, DC, generator=rng)
    q_pe = torch.randn(1, 1, heads, DR, generator=rng)
    ckv = torch.randn(1, keys, DC, generator=rng).to(torch.bfloat16)
    kpe = torch.randn(1, keys, DR, generator=rng).to(torch.bfloat16)
    lengths = torch.tensor([keys])
    indices = torch.randperm(keys, generator=rng)[:topk].to(torch.int32).view(1, 1, topk)
    dense = best_of(args.repeats, lambda: qkv.mla_decode(q_nope, q_pe, ckv, kpe, lengths, scale=SCALE, threads=threads))
    sparse = best_of(args.repeats, lambda: qkv.mla_decode(q_nope, q_pe, ckv, kpe, lengths, scale=SCALE,
                                                           indices=indices, threads=threads))
    print(f"\nDSA, {heads} heads, bf16 cache of {keys}, top-k {topk}: dense {dense * 1e3:.2f} ms, "
          f"sparse {sparse * 1e3:.2f} ms, {dense / sparse:.1f}x (load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
