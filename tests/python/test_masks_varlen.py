"""Masks as transformers sends them, and varlen attention, against PyTorch.

Masks: padding as bool [B,1,N,N] / [B,1,1,N] and float [B,1,N,N] with finfo.min, causal
plus left padding in one float mask (whose padding rows have no key above finfo.min:
PyTorch averages their values, and qkv must give the same), through
qkv.torch.scaled_dot_product_attention, forward and gradients, with the rule of
test_sdpa.py (error against float64 at most twice PyTorch's). The float64 yardstick is
the math written out with autograd (attention_math.math_attention), not torch's SDPA in
float64: that runs PyTorch's CPU flash kernel, whose backward multiplies the gradients
of rows without a normal key by their key count (their LSE, finfo.min + log n, rounds
to finfo.min).

Varlen: every packed sequence against torch SDPA on that sequence alone (float64:
the two must agree to float64 rounding), gradients through autograd, NumPy's backward
entry point, and the errors naming cu_seqlens entries."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import qkv
import qkv.torch as qt
from attention_math import assert_close_fp64, assert_no_worse_than_torch, math_attention

FINFO_MIN = torch.finfo(torch.float32).min


def padding_masks(batch, n, lengths):
    valid = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    left_valid = torch.arange(n)[None, :] >= (n - torch.tensor(lengths))[:, None]
    left_causal = torch.zeros(batch, 1, n, n).masked_fill(
        ~(left_valid[:, None, None, :] & causal), FINFO_MIN)
    return {
        "bool [B,1,1,N]": valid[:, None, None, :],
        "bool [B,1,N,N]": valid[:, None, None, :].expand(batch, 1, n, n).contiguous(),
        "float [B,1,N,N] finfo.min": torch.zeros(batch, 1, n, n).masked_fill(
            ~valid[:, None, None, :], FINFO_MIN),
        "causal + left padding, float finfo.min": left_causal,
    }


def math_sdpa(q, k, v, attn_mask):
    """The definition in float64 (attention_math), taking an SDPA-style mask."""
    if attn_mask.dtype == torch.bool:
        return math_attention(q, k, v, keep=attn_mask)[0]
    return math_attention(q, k, v, bias=attn_mask)[0]


def grads_of(fn, q, k, v, mask, weight, dtype):
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    m = mask.to(dtype) if mask.is_floating_point() else mask
    out = fn(*leaves, attn_mask=m)
    out.backward(weight.to(dtype))
    return [out.detach()] + [x.grad for x in leaves]


@pytest.mark.parametrize("name", list(padding_masks(1, 4, [4])))
def test_padding_masks_match_torch(name):
    batch, heads, n, d = 3, 4, 130, 32
    q, k, v = (torch.randn(batch, heads, n, d) for _ in range(3))
    mask = padding_masks(batch, n, [130, 70, 1])[name]
    weight = torch.randn(batch, heads, n, d, dtype=torch.float64)
    ours = grads_of(qt.scaled_dot_product_attention, q, k, v, mask, weight, torch.float32)
    theirs = grads_of(F.scaled_dot_product_attention, q, k, v, mask, weight, torch.float32)
    exact = grads_of(math_sdpa, q, k, v, mask, weight, torch.float64)
    for what, a, b, c in zip(("out", "dq", "dk", "dv"), ours, theirs, exact):
        assert torch.isfinite(a).all(), what
        assert_no_worse_than_torch(a, b, c, f"{what} ({name})")


def test_rows_without_a_normal_key_average_like_pytorch():
    """A row whose every key has finfo.min (a left-padded query under a causal mask):
    PyTorch's math gives the plain average of the values (all logits round to
    finfo.min), and its gradients are those of that uniform softmax. qkv gives both.
    (PyTorch's own CPU flash backward scales these rows' gradients by the number of
    keys, which is why the float64 math is the yardstick here.)"""
    batch, heads, n, d = 2, 2, 70, 16
    q, k, v = (torch.randn(batch, heads, n, d) for _ in range(3))
    mask = padding_masks(batch, n, [70, 30])["causal + left padding, float finfo.min"]
    weight = torch.randn(batch, heads, n, d, dtype=torch.float64)
    ours = grads_of(qt.scaled_dot_product_attention, q, k, v, mask, weight, torch.float32)
    exact = grads_of(math_sdpa, q, k, v, mask, weight, torch.float64)
    # Entry 1's first 40 rows see only padding keys: every key of the row (the causal
    # future too) carries finfo.min, so the output is the mean of all of v.
    for i in range(40):
        expected = v[1].mean(dim=1)
        torch.testing.assert_close(ours[0][1, :, i], expected, atol=2e-6, rtol=1e-5)
    for what, a, c in zip(("out", "dq", "dk", "dv"), ours, exact):
        err = (a.double() - c).abs().max().item()
        assert err < 2e-5, f"{what}: {err}"


def packed(lengths_q, lengths_k, heads, kv_heads, d, dtype):
    cu_q = torch.tensor([0] + np.cumsum(lengths_q).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + np.cumsum(lengths_k).tolist(), dtype=torch.int64)
    q = torch.randn(int(cu_q[-1]), heads, d, dtype=dtype)
    k = torch.randn(int(cu_k[-1]), kv_heads, d, dtype=dtype)
    v = torch.randn(int(cu_k[-1]), kv_heads, d, dtype=dtype)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_varlen_matches_torch_per_sequence(causal, backend):
    lengths_q, lengths_k = [0, 1, 63, 64, 65, 9], [0, 1, 63, 64, 65, 20]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, 4, 2, 16, torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    dtype = torch.float64 if backend == "reference" else torch.float32
    ours_in = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out = qkv.varlen_attention(*ours_in, cu_q, cu_k, causal=causal, backend=backend)
    weight = torch.randn(out.shape, dtype=torch.float64)
    out.backward(weight.to(dtype))
    expected_out, expected_grads = torch.zeros_like(q), [torch.zeros_like(x) for x in (q, k, v)]
    for s in range(len(lengths_q)):
        qs, ks = slice(int(cu_q[s]), int(cu_q[s + 1])), slice(int(cu_k[s]), int(cu_k[s + 1]))
        if qs.start == qs.stop:
            continue
        sub = [leaves[0][qs], leaves[1][ks], leaves[2][ks]]
        nq, nk = qs.stop - qs.start, ks.stop - ks.start
        mask = None
        if causal is not None:
            shift = 0 if causal == "top_left" else nk - nq
            mask = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + shift
        o = F.scaled_dot_product_attention(*(x.transpose(0, 1) for x in sub), attn_mask=mask,
                                           enable_gqa=True).transpose(0, 1)
        if mask is not None:  # torch gives NaN for rows with no key; qkv's contract is 0
            o = torch.where(mask.any(-1)[:, None, None], o, torch.zeros_like(o))
        expected_out[qs] = o.detach()
        o.backward(weight[qs])
    for x, g in zip(leaves, expected_grads):
        g.copy_(torch.nan_to_num(x.grad) if x.grad is not None else g)
    if backend == "reference":
        assert_close_fp64(out.detach(), expected_out, "out")
        for name, a, b in zip("qkv", ours_in, expected_grads):
            assert_close_fp64(a.grad, b, f"d{name}")
    else:  # float32 kernels: O(1) values, sums over ≤ 65 keys
        assert (out.detach().double() - expected_out).abs().max() < 1e-5
        for name, a, b in zip("qkv", ours_in, expected_grads):
            assert (a.grad.double() - b).abs().max() < 2e-5, name


def test_varlen_numpy_forward_and_backward_agree_with_torch_path():
    q, k, v, cu_q, cu_k = packed([5, 40], [7, 33], 2, 1, 8, torch.float32)
    out, lse = qkv.varlen_attention(q.numpy(), k.numpy(), v.numpy(), cu_q.numpy(),
                                    cu_k.numpy().tolist(), return_lse=True)
    assert isinstance(out, np.ndarray) and out.shape == (45, 2, 8) and lse.shape == (2, 45)
    dout = np.ones_like(out)
    dq, dk, dv = qkv.varlen_attention_backward(q.numpy(), k.numpy(), v.numpy(), out, lse, dout,
                                               cu_q.numpy(), cu_k.numpy())
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    t_out = qkv.varlen_attention(*leaves, cu_q, cu_k)
    t_out.backward(torch.ones_like(t_out))
    np.testing.assert_array_equal(out, t_out.detach().numpy())
    for a, b in zip((dq, dk, dv), leaves):
        np.testing.assert_array_equal(a, b.grad.numpy())


def test_varlen_errors_name_the_argument():
    q, k, v, cu_q, cu_k = packed([3, 4], [5, 2], 2, 1, 8, torch.float32)
    with pytest.raises(qkv.Error, match=r"cu_seqlens_q\[1\]: expected >= cu_seqlens_q\[0\]"):
        qkv.varlen_attention(q, k, v, [0, -1, 7], cu_k)
    with pytest.raises(qkv.Error, match=r"cu_seqlens_k\[2\]: expected 7"):
        qkv.varlen_attention(q, k, v, cu_q, [0, 5, 6])
    with pytest.raises(TypeError, match="cu_seqlens_q: expected dtype int32 or int64"):
        qkv.varlen_attention(q, k, v, cu_q.float(), cu_k)
    with pytest.raises(qkv.Error, match="max_seqlen_k"):
        qkv.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_k=4)
    with pytest.raises(qkv.Error, match="3 dimensions"):
        qkv.varlen_attention(q[None], k, v, cu_q, cu_k)
