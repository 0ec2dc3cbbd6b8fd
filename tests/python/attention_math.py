"""Attention written out in plain PyTorch from the definitions, for the tests to compare
qkv against (with torch autograd for the gradients), and the tolerance rule they use."""

from __future__ import annotations

import math

import torch

FP32_EPS = float(torch.finfo(torch.float32).eps)


def math_attention(q, k, v, *, causal=None, keep=None, bias=None, scale=None,
                   key_lengths=None):
    """(out, lse) for [B, H, N, d] tensors, every rule as qkv documents it. Differentiable;
    fully masked rows give out 0 and lse -inf with zero gradients."""
    batch, q_heads, q_len, head_dim = q.shape
    k_len = k.shape[2]
    group = q_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    scores = scale * (q @ k.transpose(-1, -2))

    i = torch.arange(q_len).view(1, 1, q_len, 1)
    j = torch.arange(k_len).view(1, 1, 1, k_len)
    valid = torch.full((batch,), k_len) if key_lengths is None else torch.as_tensor(key_lengths)
    valid = valid.view(batch, 1, 1, 1)
    allowed = j < valid
    if causal == "top_left":
        allowed = allowed & (j <= i)
    elif causal == "bottom_right":
        allowed = allowed & (j <= i + (valid - q_len))
    if keep is not None:
        allowed = allowed & keep.bool()
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    scores = scores.masked_fill(~allowed, float("-inf"))

    lse = torch.logsumexp(scores, dim=-1)
    live = (scores > float("-inf")).any(dim=-1, keepdim=True)
    # Softmax of a fully masked row would be NaN (and poison the gradients through
    # torch.where): give such rows finite scores, then zero their weights.
    weights = torch.softmax(torch.where(live, scores, torch.zeros_like(scores)), dim=-1)
    weights = weights * live
    return weights @ v, lse


def max_error(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_no_worse_than_torch(ours, theirs, exact, what: str):
    """qkv's float32 result may be at most twice as far from the exact (fp64) result as
    PyTorch's own float32 result on the same inputs (DESIGN.md §3; FlashAttention's
    tests use the same 2× rule), plus a floor of 8 float32 ulps of the largest exact value
    for when PyTorch happens to be (nearly) exact on a small problem: rounding a correctly
    computed result to float32 alone costs half an ulp, a fused float32 kernel summing a
    few hundred terms a few more."""
    exact = torch.as_tensor(exact).double()
    ours_error = max_error(torch.as_tensor(ours), exact)
    theirs_error = max_error(torch.as_tensor(theirs), exact)
    scale = exact.abs().max().item() if exact.numel() else 0.0
    floor = 8 * FP32_EPS * max(scale, 1e-30)
    assert ours_error <= 2 * theirs_error + floor, (
        f"{what}: qkv's error {ours_error:.3e} > 2 × PyTorch's {theirs_error:.3e} "
        f"+ floor {floor:.3e}"
    )


def assert_close_fp64(ours, exact, what: str):
    """float64 against float64: both sum at most a few hundred products in double, so
    they agree to ~1e-13 relative; 1e-10 leaves room and still catches any wrong term."""
    torch.testing.assert_close(torch.as_tensor(ours), torch.as_tensor(exact), rtol=1e-10,
                               atol=1e-10, msg=lambda m: f"{what}: {m}")
