"""One serving step of latent attention (MLA) through qkv.BatchPlan, in each cache layout
an engine keeps: a combined [c_kv | k_pe] bf16 pool (vLLM's, SGLang's; v_cache=None),
FlashInfer's two bf16 pools (k_rope_cache=) and FlashMLA's FP8 records
(cache_format="fp8_ds_mla", power-of-two scales) — against qkv.mla_decode called once per
sequence over the same caches (what an engine without a batch plan does for a step whose
sequences have different query counts) and PyTorch's absorbed formula per sequence in
bf16 (matmul + masked softmax + matmul). One process, same threads, best of --repeats.

The step: --decode sequences with one new token, --mtp sequences with 2 (a
multi-token-prediction step), each over --keys cached tokens, paged in blocks of 64.

A second table times the step with its new tokens written in the same call (issue 41's
appending run) against the calls an engine makes without it: q_pe and k_pe rotated in
PyTorch (DeepSeek's pairs, as vLLM's is_neox_style=False rotation), the rows written
through the slot mapping (bf16 pools) or packed with qkv.pack_mla_records (records), then
plan.run — each path checked once to give the same output and pools (max |diff| printed);
medians of --repeats interleaved rounds.

    python bench/bench_mla_batch_plan.py [--heads 16] [--keys 4096] [--decode 6] [--mtp 2] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import os

import torch

import qkv
from bench_timing import best_of, cpu_model, interleaved_medians

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
    parser.add_argument("--append-only", action="store_true", help="only the second table")
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
    if not args.append_only:
        print("| threads | plan: combined bf16 | plan: two bf16 pools | mla_decode per sequence (bf16) | "
              "plan: FP8 records | mla_decode per sequence (records) | torch bf16 formula per sequence |")
        print("|---|---|---|---|---|---|---|")
    appending = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        plan = qkv.BatchPlan(cu, lengths, num_heads=heads, num_kv_heads=1, head_dim=d, v_dim=dc, block_table=table,
                             block_size=BLOCK, scale=scale, threads=threads)
        appending.append((threads, plan))
        if args.append_only:
            continue
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

    append_table(appending, q, cu, queries, n, table, ckv[:, :, 0], kpe[:, :, 0], records, dc, dr, args.repeats)


def append_table(runs, q, cu, queries, n, table, ckv, kpe, records, dc, dr, repeats):
    """The step with its new tokens written in the call against rotate + write + run."""
    positions = torch.cat([n - m + torch.arange(m) for m in queries])
    slots = torch.cat([table[b, positions[cu[b]:cu[b + 1]] // BLOCK].long() * BLOCK + positions[cu[b]:cu[b + 1]] % BLOCK
                       for b in range(len(queries))])  # vLLM's slot_mapping, made once per step
    freqs = positions[:, None].float() * 10000.0 ** (-torch.arange(0, dr, 2).float() / dr)
    cos, sin = freqs.cos().repeat_interleave(2, -1), freqs.sin().repeat_interleave(2, -1)  # pairs' tables
    half_cos, half_sin = cos[:, 0::2], sin[:, 0::2]
    c_kv_new, k_pe_new = torch.randn(len(slots), dc), torch.randn(len(slots), dr)
    rotary = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=True)

    def pairs(x, c, s):  # GPT-J pairs (2i, 2i+1) by angle i
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], -1).flatten(-2)

    def rotated_q():
        return torch.cat([q[..., :dc], pairs(q[..., dc:], half_cos[:, None], half_sin[:, None])], -1)

    def pools_by_hand(plan, ckv_pool, kpe_pool):
        ckv_pool.view(-1, dc)[slots] = c_kv_new.bfloat16()
        kpe_pool.view(-1, dr)[slots] = pairs(k_pe_new, half_cos, half_sin).bfloat16()
        return plan.run(rotated_q(), ckv_pool, None, k_rope_cache=kpe_pool)

    def records_by_hand(plan, pool):
        pool.view(-1, pool.shape[-1])[slots] = qkv.pack_mla_records(c_kv_new, pairs(k_pe_new, half_cos, half_sin))
        return plan.run(rotated_q(), pool, None, cache_format="fp8_ds_mla")

    print("\nWith the step's new tokens written in the call (fused) or by the three calls an engine makes "
          "without it (rotate in PyTorch + write through the slot mapping + plan.run):")
    print("| threads | two bf16 pools: fused | rotate + write + run | records: fused | rotate + pack + write + run | "
          "max abs diff (pools, records) |")
    print("|---|---|---|---|---|---|")
    for threads, plan in runs:
        torch.set_num_threads(threads)
        copies = [(ckv.clone(), kpe.clone()), (ckv.clone(), kpe.clone()), records.clone(), records.clone()]
        fused_pools = plan.run(q, *copies[0][:1], None, k_rope_cache=copies[0][1], k_new=c_kv_new,
                               k_rope_new=k_pe_new, **rotary)
        hand_pools = pools_by_hand(plan, *copies[1])
        fused_records = plan.run(q, copies[2], None, cache_format="fp8_ds_mla", k_new=c_kv_new, k_rope_new=k_pe_new,
                                 **rotary)
        hand_records = records_by_hand(plan, copies[3])
        diff_pools = max((fused_pools - hand_pools).abs().max().item(),
                         (copies[0][0].float() - copies[1][0].float()).abs().max().item(),
                         (copies[0][1].float() - copies[1][1].float()).abs().max().item())
        diff_records = max((fused_records - hand_records).abs().max().item(),
                           float((copies[2] != copies[3]).sum().item()))
        # Medians of interleaved rounds (this VM's neighbours come and go: the best-of columns
        # above move 1.5× between runs; a pair timed in turns moves together).
        times = interleaved_medians([
            lambda: plan.run(q, copies[0][0], None, k_rope_cache=copies[0][1], k_new=c_kv_new, k_rope_new=k_pe_new,
                             **rotary),
            lambda: pools_by_hand(plan, *copies[1]),
            lambda: plan.run(q, copies[2], None, cache_format="fp8_ds_mla", k_new=c_kv_new, k_rope_new=k_pe_new,
                             **rotary),
            lambda: records_by_hand(plan, copies[3])], repeats)
        t = dict(zip(("fused", "by hand", "records fused", "records by hand"), times))
        ms = {k: v * 1e3 for k, v in t.items()}
        print(f"| {threads} | {ms['fused']:.2f} ms | {ms['by hand']:.2f} ms ({t['by hand'] / t['fused']:.2f}× fused) | "
              f"{ms['records fused']:.2f} ms | {ms['records by hand']:.2f} ms "
              f"({t['records by hand'] / t['records fused']:.2f}×) | {diff_pools:g}, {diff_records:g} |")


if __name__ == "__main__":
    main()
