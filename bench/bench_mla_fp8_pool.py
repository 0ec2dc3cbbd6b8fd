"""MLA decode over a combined [c_kv | k_pe] latent pool in each storage qkv reads: float32,
bfloat16 and both float8 formats (vLLM's FP8 MLA cache, one per-tensor scale), through
qkv.decode(q, pool, None, lengths, v_dim=dc, k_scale=...), and the float8 caches also
kept as two arrays through qkv.mla_decode(..., ckv_scale=, kpe_scale=) ("apart"), and
FlashMLA's FP8 records (cache_format="fp8_ds_mla": e4m3 with a scale per 128 values, k_pe
in bf16; qkv.pack_mla_records) with power-of-two scales ("records ue8m0") and max|x|/448
scales ("records amax") — one process, same threads, best of --repeats per storage; ratios
against the float32 pool.

    python bench/bench_mla_fp8_pool.py [--heads 128] [--keys 4096] [--threads 1 2] [--repeats 15] [--topk 2048]

With precision "fast" on an AVX512-BF16 CPU the bf16 and float8 pools take the latent step
on vdpbf16ps (docs/latent-attention.md); elsewhere every storage is widened to float32.
"""

from __future__ import annotations

import argparse
import os

import torch

import qkv
from bench_timing import best_of, cpu_model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--keys", type=int, default=4096)
    parser.add_argument("--dc", type=int, default=512)
    parser.add_argument("--dr", type=int, default=64)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--topk", type=int, default=0,
                        help="also the records with DeepSeek sparse attention's indices: topk random cached positions")
    args = parser.parse_args()
    torch.manual_seed(0)
    dc, d, n = args.dc, args.dc + args.dr, args.keys
    q = torch.randn(1, 1, args.heads, d)
    base = torch.randn(1, n, 1, d)
    scale8 = 0.02
    pools = {"float32": (base, None), "bfloat16": (base.bfloat16(), None),
             "float8_e4m3fn": ((base / scale8).to(torch.float8_e4m3fn), scale8),
             "float8_e5m2": ((base / scale8).to(torch.float8_e5m2), scale8)}
    record_caches = {f"records {kind}": qkv.pack_mla_records(base[:, :, 0, :dc], base[:, :, 0, dc:],
                                                             power_of_two_scales=kind == "ue8m0")
                     for kind in ("ue8m0", "amax")}
    print(f"cpu: {cpu_model()}; heads {args.heads}, dc {dc}, dr {args.dr}, {n} cached tokens, one query; "
          f"load {os.getloadavg()[0]:.2f}")
    for threads in args.threads:
        times = {}
        for name, (pool, s) in pools.items():
            extra = {} if s is None else {"k_scale": s}
            times[name] = best_of(args.repeats, lambda: qkv.decode(q, pool, None, [n], v_dim=dc, scale=0.1,
                                                                   layout="bshd", threads=threads, **extra))
        for name in ("float8_e4m3fn", "float8_e5m2"):
            pool, s = pools[name]
            ckv, kpe = pool[:, :, 0, :dc].contiguous(), pool[:, :, 0, dc:].contiguous()
            q_nope, q_pe = q[..., :dc], q[..., dc:]
            times[name + " apart"] = best_of(args.repeats, lambda: qkv.mla_decode(
                q_nope, q_pe, ckv, kpe, [n], scale=0.1, threads=threads, ckv_scale=s, kpe_scale=s))
        q_nope, q_pe = q[..., :dc], q[..., dc:]
        for name, records in record_caches.items():
            times[name] = best_of(args.repeats, lambda: qkv.mla_decode(
                q_nope, q_pe, records, None, [n], scale=0.1, threads=threads, cache_format="fp8_ds_mla"))
        if args.topk:
            indices = torch.sort(torch.randperm(n)[:args.topk]).values.to(torch.int32).reshape(1, 1, args.topk)
            records = record_caches["records ue8m0"]
            times[f"records ue8m0 top-{args.topk}"] = best_of(args.repeats, lambda: qkv.mla_decode(
                q_nope, q_pe, records, None, [n], scale=0.1, threads=threads, indices=indices,
                cache_format="fp8_ds_mla"))
        cells = "  ".join(f"{k} {t * 1e3:.2f} ms ({times['float32'] / t:.2f}x)" for k, t in times.items())
        print(f"threads {threads}: {cells}")


if __name__ == "__main__":
    main()
