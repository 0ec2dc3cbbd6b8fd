"""One serving step of latent attention (MLA) through qkv.BatchPlan, in each cache layout
an engine keeps: a combined [c_kv | k_pe] bf16 pool (vLLM's, SGLang's; v_cache=None),
FlashInfer's two bf16 pools (k_rope_cache=) and FlashMLA's FP8 records
(cache_format="fp8_ds_mla", power-of-two scales) — against qkv.mla_decode called once per
sequence over the same caches (what an engine without a batch plan does for a step whose
sequences have different query counts) and PyTorch's absorbed formula per sequence in
bf16 (matmul + masked softmax + matmul). One process, same threads, best of --repeats.

The step: --decode sequences with one new token, --mtp sequences with 2 (a
multi-token-prediction step), each over --keys cached tokens, paged in blocks of 64.

    python bench/bench_mla_batch_plan.py [--heads 16] [--keys 4096] [--decode 6] [--mtp 2] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import os

import torch

import qkv
from bench_timing import best_of, cpu_model

BLOCK = 64


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--keys", type=int, default=4096)
    parser.add_argument("--decode", type=int, default=6)
    parser.add_argument("--mtp", type=int, default=2)
    parser.add_argument("--dc", type=int, default=512)
    parser.add_argument("--dr", type=int, default=64)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    dc, dr, d, n, heads = args.dc, args.dr, args.dc + args.dr, args.keys, args.heads
    queries = [1] * args.decode + [2] * args.mtp
    batch = len(queries)
    cu = torch.tensor([0] + queries).cumsum(0)
    lengths = [n] * batch
    per_seq = -(-n // BLOCK)
    table = torch.randperm(batch * per_seq, dtype=torch.int32).reshape(batch, per_seq)
    latent = torch.randn(batch * per_seq, BLOCK, 1, d)
    combined = latent.bfloat16()
    ckv, kpe = combined[..., :dc].contiguous(), combined[..., dc:].contiguous()
    records = qkv.pack_mla_records(latent[:, :, 0, :dc], latent[:, :, 0, dc:])
    q = torch.randn(int(cu[-1]), heads, d)
    scale = d ** -0.5
    plan = qkv.BatchPlan(cu, lengths, num_heads=heads, num_kv_heads=1, head_dim=d, v_dim=dc, block_table=table,
                         block_size=BLOCK, scale=scale)

    def per_sequence(cache, kpe_cache, **extra):
        for b in range(batch):
            rows = q[cu[b]:cu[b + 1]].reshape(1, queries[b], heads, d)
            qkv.mla_decode(rows[..., :dc], rows[..., dc:], cache, kpe_cache, [n], block_table=table[b:b + 1],
                           scale=scale, threads=threads, **extra)

    keys_of = [combined[table[b].long()].reshape(-1, d)[:n] for b in range(batch)]  # gathered once, not timed

    def torch_formula():
        for b in range(batch):
            rows = q[cu[b]:cu[b + 1]].bfloat16()  # [m, H, d]
            s = torch.matmul(rows, keys_of[b].T).float() * scale  # [m, H, n]
            m = queries[b]
            if m > 1:  # bottom-right causal among the new tokens
                mask = torch.arange(n)[None, :] > (n - m + torch.arange(m))[:, None]
                s = s.masked_fill(mask[:, None, :], float("-inf"))
            torch.matmul(torch.softmax(s, dim=-1).bfloat16(), keys_of[b][:, :dc])

    print(f"cpu: {cpu_model()}; {heads} heads, dc {dc}, dr {dr}, {n} cached tokens each; {args.decode} decode "
          f"tokens + {args.mtp} two-token steps, paged ({BLOCK}); load {os.getloadavg()[0]:.2f}")
    print("| threads | plan: combined bf16 | plan: two bf16 pools | mla_decode per sequence (bf16) | "
          "plan: FP8 records | mla_decode per sequence (records) | torch bf16 formula per sequence |")
    print("|---|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        plan = qkv.BatchPlan(cu, lengths, num_heads=heads, num_kv_heads=1, head_dim=d, v_dim=dc, block_table=table,
                             block_size=BLOCK, scale=scale, threads=threads)
        t = {
            "combined": best_of(args.repeats, lambda: plan.run(q, combined, None)),
            "two pools": best_of(args.repeats, lambda: plan.run(q, ckv, None, k_rope_cache=kpe)),
            "per seq": best_of(args.repeats, lambda: per_sequence(ckv[:, :, 0], kpe[:, :, 0])),
            "records": best_of(args.repeats, lambda: plan.run(q, records, None, cache_format="fp8_ds_mla")),
            "per seq records": best_of(args.repeats, lambda: per_sequence(records, None, cache_format="fp8_ds_mla")),
            "torch": best_of(args.repeats, torch_formula),
        }
        ms = {k: v * 1e3 for k, v in t.items()}
        print(f"| {threads} | {ms['combined']:.2f} ms | {ms['two pools']:.2f} ms | {ms['per seq']:.2f} ms "
              f"({t['per seq'] / t['two pools']:.2f}× the plan) | {ms['records']:.2f} ms | {ms['per seq records']:.2f} ms "
              f"({t['per seq records'] / t['records']:.2f}×) | {ms['torch']:.2f} ms ({t['torch'] / t['two pools']:.2f}× "
              f"the two-pool plan) |")


if __name__ == "__main__":
    main()
