"""bfloat16 and float16: qkv against PyTorch's SDPA on the same half-precision inputs,
both judged against the exact (float64) result, forward and every gradient; NumPy
float16 (and ml_dtypes bfloat16 when installed); varlen; no copies; masks of every dtype.

The contract (docs/numerics.md): on the same 16-bit inputs, qkv's max error
against the float64 result is within 2× PyTorch's for bfloat16 (precision="fast": P rounded
to bf16 once where the CPU has bf16 dot products) and at most PyTorch's for float16 (plus 8 float32 ulps of the largest
exact value: both compute in float32 and round once, so on a near-tie the two may
round one element to its two neighbours, each half an ulp of T from exact), and its
forward error is at most what rounding the exact result to T costs plus one unit
roundoff u of T times the largest exact value (u = 2⁻⁸ bfloat16, 2⁻¹¹ float16).

"The same inputs" for the backward means the same q, k, v, out, lse and dout: PyTorch's
CPU flash backward (aten::_scaled_dot_product_flash_attention_for_cpu_backward) is fed
qkv's out and lse, and "exact" is the exact backward of that stored out. Both backward
kernels (like FlashAttention's) read out through D_i = ⟨dO_i, out_i⟩; an out rounded
to T moves dq and dk by −∇ Σ_i ΔD_i·lse_i, ΔD_i = ⟨dO_i, out_T,i − out_i⟩, before any
kernel runs. End to end (each backward after its own forward, against the true
gradient) that shift differs between two differently rounded outs by chance, which is
why the contract compares the backward on the same out.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import qkv
import qkv.torch as qt
from qkv import _qkv
from attention_math import FP32_EPS, math_attention, max_error

HALF = [torch.bfloat16, torch.float16]
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def floor_of(exact) -> float:
    return 8 * FP32_EPS * max(exact.abs().max().item(), 1e-30)


def assert_no_worse_than_torch(ours, theirs, exact, what):
    """float16: at most PyTorch's error (qkv's float16 arithmetic is float32's). bfloat16 in
    the default precision="fast": within 2× PyTorch's, the contract, since on CPUs with bf16
    dot products P and dS are rounded to bfloat16 once, as PyTorch rounds them."""
    factor = 2.0 if ours.dtype == torch.bfloat16 else 1.0
    ours_error, theirs_error = max_error(ours, exact), max_error(theirs, exact)
    assert ours_error <= factor * theirs_error + floor_of(exact), (
        f"{what}: qkv's error {ours_error:.3e} > {factor:g}× PyTorch's {theirs_error:.3e}")


def assert_within_storage_rounding(ours, exact, dtype, what):
    exact = exact.double()
    storing = max_error(exact.to(dtype), exact)
    bound = storing + UNIT_ROUNDOFF[dtype] * exact.abs().max().item() + floor_of(exact)
    assert max_error(ours, exact) <= bound, (
        f"{what}: error {max_error(ours, exact):.3e} > rounding {storing:.3e} + u·max|exact|")


def torch_backward_on(q, k, v, out, lse, dout, *, is_causal=False, attn_mask=None):
    """PyTorch's CPU flash backward on the given out and lse. GQA: k and v repeated to
    the query heads and their gradients summed back in the input dtype, as autograd
    does through torch's own repeat_interleave."""
    group = q.shape[1] // k.shape[1]
    kr, vr = (x.repeat_interleave(group, dim=1) for x in (k, v))
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, kr, vr, out, lse, 0.0, is_causal, attn_mask=attn_mask)
    fold = lambda g: g.unflatten(1, (k.shape[1], group)).sum(2)  # noqa: E731
    return dq, fold(dk), fold(dv)


def sdpa_with_grads(fn, q, k, v, dout, **kwargs):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves, **kwargs)
    out.backward(dout)
    return out.detach(), [x.grad for x in leaves]


