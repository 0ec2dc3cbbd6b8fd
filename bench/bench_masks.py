#!/usr/bin/env python3
"""Masked and ragged batches: qkv against PyTorch SDPA in one process.

Rows: the masks real callers send (transformers passes padding as a dense bool
[B,1,N,N] or float [B,1,N,N] with finfo.min), at shapes where three of four sequences
are half padding (entry 0 full, the others half), same fp32 inputs, same threads:

  none          no mask (reference row)
  bool B11N     key padding as bool [B,1,1,N]
  bool B1NN     key padding as bool [B,1,N,N]
  float B1NN    key padding as float [B,1,N,N], finfo.min at padding
  causal+pad    causal and padding in one bool [B,1,N,N] (what decoders get)
  float bias    a float [B,1,N,N] bias with no -inf (every tile masked elementwise)

For each masked row, `qkv lengths` is qkv with the same keys cut by key_lengths (and
causal) instead of the mask: the mask analysis should cost nearly nothing on top.
Errors: max |x − fp64 oracle| over out (and dq, dk, dv for fwd+bwd), the oracle being
the same masked math in float64.

Varlen: 16 sequences with lengths uniform in 16..1024 (seed 0), packed, against
the same batch padded to 1024 through PyTorch SDPA with a bool padding mask.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import keep_freed_memory, median_time  # noqa: E402

import qkv  # noqa: E402

MASKS = ("none", "bool B11N", "bool B1NN", "float B1NN", "causal+pad", "float bias")


def lengths_for(batch: int, n: int) -> list[int]:
    return [n] + [n // 2] * (batch - 1)


def make_mask(kind: str, batch: int, n: int, lengths):
    valid = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # [B, N]
    if kind == "none":
        return None
    if kind == "bool B11N":
        return valid[:, None, None, :]
    if kind == "bool B1NN":
        return valid[:, None, None, :].expand(batch, 1, n, n).contiguous()
    if kind == "float B1NN":
        m = torch.zeros(batch, 1, n, n)
        return m.masked_fill(~valid[:, None, None, :], torch.finfo(torch.float32).min)
    if kind == "causal+pad":
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        return (valid[:, None, None, :] & causal).contiguous()
    if kind == "float bias":
        g = torch.Generator().manual_seed(1)
        return torch.randn(batch, 1, n, n, generator=g) * 0.5
    raise ValueError(kind)


def oracle(q, k, v, dout, mask, backward):
    """The masked math in float64, one batch entry at a time (dense S and P)."""
    outs, grads = [], [[], [], []]
    for b in range(q.shape[0]):
        leaves = [t[b:b + 1].double().requires_grad_(backward) for t in (q, k, v)]
        logits = leaves[0] @ leaves[1].transpose(-1, -2) / math.sqrt(q.shape[-1])
        if mask is not None:
            m = mask[b:b + 1] if mask.shape[0] > 1 else mask
            logits = logits.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else logits + m.double()
        o = torch.softmax(logits, dim=-1) @ leaves[2]
        outs.append(o.detach())
        if backward:
            o.backward(dout[b:b + 1].double())
            for g, leaf in zip(grads, leaves):
                g.append(leaf.grad)
    out = torch.cat(outs)
    return [torch.cat(g) for g in grads] if backward else [out]


def err(results, reference):
    return max(float((r.double() - ref).abs().max()) for r, ref in zip(results, reference))


def run_torch(q, k, v, dout, mask, backward):
    if not backward:
        with torch.no_grad():
            return [F.scaled_dot_product_attention(q, k, v, attn_mask=mask)]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*leaves, attn_mask=mask).backward(dout)
    return [t.grad for t in leaves]


def run_qkv(q, k, v, dout, backward, threads, **kw):
    out, lse = qkv.attention(q, k, v, return_lse=True, backend="cpu", threads=threads, **kw)
    if not backward:
        return [out]
    return list(qkv.attention_backward(q, k, v, out, lse, dout, backend="cpu", threads=threads, **kw))


def mask_rows(args, peaks):
    print("\n## Masks (three of four sequences half padding)\n")
    print("| shape | mask | pass | thr | torch ms | qkv ms | qkv/torch speed | qkv lengths ms "
          "| mask/lengths | qkv err | torch err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    shapes = [(4, 12, 512, 32), (8, 16, 1024, 64)] + ([] if args.quick else [(2, 8, 4096, 64)])
    for batch, heads, n, d in shapes:
        g = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(batch, heads, n, d, generator=g) for _ in range(4))
        lengths = lengths_for(batch, n)
        for kind in MASKS:
            mask = make_mask(kind, batch, n, lengths)
            for backward in (False, True):
                if backward and n >= 4096 and args.skip_long_backward:
                    continue
                reference = oracle(q, k, v, dout, mask, backward) if args.errors else None
                # The same keys removed through key_lengths / causal instead of a mask.
                kw_lengths = {}
                if kind in ("bool B11N", "bool B1NN", "float B1NN"):
                    kw_lengths = dict(key_lengths=lengths)
                elif kind == "causal+pad":
                    kw_lengths = dict(key_lengths=lengths, causal="top_left")
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    t_torch = median_time(lambda: run_torch(q, k, v, dout, mask, backward), args.repeats)
                    t_qkv = median_time(lambda: run_qkv(q, k, v, dout, backward, threads, mask=mask),
                                        args.repeats)
                    t_len = (median_time(lambda: run_qkv(q, k, v, dout, backward, threads, **kw_lengths),
                                         args.repeats) if kw_lengths else None)
                    e_q = e_t = float("nan")
                    if reference is not None:
                        e_q = err(run_qkv(q, k, v, dout, backward, threads, mask=mask), reference)
                        e_t = err(run_torch(q, k, v, dout, mask, backward), reference)
                    print(f"| [{batch},{heads},{n},{d}] | {kind} | {'fwd+bwd' if backward else 'fwd'} | "
                          f"{threads} | {t_torch * 1e3:.1f} | {t_qkv * 1e3:.1f} | {t_torch / t_qkv:.2f}× | "
                          + (f"{t_len * 1e3:.1f} | {t_qkv / t_len:.2f} |" if t_len else "– | – |")
                          + f" {e_q:.1e} | {e_t:.1e} |", flush=True)


def varlen_rows(args):
    print("\n## Varlen: 16 sequences, lengths uniform in 16..1024, H=8, d=64\n")
    print("| pass | thr | torch padded ms | qkv varlen ms | qkv/torch speed | qkv err | torch err |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 1025, (16,), generator=g).tolist()
    n, heads, d = 1024, 8, 64
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    total = int(cu[-1])
    q, k, v, dout = (torch.randn(total, heads, d, generator=g) for _ in range(4))

    def pad(x):  # packed [total, H, d] -> [16, H, 1024, d], zeros after each sequence
        out = torch.zeros(16, heads, n, d)
        for s, length in enumerate(lengths):
            out[s, :, :length] = x[cu[s]:cu[s] + length].transpose(0, 1)
        return out

    def unpad(x):  # [16, H, 1024, d] -> packed
        return torch.cat([x[s, :, :length].transpose(0, 1) for s, length in enumerate(lengths)])

    qp, kp, vp, doutp = pad(q), pad(k), pad(v), pad(dout)
    mask = (torch.arange(n)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]

    def torch_padded(backward):
        res = run_torch(qp, kp, vp, doutp, mask, backward)
        return [unpad(r) for r in res]

    def qkv_varlen(backward, threads):
        out, lse = qkv.varlen_attention(q, k, v, cu, cu, return_lse=True, threads=threads)
        if not backward:
            return [out]
        return list(qkv.varlen_attention_backward(q, k, v, out, lse, dout, cu, cu, threads=threads))

    for backward in (False, True):
        reference = None
        if args.errors:  # per sequence, in float64
            outs, grads = [], [[], [], []]
            for s, length in enumerate(lengths):
                sl = slice(int(cu[s]), int(cu[s]) + length)
                leaves = [t[sl].transpose(0, 1).double().requires_grad_(backward) for t in (q, k, v)]
                o = torch.softmax(leaves[0] @ leaves[1].transpose(-1, -2) / math.sqrt(d), -1) @ leaves[2]
                outs.append(o.detach().transpose(0, 1))
                if backward:
                    o.backward(dout[sl].transpose(0, 1).double())
                    for gr, leaf in zip(grads, leaves):
                        gr.append(leaf.grad.transpose(0, 1))
            reference = [torch.cat(gr) for gr in grads] if backward else [torch.cat(outs)]
        for threads in args.threads:
            torch.set_num_threads(threads)
            t_torch = median_time(lambda: run_torch(qp, kp, vp, doutp, mask, backward), args.repeats)
            t_qkv = median_time(lambda: qkv_varlen(backward, threads), args.repeats)
            e_q = err(qkv_varlen(backward, threads), reference) if reference else float("nan")
            e_t = err(torch_padded(backward), reference) if reference else float("nan")
            print(f"| {'fwd+bwd' if backward else 'fwd'} | {threads} | {t_torch * 1e3:.1f} | "
                  f"{t_qkv * 1e3:.1f} | {t_torch / t_qkv:.2f}× | {e_q:.1e} | {e_t:.1e} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="skip [2,8,4096,64]")
    parser.add_argument("--skip-long-backward", action="store_true")
    parser.add_argument("--no-errors", dest="errors", action="store_false")
    parser.add_argument("--only", choices=("masks", "varlen"), default=None)
    args = parser.parse_args()
    keep_freed_memory()
    print(f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus; "
          f"torch {torch.__version__}; qkv {qkv.__version__}")
    with torch.inference_mode(False):
        if args.only in (None, "masks"):
            mask_rows(args, None)
        if args.only in (None, "varlen"):
            varlen_rows(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
