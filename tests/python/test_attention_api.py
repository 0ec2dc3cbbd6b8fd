"""qkv.attention, qkv.attention_backward and qkv.attention_weights on NumPy arrays and
torch tensors, against the plain-math oracle (float64 torch with autograd)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv
from attention_math import assert_close_fp64, assert_no_worse_than_torch, math_attention

# (name, batch, q_heads, kv_heads, q_len, k_len, head_dim, v_dim)
SHAPES = [
    ("plain", 2, 3, 3, 8, 8, 16, 16),
    ("gqa, Nq < Nk, dv != d", 2, 4, 2, 5, 9, 8, 3),
    ("Nq > Nk", 1, 2, 1, 9, 4, 7, 7),
]
OPTIONS = [
    ("none", {}),
    ("top_left", dict(causal="top_left")),
    ("bottom_right", dict(causal="bottom_right")),
    ("key_lengths", dict(key_lengths=[3, 1])),
    ("bottom_right + key_lengths", dict(causal="bottom_right", key_lengths=[2, 0])),
    ("bool mask", dict(mask="bool")),
    ("float mask", dict(mask="float")),
    ("scale", dict(scale=0.3)),
]


def inputs(rng, shape, dtype):
    _, batch, q_heads, kv_heads, q_len, k_len, head_dim, v_dim = shape
    q = rng.standard_normal((batch, q_heads, q_len, head_dim)).astype(dtype)
    k = rng.standard_normal((batch, kv_heads, k_len, head_dim)).astype(dtype)
    v = rng.standard_normal((batch, kv_heads, k_len, v_dim)).astype(dtype)
    return q, k, v


def concrete(rng, options, q, k):
    """The options with masks made for these shapes (key lengths clipped to Nk)."""
    options = dict(options)
    batch, q_heads, q_len, _ = q.shape
    k_len = k.shape[2]
    if options.get("mask") == "bool":
        mask = rng.random((batch, 1, q_len, k_len)) > 0.3
        mask[0, 0, 0] = False  # a fully masked row
        options["mask"] = mask
    elif options.get("mask") == "float":
        # Values exact in float32 (qkv adds masks in float32), -inf removes keys.
        bias = rng.standard_normal((q_heads, q_len, k_len)).astype(np.float32)
        bias[:, 0, 1:] = -np.inf
        options["mask"] = bias
    if "key_lengths" in options:
        options["key_lengths"] = [min(n, k_len) for n in options["key_lengths"]][:batch]
        options["key_lengths"] += [k_len] * (batch - len(options["key_lengths"]))
    return options


def oracle(q, k, v, options, dout=None, dtype=torch.float64):
    """out, lse and (given dout) dq, dk, dv from math_attention with torch autograd."""
    leaves = [torch.tensor(x, dtype=dtype, requires_grad=True) for x in (q, k, v)]
    mask = options.get("mask")
    keep = bias = None
    if mask is not None:
        if mask.dtype == np.bool_:
            keep = torch.from_numpy(mask)
        else:
            bias = torch.from_numpy(mask)
    out, lse = math_attention(*leaves, causal=options.get("causal"), keep=keep, bias=bias,
                              scale=options.get("scale"),
                              key_lengths=options.get("key_lengths"))
    if dout is None:
        return out.detach(), lse.detach()
    out.backward(torch.tensor(dout, dtype=dtype))
    return out.detach(), lse.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("option", OPTIONS, ids=[o[0] for o in OPTIONS])
def test_numpy_float64_forward_and_backward_are_exact(rng, shape, option):
    q, k, v = inputs(rng, shape, np.float64)
    options = concrete(rng, option[1], q, k)
    out, lse = qkv.attention(q, k, v, return_lse=True, **options)
    assert isinstance(out, np.ndarray) and out.dtype == np.float64
    dout = rng.standard_normal(out.shape)
    dq, dk, dv = qkv.attention_backward(q, k, v, out, lse, dout, **options)
    ref_out, ref_lse, ref_grads = oracle(q, k, v, options, dout)
    assert_close_fp64(out, ref_out, "out")
    assert_close_fp64(lse, ref_lse, "lse")  # -inf where fully masked, on both sides
    for name, ours, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        assert ours.shape == ref.shape
        assert_close_fp64(ours, ref, name)


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("option", OPTIONS, ids=[o[0] for o in OPTIONS])
def test_float32_is_no_worse_than_torch(rng, backend, shape, option):
    """float32 through each backend: error against float64 at most 2× that of the same
    math done by PyTorch in float32."""
    q, k, v = inputs(rng, shape, np.float32)
    options = concrete(rng, option[1], q, k)
    out, lse = qkv.attention(q, k, v, return_lse=True, backend=backend, **options)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    dout = rng.standard_normal(out.shape).astype(np.float32)
    grads = qkv.attention_backward(q, k, v, out, lse, dout, backend=backend, **options)
    exact = oracle(q, k, v, options, dout)
    theirs = oracle(q, k, v, options, dout, dtype=torch.float32)
    assert_no_worse_than_torch(out, theirs[0], exact[0], "out")
    finite = np.isfinite(exact[1].numpy())
    assert np.array_equal(np.isfinite(lse), finite)
    assert_no_worse_than_torch(torch.from_numpy(lse[finite]), theirs[1][finite],
                               exact[1][finite], "lse")
    for name, ours, t, e in zip(("dq", "dk", "dv"), grads, theirs[2], exact[2]):
        assert_no_worse_than_torch(ours, t, e, name)


def test_bshd_layout_is_the_transpose_of_bhsd(rng, backend):
    q, k, v = inputs(rng, SHAPES[1], np.float32)
    bhsd = qkv.attention(q, k, v, causal="bottom_right", backend=backend)
    q2, k2, v2 = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v))
    bshd, lse = qkv.attention(q2, k2, v2, causal="bottom_right", backend=backend,
                              layout="bshd", return_lse=True)
    assert bshd.shape == (2, 5, 4, 3) and lse.shape == (2, 4, 5)
    np.testing.assert_array_equal(bshd, bhsd.transpose(0, 2, 1, 3))
    dout = rng.standard_normal(bshd.shape).astype(np.float32)
    grads = qkv.attention_backward(q2, k2, v2, bshd, lse, dout, causal="bottom_right",
                                   backend=backend, layout="bshd")
    grads_bhsd = qkv.attention_backward(q, k, v, bhsd, lse, dout.transpose(0, 2, 1, 3),
                                        causal="bottom_right", backend=backend)
    for ours, ref, x in zip(grads, grads_bhsd, (q2, k2, v2)):
        assert ours.shape == x.shape
        np.testing.assert_array_equal(ours, ref.transpose(0, 2, 1, 3))


def test_torch_attention_is_differentiable(backend):
    """qkv.attention on torch tensors records autograd; its gradients are those of
    attention_backward, exactly (the same library call)."""
    q, k, v = (torch.randn(2, 4, 6, 8, requires_grad=True) for _ in range(3))
    mask = torch.rand(2, 1, 6, 6) > 0.2
    out, lse = qkv.attention(q, k, v, mask=mask, causal="bottom_right", return_lse=True,
                             backend=backend)
    assert isinstance(out, torch.Tensor) and out.requires_grad and not lse.requires_grad
    dout = torch.randn_like(out)
    out.backward(dout)
    dq, dk, dv = qkv.attention_backward(q.detach(), k.detach(), v.detach(), out.detach(), lse,
                                        dout, mask=mask, causal="bottom_right", backend=backend)
    assert torch.equal(q.grad, dq) and torch.equal(k.grad, dk) and torch.equal(v.grad, dv)


def test_with_and_without_autograd_give_the_same_result():
    """Inputs that need no graph skip the dispatcher; the numbers are the same."""
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    plain = qkv.attention(q, k, v, causal="top_left")
    tracked = qkv.attention(q.requires_grad_(), k, v, causal="top_left")
    assert plain.grad_fn is None and tracked.grad_fn is not None
    assert torch.equal(plain, tracked.detach())
    with torch.no_grad():
        assert qkv.attention(q, k, v, causal="top_left").grad_fn is None


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_empty_extents(kind):
    """Batch, query and key lengths may be 0 (NumPy gives such arrays all-zero strides);
    with no keys every row is fully masked: output 0, lse -inf."""
    def make(*shape):
        x = np.ones(shape, np.float32)
        return torch.from_numpy(x) if kind == "torch" else x
    assert qkv.attention(make(2, 4, 0, 8), make(2, 4, 6, 8), make(2, 4, 6, 3)).shape == (2, 4, 0, 3)
    assert qkv.attention(make(0, 4, 5, 8), make(0, 4, 6, 8), make(0, 4, 6, 3)).shape == (0, 4, 5, 3)
    out, lse = qkv.attention(make(2, 4, 5, 8), make(2, 4, 0, 8), make(2, 4, 0, 3),
                             return_lse=True)
    assert (np.asarray(out) == 0).all() and (np.asarray(lse) == -np.inf).all()


def test_attention_weights_are_the_softmax_rows(rng):
    q, k, v = inputs(rng, SHAPES[1], np.float64)
    mask = rng.random((2, 1, 5, 9)) > 0.4
    mask[1, 0, 2] = False
    weights = qkv.attention_weights(q, k, v, mask=mask, causal="bottom_right")
    assert weights.shape == (2, 4, 5, 9) and weights.dtype == np.float64
    sums = weights.sum(-1)
    # Each row is a probability vector, or all zeros where every key is removed.
    assert np.all(np.isclose(sums, 1.0, rtol=1e-14) | (sums == 0.0))
    assert np.all(weights[1, :, 2] == 0) and np.all(weights >= 0)
    # P·v is the forward's output (GQA: query heads 2h, 2h+1 read kv head h).
    out = qkv.attention(q, k, v, mask=mask, causal="bottom_right")
    np.testing.assert_allclose(weights @ np.repeat(v, 2, axis=1), out, rtol=1e-12, atol=1e-14)


def test_attention_weights_float32_torch_tensor():
    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    weights = qkv.attention_weights(q, k, v, scale=0.5)
    exact = torch.softmax(0.5 * q.double() @ k.double().transpose(-1, -2), dim=-1)
    assert isinstance(weights, torch.Tensor) and weights.dtype == torch.float32
    # The reference computes in float64 and rounds once: within one float32 ulp (2^-24
    # relative, since weights are in [0, 1]).
    torch.testing.assert_close(weights.double(), exact, rtol=2**-23, atol=2**-24)


def test_outputs_keep_the_callers_type_and_dtype():
    for dtype in (np.float32, np.float64):
        q = np.ones((1, 1, 2, 3), dtype)
        out, lse = qkv.attention(q, q, q, return_lse=True)
        assert type(out) is np.ndarray and out.dtype == dtype and lse.dtype == dtype
    for dtype in (torch.float32, torch.float64):
        q = torch.ones(1, 1, 2, 3, dtype=dtype)
        out, lse = qkv.attention(q, q, q, return_lse=True)
        assert type(out) is torch.Tensor and out.dtype == dtype and lse.dtype == dtype


def test_read_only_numpy_inputs_are_accepted():
    q = np.ones((1, 1, 2, 3), np.float32)
    q.setflags(write=False)
    np.testing.assert_allclose(qkv.attention(q, q, q), 1.0)


def test_check_finite_names_the_element():
    q = np.zeros((1, 2, 3, 4), np.float32)
    v = q.copy()
    v[0, 1, 2, 3] = -np.inf  # [batch, heads, seq, dim]; the library names [b, seq, h, d]
    with pytest.raises(ValueError, match=r"check_finite: v\[0, 2, 1, 3\] is -inf"):
        qkv.attention(q, q, v, check_finite=True)
    out = qkv.attention(q, q, v)  # without it, the -inf reaches only the rows that read it
    assert np.isfinite(out[0, 0]).all() and not np.isfinite(out[0, 1, :, 3]).any()


def test_available_backends():
    backends = qkv.available_backends()
    assert backends[:2] == ("auto", "reference")
    assert set(backends) <= {"auto", "reference", "cpu"}
