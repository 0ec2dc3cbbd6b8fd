#!/usr/bin/env python3
"""What native bfloat16 dot products (AVX512-BF16 vdpbf16ps, AMX, NEON BF16) would cost
in accuracy, emulated exactly in float64/float32 arithmetic: why qkv's kernels widen
bfloat16 to float32 instead.

Such an instruction multiplies pairs of bfloat16 values (exactly) and sums them in
float32, so both operands of every block product must be bfloat16. For attention:
  S = Q·Kᵀ: q and k are bfloat16 already; the scale is applied to S in float32 (no
          extra rounding; folding it into q, as the fp32 kernels do, would round
          scale·q unless the scale is a power of two)
  O = P·V: the softmax weights P (float32) must be rounded to bfloat16 first.
The table gives max |error| against float64 on the same bfloat16 inputs for: qkv as
built (float32 inside, out rounded once), the native-bf16 emulation, and PyTorch's
bfloat16 SDPA. Run: python3 bench/bf16_dot_error.py
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import qkv


def native_bf16_forward(q, k, v, causal):
    """The emulated native-bf16 forward: exact products, float32 sums, P rounded to bf16."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = (q.float() @ k.float().transpose(-1, -2)) * scale  # bf16·bf16 products are exact in fp32
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    out = p.to(torch.bfloat16).float() @ v.float()  # P rounded to bf16 for the dot product
    return (out / l).to(torch.bfloat16)


def main() -> None:
    torch.manual_seed(0)
    print("| shape | qkv (fp32 inside) err | native-bf16 emulation err | torch bf16 err | "
          "round(exact) err |")
    print("|---|---|---|---|---|")
    for n, d, causal in ((1024, 64, False), (1024, 64, True), (1024, 128, False),
                         (4096, 64, True)):
        q, k, v = (torch.randn(1, 8, n, d).to(torch.bfloat16) for _ in range(3))
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                               is_causal=causal)
        err = lambda x: (x.double() - exact).abs().max().item()  # noqa: E731
        ours = qkv.attention(q, k, v, causal="top_left" if causal else None)
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        native = native_bf16_forward(q, k, v, causal)
        print(f"| [1,8,{n},{d}]{' causal' if causal else ''} | {err(ours):.2e} | "
              f"{err(native):.2e} | {err(theirs):.2e} | {err(exact.to(torch.bfloat16)):.2e} |")


if __name__ == "__main__":
    main()
