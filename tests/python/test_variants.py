"""Attention variants against PyTorch: the math written with torch ops and autograd in
float64 (window, ALiBi, soft-cap, sinks, dropout with qkv.dropout_mask), forward and
every gradient including dsinks and the ALiBi slopes'; float32 through the cpu kernels within the rule of
test_sdpa.py (at most twice PyTorch's own float32 error on the same math, plus a floor),
float64 through the reference backend to float64 rounding. Plus the drop-in's dropout:
torch.manual_seed reproduces it, the keep rate and the scaling are PyTorch's."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import qkv
import qkv.torch as qt
from attention_math import assert_close_fp64, assert_no_worse_than_torch


def torch_math(q, k, v, *, window=None, alibi=None, softcap=None, sinks=None, dropout=None,
               causal=None):
    """The variants written out in torch (any dtype), [B, H, N, d] with kv heads
    repeated for GQA. dropout: (keep mask [B,H,Nq,Nk], p)."""
    b, h, nq, d = q.shape
    nk = k.shape[2]
    group = h // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    offset = 0 if causal == "top_left" else nk - nq
    if alibi is not None:
        s = s - alibi.to(s.dtype)[None, :, None, None] * (i + (nk - nq) - j).abs()
    allowed = torch.ones(nq, nk, dtype=torch.bool)
    if causal == "top_left":
        allowed &= j <= i
    elif causal == "bottom_right":
        allowed &= j <= i + nk - nq
    if window is not None:
        left, right = window
        if left >= 0:
            allowed &= j >= i + offset - left
        if right >= 0:
            allowed &= j <= i + offset + right
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype)[None, :, None, None].expand(b, h, nq, 1)], -1)
    p = torch.softmax(s, -1)
    if sinks is not None:
        p = p[..., :-1]
    p = torch.nan_to_num(p)  # rows with no key and no sink: weights 0 (qkv's contract)
    if dropout is not None:
        keep, rate = dropout
        # qkv's options hold p in float32 (as PyTorch's dropout_p reaches its kernels).
        p = p * torch.as_tensor(keep) / (1 - float(np.float32(rate)))
    return p @ v


CASES = {
    "window": dict(window=(20, 7)),
    "window_causal_top_left": dict(window=(15, 0), causal="top_left"),
    "alibi": dict(alibi=True),
    "softcap": dict(softcap=3.0),
    "sinks": dict(sinks=True),
    "dropout": dict(dropout=0.2),
    "everything_bottom_right": dict(window=(25, 3), alibi=True, softcap=2.0, sinks=True,
                                    dropout=0.1, causal="bottom_right"),
}


def run_case(name, dtype, backend):
    case = CASES[name]
    torch.manual_seed(1)
    b, h, hk, nq, nk, d = 2, 4, 2, 70, 90, 16
    q, k, v = torch.randn(b, h, nq, d), torch.randn(b, hk, nk, d), torch.randn(b, hk, nk, d)
    alibi = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if case.get("alibi") else None
    sinks = torch.tensor([0.4, -0.2, 1.0, 0.0]) if case.get("sinks") else None
    rate = case.get("dropout")
    keep = qkv.dropout_mask(b, h, nq, nk, rate, seed=77) if rate else None
    weight = torch.randn(b, h, nq, d, dtype=torch.float64)

    def ours(q, k, v, sinks_leaf, slopes_leaf):
        return qkv.attention(q, k, v, causal=case.get("causal"), window=case.get("window"),
                             alibi_slopes=slopes_leaf, softcap=case.get("softcap"), sinks=sinks_leaf,
                             dropout_p=rate or 0.0, seed=77, backend=backend)

    def theirs(q, k, v, sinks_leaf, slopes_leaf):
        return torch_math(q, k, v, window=case.get("window"), alibi=slopes_leaf,
                          softcap=case.get("softcap"), sinks=sinks_leaf,
                          dropout=(keep, rate) if rate else None, causal=case.get("causal"))

    def grads(fn, dt):
        """[(name, tensor)]: out, dq, dk, dv, then dsinks and dalibi where the case has them
        (sinks and slopes are float32 leaves for qkv, as its options hold them)."""
        leaves = [x.detach().to(dt).clone().requires_grad_() for x in (q, k, v)]
        per_head = torch.float32 if fn is ours else dt
        sink_leaf = None if sinks is None else sinks.detach().to(per_head).clone().requires_grad_()
        slope_leaf = None if alibi is None else alibi.detach().to(per_head).clone().requires_grad_()
        out = fn(*leaves, sink_leaf, slope_leaf)
        out.backward(weight.to(dt))
        result = [("out", out.detach())] + list(zip(("dq", "dk", "dv"), (x.grad for x in leaves)))
        if sink_leaf is not None:
            result.append(("dsinks", sink_leaf.grad))
        if slope_leaf is not None:
            result.append(("dalibi", slope_leaf.grad))
        return result

    return grads(ours, dtype), grads(theirs, torch.float32), grads(theirs, torch.float64)


@pytest.mark.parametrize("name", list(CASES))
def test_float32_kernels_against_torch_math(name):
    ours, theirs, exact = run_case(name, torch.float32, "cpu")
    assert [w for w, _ in ours] == [w for w, _ in exact]
    for (what, a), (_, b), (_, c) in zip(ours, theirs, exact):
        assert torch.isfinite(a).all(), what
        assert_no_worse_than_torch(a, b, c, f"{what} ({name})")


@pytest.mark.parametrize("name", list(CASES))
def test_float64_reference_equals_torch_math(name):
    ours, _, exact = run_case(name, torch.float64, "reference")
    assert [w for w, _ in ours] == [w for w, _ in exact]
    for (what, a), (_, c) in zip(ours[:4], exact[:4]):
        assert_close_fp64(a, c, f"{what} ({name})")
    for (what, a), (_, c) in zip(ours[4:], exact[4:]):
        # dsinks and dalibi come back as float32 (the per-head values are float32)
        torch.testing.assert_close(a.double(), c, rtol=1e-6, atol=1e-6, msg=f"{what} ({name})")


def test_numpy_backward_returns_dsinks_and_matches_torch():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 20, 8)).astype(np.float32) for _ in range(3))
    sinks = np.array([0.5, -1.0], dtype=np.float32)
    out, lse = qkv.attention(q, k, v, sinks=sinks, window=(4, 4), return_lse=True)
    dq, dk, dv, dsinks = qkv.attention_backward(q, k, v, out, lse, np.ones_like(out), sinks=sinks,
                                                window=(4, 4))
    leaves = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
    s = torch.from_numpy(sinks).requires_grad_()
    t_out = qkv.attention(*leaves, sinks=s, window=(4, 4))
    t_out.sum().backward()
    np.testing.assert_array_equal(out, t_out.detach().numpy())
    np.testing.assert_array_equal(dsinks, s.grad.numpy())
    np.testing.assert_array_equal(dq, leaves[0].grad.numpy())


def test_varlen_variants_match_dense_per_sequence():
    torch.manual_seed(3)
    lengths = [7, 64, 33]
    cu = torch.tensor([0, 7, 71, 104], dtype=torch.int32)
    q, k, v = (torch.randn(104, 2, 16, dtype=torch.float64) for _ in range(3))
    sinks = torch.tensor([0.2, -0.3], dtype=torch.float32, requires_grad=True)
    kw = dict(window=(10, 2), alibi_slopes=[0.3, 0.1], softcap=4.0, causal="bottom_right")
    packed = qkv.varlen_attention(q, k, v, cu, cu, sinks=sinks, **kw)
    packed.sum().backward()
    dense_grad = torch.zeros(2, dtype=torch.float32)
    for s, n in enumerate(lengths):
        sl = slice(int(cu[s]), int(cu[s]) + n)
        leaf = sinks.detach().clone().requires_grad_()
        dense = qkv.attention(*(x[sl].transpose(0, 1)[None] for x in (q, k, v)), sinks=leaf, **kw)
        assert_close_fp64(packed[sl].detach(), dense[0].transpose(0, 1).detach(), f"sequence {s}")
        dense.sum().backward()
        dense_grad += leaf.grad
    torch.testing.assert_close(sinks.grad, dense_grad, rtol=1e-6, atol=1e-6)


def test_sdpa_dropout_is_reproducible_and_scaled_like_pytorch():
    q, k, v = (torch.randn(2, 4, 64, 16) for _ in range(3))
    torch.manual_seed(5)
    a = qt.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
    torch.manual_seed(5)
    b = qt.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
    c = qt.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # With v = 1 each output is Σ_j P_ij·Z_ij: its mean over rows and seeds is 1.
    ones = torch.ones(2, 4, 64, 16)
    outs = torch.stack([qt.scaled_dot_product_attention(q, k, ones, dropout_p=0.25)[..., 0]
                        for _ in range(20)])
    standard_error = outs.std().item() / math.sqrt(outs.numel())
    assert abs(outs.mean().item() - 1.0) < 5 * standard_error
    # Gradients flow (the backward regenerates the mask from the forward's seed).
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    qt.scaled_dot_product_attention(*leaves, dropout_p=0.25).sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in leaves)


def test_dropout_mask_keep_rate():
    keep = qkv.dropout_mask(2, 3, 100, 100, 0.3, seed=1)
    n = keep.size
    assert abs(keep.mean() - 0.7) < 5 * math.sqrt(0.21 / n)
    assert not np.array_equal(keep, qkv.dropout_mask(2, 3, 100, 100, 0.3, seed=2))


def test_variant_errors():
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(qkv.Error, match="options.alibi_slopes: expected one value per query head"):
        qkv.attention(q, q, q, alibi_slopes=[1.0])
    with pytest.raises(qkv.Error, match="options.window"):
        qkv.attention(q, q, q, window=(-3, 0))
    with pytest.raises(TypeError, match="window: expected"):
        qkv.attention(q, q, q, window=5)
    with pytest.raises(qkv.Error, match="seed: required"):
        qkv.attention_backward(q, q, q, q, torch.zeros(1, 2, 5), q, dropout_p=0.1)
    # Differentiable slopes (torch) get their gradient.
    slopes = torch.ones(2, requires_grad=True)
    out = qkv.attention(q.requires_grad_(), q, q, alibi_slopes=slopes)
    out.sum().backward()
    assert slopes.grad is not None and slopes.grad.shape == (2,)


def test_varlen_alibi_slope_gradient_is_the_sum_over_its_sequences():
    # Packed sequences of lengths 37 and 70 (queries 37 and 50, bottom-right aligned): the
    # slopes' gradient is the sum of the dense per-sequence calls' gradients.
    torch.manual_seed(3)
    lens_q, lens_k = [37, 50], [37, 70]
    q = torch.randn(sum(lens_q), 4, 16)
    k, v = torch.randn(sum(lens_k), 2, 16), torch.randn(sum(lens_k), 2, 16)
    weight = torch.randn(sum(lens_q), 4, 16)
    base = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    cu_q = torch.tensor([0, 37, 87], dtype=torch.int32)
    cu_k = torch.tensor([0, 37, 107], dtype=torch.int32)
    slopes = base.clone().requires_grad_()
    out = qkv.varlen_attention(q, k, v, cu_q, cu_k, alibi_slopes=slopes, causal="bottom_right")
    (out * weight).sum().backward()
    expected = torch.zeros(4)
    for s in range(2):
        per_seq = base.clone().requires_grad_()
        qs = q[cu_q[s]:cu_q[s + 1]].transpose(0, 1)[None]
        ks, vs = (x[cu_k[s]:cu_k[s + 1]].transpose(0, 1)[None] for x in (k, v))
        o = qkv.attention(qs, ks, vs, alibi_slopes=per_seq, causal="bottom_right")
        (o * weight[cu_q[s]:cu_q[s + 1]].transpose(0, 1)[None]).sum().backward()
        expected += per_seq.grad
    assert expected.abs().max() > 1e-2  # a real gradient, not zeros on both sides
    torch.testing.assert_close(slopes.grad, expected, rtol=1e-5, atol=1e-5)
