#!/usr/bin/env python3
"""The accuracy of qkv's bf16 dot-product forward (precision="fast" with AVX512-BF16's
vdpbf16ps, src/cpu/bf16_dot.cpp) against its float32 arithmetic (precision="exact") and
PyTorch's bfloat16 SDPA, all against float64 on the same bfloat16 inputs.

The dot products multiply pairs of bfloat16 values exactly and sum them in float32, so
both operands of every block product must be bfloat16:
  S = Q·Kᵀ: q and k are bfloat16 already; the scale multiplies the float32 sums (no extra
          rounding; folding it into q, as the fp32 kernels do, would round scale·q)
  O = P·V: the softmax weights P (float32) are rounded to bfloat16 first.
The "emulation" column computes exactly that in float32/float64 torch arithmetic, as a
check of the kernel. The dot-product path runs wherever the CPU has AVX512-BF16 (the
script sets QKV_DOT_PRODUCTS=on, which also forces it where it would not pay, as on
Intel's cores); elsewhere the "fast" column is the exact one.
Run: python3 bench/bf16_dot_error.py
"""
from __future__ import annotations

import math
import os

if "QKV_DOT_PRODUCTS" not in os.environ:
    with open("/proc/cpuinfo") as cpuinfo:
        if "avx512_bf16" in cpuinfo.read():
            os.environ["QKV_DOT_PRODUCTS"] = "on"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import qkv  # noqa: E402


def emulated_forward(q, k, v, causal, group):
    """Exact bf16 products, float32 sums, P rounded to bf16 before P·V."""
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    out = p.to(torch.bfloat16).float() @ v.float()
    return (out / p.sum(-1, keepdim=True)).to(torch.bfloat16)


def main() -> None:
    torch.manual_seed(0)
    print(f"# QKV_DOT_PRODUCTS={os.environ.get('QKV_DOT_PRODUCTS', 'auto')}, torch {torch.__version__}")
    print("| shape | qkv exact err | qkv fast err | emulation err | torch bf16 err | "
          "round(exact) err | fast/torch err | within 2× |")
    print("|---|---|---|---|---|---|---|---|")
    for heads, kv_heads, n, d, causal in ((8, 8, 1024, 64, False), (8, 8, 1024, 64, True),
                                          (8, 8, 1024, 128, False), (8, 8, 1024, 128, True),
                                          (32, 8, 1024, 64, False), (32, 8, 1024, 128, True),
                                          (8, 8, 4096, 64, True), (8, 8, 2048, 127, False)):
        q = torch.randn(1, heads, n, d).to(torch.bfloat16)
        k, v = (torch.randn(1, kv_heads, n, d).to(torch.bfloat16) for _ in range(2))
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                               is_causal=causal, enable_gqa=True)
        err = lambda x: (x.double() - exact).abs().max().item()  # noqa: E731
        mode = "top_left" if causal else None
        ours_exact = qkv.attention(q, k, v, causal=mode, precision="exact")
        ours_fast = qkv.attention(q, k, v, causal=mode, precision="fast")
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        emulated = emulated_forward(q, k, v, causal, heads // kv_heads)
        shape = f"[1,{heads}{'/' + str(kv_heads) if kv_heads != heads else ''},{n},{d}]"
        print(f"| {shape}{' causal' if causal else ''} | {err(ours_exact):.2e} | "
              f"{err(ours_fast):.2e} | {err(emulated):.2e} | {err(theirs):.2e} | "
              f"{err(exact.to(torch.bfloat16)):.2e} | "
              f"{err(ours_fast) / err(theirs):.2f} | {'yes' if err(ours_fast) <= 2 * err(theirs) else 'NO'} |",
              flush=True)


if __name__ == "__main__":
    main()
