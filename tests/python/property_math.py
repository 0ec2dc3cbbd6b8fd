"""Attention with every mask and variant written out in plain PyTorch, for the property
tests (test_properties.py): in float64 it is an independent exact result to check qkv's
reference backend against, in float32 the "plain unfused fp32 implementation" that the
accuracy bound of docs/numerics.md is stated relative to (products summed in order, like
tests/cpp/plain_fp32.hpp). Differentiable (torch autograd)."""

from __future__ import annotations

import math

import torch


def sequential_matmul(a, b):
    """a @ b summed term by term in a's dtype, as a plain loop does (tests/cpp/plain_fp32.hpp):
    the yardstick of docs/numerics.md's bound is that loop, whose error grows with the length of
    the sum, not a blocked GEMM's (PyTorch's float32 matmul is several times more exact at
    d = 256, which would make the 2x rule a rule about summation order)."""
    if a.shape[-1] == 0:  # an empty sum (no keys): zeros that autograd still tracks
        return torch.matmul(a, b)
    total = a[..., 0:1] * b[..., 0:1, :]
    for c in range(1, a.shape[-1]):
        total = total + a[..., c:c + 1] * b[..., c:c + 1, :]
    return total


def plain_attention(q, k, v, *, causal=None, keep=None, bias=None, key_lengths=None, scale=None,
                    window=None, softcap=None, alibi=None, sinks=None, return_weights=False):
    """out [B, Hq, Nq, dv] for q [B, Hq, Nq, d], k [B, Hkv, Nk, d], v [B, Hkv, Nk, dv], every
    rule as qkv documents it (qkv.attention's docstring): causal "top_left" / "bottom_right"
    (bottom-right against each entry's valid length), key_lengths, keep (bool, broadcast)
    and bias (float, added after softcap and ALiBi), window (left, right) with -1 unbounded,
    ALiBi slopes per query head, sinks per query head. A row with no key and no sink gives
    0 with zero gradients. return_weights: (out, the weights P [B, Hq, Nq, Nk])."""
    batch, q_heads, q_len, head_dim = q.shape
    k_len = k.shape[2]
    group = q_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    matmul = torch.matmul if q.dtype == torch.float64 else sequential_matmul
    s = scale * matmul(q, k.transpose(-1, -2))
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(q_len).view(1, 1, q_len, 1)
    j = torch.arange(k_len).view(1, 1, 1, k_len)
    valid = torch.full((batch,), k_len) if key_lengths is None else torch.as_tensor(key_lengths)
    valid = valid.view(batch, 1, 1, 1)
    # Queries meet the keys bottom-right (their last one aligned with the last valid key)
    # unless causal is top_left; ALiBi is always bottom-right aligned.
    offset = torch.zeros_like(valid) if causal == "top_left" else valid - q_len
    if alibi is not None:
        s = s - alibi.to(s.dtype).view(1, q_heads, 1, 1) * (i + (valid - q_len) - j).abs()
    allowed = j < valid
    if causal == "top_left":
        allowed = allowed & (j <= i)
    elif causal == "bottom_right":
        allowed = allowed & (j <= i + valid - q_len)
    if window is not None:
        left, right = window
        if left is not None and left >= 0:
            allowed = allowed & (j >= i + offset - left)
        if right is not None and right >= 0:
            allowed = allowed & (j <= i + offset + right)
    if keep is not None:
        allowed = allowed & keep.bool()
    if bias is not None:
        s = s + bias.to(s.dtype)
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        column = sinks.to(s.dtype).view(1, q_heads, 1, 1).expand(batch, q_heads, q_len, 1)
        s = torch.cat([s, column], dim=-1)
    live = (s > float("-inf")).any(dim=-1, keepdim=True)
    # Softmax of a row with nothing in it would be NaN (and poison the gradients through
    # torch.where): give such rows finite scores, then zero their weights.
    p = torch.softmax(torch.where(live, s, torch.zeros_like(s)), dim=-1) * live
    if sinks is not None:
        p = p[..., :-1]
    out = matmul(p, v)
    return (out, p) if return_weights else out


def max_error(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return (a - b).abs().max().item() if a.numel() else 0.0


def largest(x) -> float:
    x = torch.as_tensor(x).double()
    return x.abs().max().item() if x.numel() else 0.0
