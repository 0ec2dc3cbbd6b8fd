"""torch.autograd.gradcheck in float64: qkv's analytic gradients (the reference
backend's explicit-Jacobian backward, which float64 always runs on) against central
finite differences of qkv's own forward. Small shapes: gradcheck costs two forward
calls per input element."""

from __future__ import annotations

import pytest
import torch

import qkv
import qkv.torch as qt


def leaves(*shapes):
    return tuple(torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in shapes)


CASES = [
    ("plain", dict()),
    ("top_left, Nq > Nk", dict(causal="top_left", q_len=4, k_len=3)),
    ("bottom_right, Nq < Nk", dict(causal="bottom_right", q_len=2, k_len=4)),
    ("gqa, dv != d", dict(q_heads=4, kv_heads=2, v_dim=2)),
    ("bool mask with a fully masked row", dict(mask="bool")),
    ("float mask", dict(mask="float")),
    ("key_lengths + bottom_right", dict(key_lengths=[2, 3], causal="bottom_right")),
    ("scale", dict(scale=1.7)),
]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_attention_gradcheck(case, layout):
    spec = dict(batch=2, q_heads=2, kv_heads=2, q_len=3, k_len=3, head_dim=3, v_dim=3)
    spec.update(case[1])
    mask, key_lengths = spec.pop("mask", None), spec.pop("key_lengths", None)
    causal, scale = spec.pop("causal", None), spec.pop("scale", None)
    b, hq, hkv, nq, nk, d, dv = spec.values()
    if mask == "bool":
        mask = torch.rand(b, 1, nq, nk) > 0.3
        mask[0, 0, 1] = False
    elif mask == "float":
        mask = torch.randn(hq, nq, nk, dtype=torch.float64)
        mask[0, 0, 0] = float("-inf")

    def arrange(x):  # bshd tensors are the same numbers, laid out [B, N, H, d]
        return x.transpose(1, 2) if layout == "bshd" else x

    q, k, v = leaves((b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, dv))

    def f(q, k, v):
        return qkv.attention(arrange(q), arrange(k), arrange(v), causal=causal, mask=mask,
                             scale=scale, key_lengths=key_lengths, layout=layout)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_sdpa_gradcheck_with_broadcasting_and_gqa():
    q, k, v = leaves((2, 4, 3, 3), (1, 2, 4, 3), (1, 2, 4, 2))
    mask = torch.rand(3, 4) > 0.2

    def f(q, k, v):
        return qt.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_sdpa_gradcheck_causal_3d():
    q, k, v = leaves((2, 4, 3), (2, 4, 3), (2, 4, 3))
    assert torch.autograd.gradcheck(
        lambda q, k, v: qt.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v))


def test_gradcheck_would_catch_a_wrong_gradient():
    """The check has teeth: the same function with its dq scaled by 1.01 fails."""
    q, k, v = leaves((1, 1, 3, 3), (1, 1, 3, 3), (1, 1, 3, 3))

    class Skewed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            with torch.enable_grad():
                ctx.inputs = [x.detach().requires_grad_() for x in (q, k, v)]
                ctx.out = qkv.attention(*ctx.inputs)
            return ctx.out.detach()

        @staticmethod
        def backward(ctx, dout):
            grads = torch.autograd.grad(ctx.out, ctx.inputs, dout, retain_graph=True)
            return grads[0] * 1.01, grads[1], grads[2]

    assert not torch.autograd.gradcheck(Skewed.apply, (q, k, v), raise_exception=False)