CASES = [
    dict(name="plain", shape=(2, 3, 40, 32), kv_heads=3, n_k=40),
    dict(name="causal", shape=(1, 2, 130, 64), kv_heads=2, n_k=130, is_causal=True),
    dict(name="gqa_nq_ne_nk", shape=(2, 8, 33, 64), kv_heads=2, n_k=90, enable_gqa=True),
    dict(name="odd_dim", shape=(1, 2, 70, 59), kv_heads=2, n_k=70),
    dict(name="d128", shape=(1, 2, 100, 128), kv_heads=2, n_k=100, is_causal=True),
]


def make_case(case, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, h, n, d = case["shape"]
    q = torch.randn(b, h, n, d, generator=g).to(dtype)
    k = torch.randn(b, case["kv_heads"], case["n_k"], d, generator=g).to(dtype)
    v = torch.randn(b, case["kv_heads"], case["n_k"], d, generator=g).to(dtype)
    dout = torch.randn(b, h, n, d, generator=g).to(dtype)
    return q, k, v, dout


def exact_backward_of_stored_out(q, k, v, out, dout, *, causal=None, keep=None, bias=None):
    """(exact out, exact dq, dk, dv of the FlashAttention backward given the stored out),
    in float64: the true gradient minus ∇_{q,k} Σ_i ΔD_i·lse_i (see the module doc)."""
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out64, lse = math_attention(*leaves, causal=causal, keep=keep,
                                bias=None if bias is None else bias.double())
    delta = (dout.double() * (out.double() - out64.detach())).sum(-1)  # ΔD_i
    shift = torch.where(torch.isinf(lse), torch.zeros_like(lse), delta * lse)
    loss = (out64 * dout.double()).sum() - shift.sum()
    return out64.detach(), torch.autograd.grad(loss, leaves)


def check_against_torch(q, k, v, dout, dtype, *, is_causal=False, attn_mask=None):
    """Forward on the same q, k, v; backward on the same q, k, v, out, lse, dout, both
    against the exact backward of that stored out."""
    gqa = q.shape[1] != k.shape[1]
    kwargs = dict(is_causal=is_causal, attn_mask=attn_mask, enable_gqa=gqa)
    causal = "top_left" if is_causal else None
    mask = attn_mask[None, None] if attn_mask is not None and attn_mask.ndim == 2 else attn_mask
    ours, lse = qkv.attention(q, k, v, causal=causal, mask=mask, return_lse=True)
    our_grads = qkv.attention_backward(q, k, v, ours, lse, dout, causal=causal, mask=mask)
    theirs = F.scaled_dot_product_attention(q, k, v, **kwargs)
    their_grads = torch_backward_on(q, k, v, ours, lse, dout, is_causal=is_causal,
                                    attn_mask=attn_mask)
    keep = attn_mask if attn_mask is not None and attn_mask.dtype == torch.bool else None
    bias = attn_mask if attn_mask is not None and keep is None else None
    exact, exact_grads = exact_backward_of_stored_out(q, k, v, ours, dout, causal=causal,
                                                      keep=keep, bias=bias)
    assert ours.dtype == dtype and all(g.dtype == dtype for g in our_grads)
    assert_no_worse_than_torch(ours, theirs, exact, "out")
    assert_within_storage_rounding(ours, exact, dtype, "out")
    for name, a, b, e in zip(("dq", "dk", "dv"), our_grads, their_grads, exact_grads):
        assert_no_worse_than_torch(a, b, e, name)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_half_no_worse_than_torch(case, dtype):
    q, k, v, dout = make_case(case, dtype)
    check_against_torch(q, k, v, dout, dtype, is_causal=case.get("is_causal", False))


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("case", CASES[:3], ids=[c["name"] for c in CASES[:3]])
def test_sdpa_half_autograd(case, dtype):
    """The drop-in, differentiated by autograd: gradients in the input dtype, equal to
    qkv.attention_backward's, and dv (which does not read out) no worse than PyTorch's
    end to end."""
    q, k, v, dout = make_case(case, dtype)
    kwargs = {key: case[key] for key in ("is_causal", "enable_gqa") if key in case}
    ours, our_grads = sdpa_with_grads(qt.scaled_dot_product_attention, q, k, v, dout, **kwargs)
    _, their_grads = sdpa_with_grads(F.scaled_dot_product_attention, q, k, v, dout, **kwargs)
    _, exact_grads = sdpa_with_grads(F.scaled_dot_product_attention,
                                     *(x.double() for x in (q, k, v)), dout.double(), **kwargs)
    assert ours.dtype == dtype and all(g.dtype == dtype for g in our_grads)
    causal = "top_left" if case.get("is_causal") else None
    out, lse = qkv.attention(q, k, v, causal=causal, return_lse=True)
    for a, b in zip(our_grads, qkv.attention_backward(q, k, v, out, lse, dout, causal=causal)):
        assert torch.equal(a, b)
    assert_no_worse_than_torch(our_grads[2], their_grads[2], exact_grads[2], "dv")


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("mask_kind", ["bool", "float32", "input_dtype"])
def test_sdpa_half_masks(dtype, mask_kind):
    q, k, v, dout = make_case(dict(shape=(2, 2, 50, 32), kv_heads=2, n_k=70), dtype, seed=1)
    g = torch.Generator().manual_seed(2)
    keep = torch.rand(2, 1, 50, 70, generator=g) < 0.7
    if mask_kind == "bool":
        mask = keep
    else:
        bias = torch.randn(2, 1, 50, 70, generator=g).masked_fill(~keep, float("-inf"))
        mask = bias if mask_kind == "float32" else bias.to(dtype)
    check_against_torch(q, k, v, dout, dtype, attn_mask=mask)
    # The drop-in takes the same masks (the inputs' dtype included) and differentiates.
    out = qt.scaled_dot_product_attention(*(x.detach().requires_grad_() for x in (q, k, v)),
                                          attn_mask=mask)
    assert torch.equal(out, qkv.attention(q, k, v, mask=mask))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_outputs_are_the_float32_kernels_rounded_once(dtype):
    """The same kernels on the same (widened) values, rounded once: out is the float32
    call's out rounded to the storage type, bit for bit; lse is float32 and identical."""
    q, k, v, _ = make_case(dict(shape=(1, 4, 77, 40), kv_heads=2, n_k=77), dtype, seed=3)
    # precision="exact": the claim of the float32 arithmetic (bf16 dot products, where they
    # run by default, round P's second term; tests/python/test_precision.py)
    out, lse = qkv.attention(q, k, v, causal="top_left", return_lse=True, precision="exact")
    out32, lse32 = qkv.attention(q.float(), k.float(), v.float(), causal="top_left",
                                 return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(out, out32.to(dtype))
    assert torch.equal(lse, lse32)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_attention_backward_half_matches_autograd(dtype):
    q, k, v, dout = make_case(dict(shape=(2, 4, 45, 24), kv_heads=2, n_k=60), dtype, seed=4)
    out, lse = qkv.attention(q, k, v, causal="bottom_right", return_lse=True)
    dq, dk, dv = qkv.attention_backward(q, k, v, out, lse, dout, causal="bottom_right")
    _, grads = sdpa_with_grads(lambda *x: qkv.attention(*x, causal="bottom_right"), q, k, v, dout)
    for a, b in zip((dq, dk, dv), grads):
        assert a.dtype == dtype and torch.equal(a, b)


def test_numpy_float16_forward_and_backward():
    rng = np.random.default_rng(5)
    q, k, v, dout = (rng.standard_normal((1, 2, 30, 16)).astype(np.float16) for _ in range(4))
    mask = (rng.standard_normal((1, 1, 30, 30)) * 0.5).astype(np.float16)  # inputs' dtype
    out, lse = qkv.attention(q, k, v, mask=mask, return_lse=True)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    dq, dk, dv = qkv.attention_backward(q, k, v, out, lse, dout, mask=mask)
    assert dq.dtype == dk.dtype == dv.dtype == np.float16
    # Against torch float16 with autograd on the same values (same kernels underneath).
    t = [torch.from_numpy(x) for x in (q, k, v, dout)]
    ours, grads = sdpa_with_grads(qt.scaled_dot_product_attention, *t[:3], t[3],
                                  attn_mask=torch.from_numpy(mask).float())
    assert np.array_equal(out, ours.numpy())
    for a, b in zip((dq, dk, dv), grads):
        assert np.array_equal(a, b.numpy())


def test_numpy_ml_dtypes_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(6)
    q, k, v, dout = (rng.standard_normal((1, 2, 20, 8)).astype(ml_dtypes.bfloat16)
                     for _ in range(4))
    out, lse = qkv.attention(q, k, v, return_lse=True)
    assert out.dtype == ml_dtypes.bfloat16 and lse.dtype == np.float32
    dq, _, _ = qkv.attention_backward(q, k, v, out, lse, dout)
    assert dq.dtype == ml_dtypes.bfloat16
    as_torch = [torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for x in (q, k, v)]
    assert np.array_equal(out.view(np.int16),
                          qkv.attention(*as_torch).view(torch.int16).numpy())


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_tensors_are_read_in_place(dtype):
    """16-bit tensors go to the library as they are: no copy."""
    base = torch.randn(2, 8, 3, 3, 16).to(dtype)  # [B, N, 3, H, d]: a packed projection
    q, k, v = base.unbind(2)  # [B, N, H, d] strided views
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # as [B, H, N, d]
    _qkv._debug_record_views(True)
    try:
        out = qkv.attention(q, k, v)
        seen = _qkv._debug_last_views()
    finally:
        _qkv._debug_record_views(False)
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        address, _, strides = seen[name]
        assert address == x.data_ptr(), f"{name} was copied"
        s = x.stride()
        assert strides == (s[0], s[2], s[1], s[3])


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_varlen_half_against_torch_per_sequence(dtype):
    lengths = [5, 70, 0, 33]
    cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)
    total = int(cu[-1])
    g = torch.Generator().manual_seed(7)
    q = torch.randn(total, 4, 32, generator=g).to(dtype).requires_grad_()
    k = torch.randn(total, 2, 32, generator=g).to(dtype).requires_grad_()
    v = torch.randn(total, 2, 32, generator=g).to(dtype).requires_grad_()
    dout = torch.randn(total, 4, 32, generator=g).to(dtype)
    out = qkv.varlen_attention(q, k, v, cu, cu, causal="top_left")
    out.backward(dout)
    assert out.dtype == dtype and q.grad.dtype == dtype
    for s, n in enumerate(lengths):
        if n == 0:
            continue
        rows = slice(int(cu[s]), int(cu[s + 1]))
        per = [x[rows].detach().transpose(0, 1)[None] for x in (q, k, v)]
        g_out = dout[rows].transpose(0, 1)[None]
        theirs, their_grads = sdpa_with_grads(F.scaled_dot_product_attention, *per, g_out,
                                              is_causal=True, enable_gqa=True)
        exact, exact_grads = sdpa_with_grads(F.scaled_dot_product_attention,
                                             *(x.double() for x in per), g_out.double(),
                                             is_causal=True, enable_gqa=True)
        ours = out[rows].detach().transpose(0, 1)[None]
        assert_no_worse_than_torch(ours, theirs, exact, f"out of sequence {s}")
        for name, ours_grad, b, e in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad),
                                         their_grads, exact_grads):
            a = ours_grad[rows].transpose(0, 1)[None]
            assert_no_worse_than_torch(a, b, e, f"{name} of sequence {s}")


def test_half_dtype_mismatch_names_the_argument():
    q = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"expected query, key and value of one dtype"):
        qt.scaled_dot_product_attention(q, q.half(), q)
    with pytest.raises(TypeError, match=r"k: expected dtype bfloat16 \(the dtype of q\), got "
                                        r"float32"):
        qkv.attention(q, q.float(), q)
    with pytest.raises(TypeError, match=r"k: expected dtype float16 \(the dtype of q\), got "):
        qkv.attention(q.half(), q, q.half())


def test_half_custom_ops_pass_opcheck():
    """Fake tensors: the operators' lse is float32 for half inputs."""
    q, k, v = (torch.randn(1, 2, 5, 8).to(torch.bfloat16) for _ in range(3))
    args = (q, k, v, None, None, None, None, "none", "bhsd", "auto", 1, False)
    torch.library.opcheck(torch.ops.qkv.attention_forward.default, args)
