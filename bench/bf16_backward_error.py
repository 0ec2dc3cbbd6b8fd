#!/usr/bin/env python3
"""The accuracy of qkv's bf16 backward (precision="fast": all five block products on
AVX512-BF16 or the AMX tiles, P and dS rounded to bf16 once; src/cpu/backward.cpp) and of
its float32 arithmetic (precision="exact") next to PyTorch's bfloat16 SDPA, each gradient
against float64 autograd on the same bfloat16 inputs. Sets QKV_DOT_PRODUCTS=on where the
CPU has AVX512-BF16 (so Intel's cores, where "fast" would not take the unit, show it too).
Run: python3 bench/bf16_backward_error.py   (markdown rows)
"""
from __future__ import annotations

import os

if "QKV_DOT_PRODUCTS" not in os.environ:
    with open("/proc/cpuinfo") as cpuinfo:
        if "avx512_bf16" in cpuinfo.read():
            os.environ["QKV_DOT_PRODUCTS"] = "on"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import qkv.torch as qt  # noqa: E402


def grads(fn, q, k, v, dout):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    fn(q, k, v).backward(dout)
    return q.grad, k.grad, v.grad


def main() -> None:
    torch.manual_seed(1)
    print(f"# QKV_DOT_PRODUCTS={os.environ.get('QKV_DOT_PRODUCTS', 'auto')}, torch {torch.__version__}")
    print("| shape | grad | qkv fast err | qkv exact err | torch bf16 err | fast/torch err | within 2× |")
    print("|---|---|---|---|---|---|---|")
    for h, hkv, n, d, causal in ((8, 8, 300, 64, False), (8, 2, 257, 127, True), (4, 4, 200, 128, True),
                                 (8, 8, 1024, 64, False), (8, 8, 1024, 128, True)):
        q = torch.randn(1, h, n, d).to(torch.bfloat16)
        k, v = (torch.randn(1, hkv, n, d).to(torch.bfloat16) for _ in range(2))
        dout = torch.randn(1, h, n, d).to(torch.bfloat16)
        sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)  # noqa: E731
        ours = lambda precision: grads(  # noqa: E731
            lambda q, k, v: qt.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True,
                                                            precision=precision), q, k, v, dout)
        exact = grads(sdpa, q.double(), k.double(), v.double(), dout.double())
        rows = zip("qkv", ours("fast"), ours("exact"), grads(sdpa, q, k, v, dout), exact)
        shape = f"[1,{h}{'' if h == hkv else f'/{hkv}'},{n},{d}]{' causal' if causal else ''}"
        for name, fast, ours_exact, theirs, e in rows:
            err = [(g.double() - e).abs().max().item() for g in (fast, ours_exact, theirs)]
            print(f"| {shape} | d{name} | {err[0]:.2e} | {err[1]:.2e} | {err[2]:.2e} | "
                  f"{err[0] / err[2]:.2f} | {'yes' if err[0] <= 2 * err[2] else 'NO'} |")


if __name__ == "__main__":
    main()
