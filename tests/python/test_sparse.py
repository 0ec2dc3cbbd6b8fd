"""qkv.sparse_attention (attention over the keys each query lists, DeepSeek's top-k)
against a PyTorch formulation of the same math: dense attention whose boolean mask is
scattered from the lists, intersected with causality, in float64 with torch autograd.

Tolerances. float32: the contract is "max error against the fp64 result no larger than
PyTorch SDPA's on the same inputs"; SDPA takes the scattered boolean mask, so where a case
has no sinks or soft-cap both are measured and compared (plus a floor of 8 float32 ulps
of the largest exact value: both round once per output, and on a tie may land on
neighbouring floats). SDPA has no sinks or soft-cap: there the bound is 64 float32 ulps
of the largest exact value — a row is a softmax over ≤ topk logits of size O(1) (each
logit a d-term dot product, one exp each, ≤ 2 ulp) followed by a topk-term weighted sum,
and the forward measures ~4 ulps here. bfloat16: within 2× SDPA's bf16 error on the same
inputs (FlashAttention's rule, the README's for 16-bit storage).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import qkv
from attention_math import FP32_EPS, max_error


def scattered_keep(indices, q_heads, k_len):
    """[B, Hq, Nq, Nk] bool: key j listed for the row (-1 entries list nothing)."""
    if indices.ndim == 3:  # one list per query, shared by every head
        indices = indices[:, None]
    batch, lists, q_len, _ = indices.shape
    listed = indices >= 0
    counts = torch.zeros(batch, lists, q_len, k_len, dtype=torch.int64)
    counts.scatter_add_(-1, indices.clamp(min=0).long(), listed.long())
    keep = counts > 0
    return keep.repeat_interleave(q_heads // lists, dim=1)


def causal_keep(q_len, k_len, causal):
    i = torch.arange(q_len)[:, None]
    j = torch.arange(k_len)[None, :]
    if causal == "top_left":
        return j <= i
    if causal == "bottom_right":
        return j <= i + (k_len - q_len)
    return torch.ones(q_len, k_len, dtype=torch.bool)


def torch_sparse(q, k, v, indices, *, causal=None, sinks=None, softcap=None, scale=None):
    """(out, lse) of the PyTorch formulation, differentiable; bhsd tensors of any dtype,
    computed in that dtype (call with float64 for the exact result)."""
    batch, q_heads, q_len, d = q.shape
    k_len = k.shape[2]
    group = q_heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = scale * (q @ k.transpose(-1, -2))
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    allowed = scattered_keep(indices, q_heads, k_len) & causal_keep(q_len, k_len, causal)
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype).view(1, q_heads, 1, 1).expand(batch, q_heads, q_len, 1)], -1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return p[..., :k_len] @ v, lse


def random_indices(batch, lists, q_len, k_len, topk, *, seed, dtype=torch.int64, diagonal=False):
    """-1 with probability 1/5, else uniform keys (repeats and keys past the causal limit
    included). `diagonal`: every row also lists its own bottom-right diagonal key, so no row
    is empty (PyTorch's SDPA gives NaN there, which would hide its error)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, k_len, (batch, lists, q_len, topk), generator=g)
    idx = torch.where(torch.rand(idx.shape, generator=g) < 0.2, torch.full_like(idx, -1), idx)
    if diagonal:
        idx[..., 0] = torch.arange(q_len) + (k_len - q_len)
    return idx.to(dtype)


CASES = [
    dict(name="mla_shared", b=2, hq=8, hkv=1, nq=33, nk=70, d=64, dv=32, topk=24, shared=True,
         causal="bottom_right"),
    dict(name="gqa_per_head", b=1, hq=6, hkv=3, nq=20, nk=50, d=32, dv=48, topk=16, shared=False,
         causal="bottom_right"),
    dict(name="topk_over_keys", b=2, hq=2, hkv=2, nq=9, nk=9, d=16, dv=16, topk=20, shared=False,
         causal="top_left"),
    dict(name="no_causal_odd_d", b=1, hq=4, hkv=2, nq=17, nk=40, d=59, dv=17, topk=70, shared=True,
         causal=None),
]
# bfloat16 against SDPA: the float step's shapes, and groups of 16 heads (DeepSeek's MQA
# mode), which on a CPU with a bf16 unit (vdpbf16ps or AMX) take it in both passes.
BF16_CASES = CASES[:2] + [
    dict(name="mqa_16_heads", b=1, hq=32, hkv=2, nq=40, nk=150, d=64, dv=64, topk=90, shared=True,
         causal="bottom_right"),
    # GQA 32/8's groups of 4 at d 128: on vdpbf16ps (AMD's AVX512-BF16) the forward's pair
    # step (cpu/bf16_group_block.hpp), P rounded to bf16 once; blocks of 64 + 64 + 2 keys.
    dict(name="gqa_groups_of_4", b=1, hq=8, hkv=2, nq=50, nk=260, d=128, dv=96, topk=130, shared=True,
         causal="bottom_right"),
]


def make(case, dtype=torch.float32, seed=0, diagonal=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(case["b"], case["hq"], case["nq"], case["d"], generator=g).to(dtype)
    k = torch.randn(case["b"], case["hkv"], case["nk"], case["d"], generator=g).to(dtype)
    v = torch.randn(case["b"], case["hkv"], case["nk"], case["dv"], generator=g).to(dtype)
    dout = torch.randn(case["b"], case["hq"], case["nq"], case["dv"], generator=g).to(dtype)
    idx = random_indices(case["b"], 1 if case["shared"] else case["hkv"], case["nq"], case["nk"],
                         case["topk"], seed=seed + 1, diagonal=diagonal)
    return q, k, v, dout, idx[:, 0] if case["shared"] else idx


def with_grads(fn, q, k, v, dout, extra=()):
    leaves = [x.detach().requires_grad_() for x in (q, k, v, *extra)]
    out, lse = fn(*leaves)
    out.backward(dout)
    return out.detach(), None if lse is None else lse.detach(), [x.grad for x in leaves]


def floor_of(exact):
    return 8 * FP32_EPS * max(exact.abs().max().item(), 1e-30)


def sdpa(q, k, v, idx, causal):
    """PyTorch's SDPA with the scattered boolean mask (transformers' sdpa path)."""
    keep = scattered_keep(idx, q.shape[1], k.shape[2]) & causal_keep(q.shape[2], k.shape[2], causal)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=q.shape[1] != k.shape[1])
    return out, None


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_float32_no_worse_than_sdpa(case):
    q, k, v, dout, idx = make(case)
    causal = case["causal"]
    ours, lse, our_grads = with_grads(
        lambda *x: qkv.sparse_attention(*x, idx, causal=causal, return_lse=True), q, k, v, dout)
    theirs, _, their_grads = with_grads(lambda *x: sdpa(*x, idx, causal), q, k, v, dout)
    exact, exact_lse, exact_grads = with_grads(
        lambda *x: torch_sparse(*x, idx, causal=causal), q.double(), k.double(), v.double(),
        dout.double())
    assert max_error(lse, exact_lse) <= 64 * FP32_EPS * exact_lse.abs().max().item()
    for name, a, b, e in zip(("out", "dq", "dk", "dv"), (ours, *our_grads), (theirs, *their_grads),
                             (exact, *exact_grads)):
        ours_error, theirs_error = max_error(a, e), max_error(b, e)
        assert ours_error <= theirs_error + floor_of(e), (
            f"{name}: qkv's error {ours_error:.3e} > SDPA's {theirs_error:.3e}")


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per_kv_head"])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_sinks_softcap_gradients_against_pytorch(shared, backend):
    case = dict(b=2, hq=4, hkv=2, nq=12, nk=30, d=32, dv=24, topk=10, shared=shared)
    q, k, v, dout, idx = make(case, diagonal=False)
    sinks = torch.tensor([0.3, -1.0, 2.0, 0.0])
    kw = dict(causal="top_left", softcap=4.0)
    ours, lse, grads = with_grads(
        lambda q_, k_, v_, s_: qkv.sparse_attention(q_, k_, v_, idx, sinks=s_, return_lse=True,
                                                    backend=backend, **kw), q, k, v, dout, (sinks,))
    exact, exact_lse, exact_grads = with_grads(
        lambda q_, k_, v_, s_: torch_sparse(q_, k_, v_, idx, sinks=s_, **kw),
        q.double(), k.double(), v.double(), dout.double(), (sinks.double(),))
    for name, a, e in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), (ours, lse, *grads),
                          (exact, exact_lse, *exact_grads)):
        bound = 64 * FP32_EPS * max(1.0, e.abs().max().item())
        assert max_error(a, e) <= bound, f"{name}: {max_error(a, e):.3e} > {bound:.3e}"


@pytest.mark.parametrize("case", BF16_CASES, ids=[c["name"] for c in BF16_CASES])
def test_bfloat16_within_twice_sdpa(case):
    q, k, v, dout, idx = make(case, dtype=torch.bfloat16)
    causal = case["causal"]
    ours, _, our_grads = with_grads(
        lambda *x: qkv.sparse_attention(*x, idx, causal=causal, return_lse=True), q, k, v, dout)
    theirs, _, their_grads = with_grads(lambda *x: sdpa(*x, idx, causal), q, k, v, dout)
    exact, _, exact_grads = with_grads(lambda *x: torch_sparse(*x, idx, causal=causal),
                                       q.double(), k.double(), v.double(), dout.double())
    assert ours.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in our_grads)
    for name, a, b, e in zip(("out", "dq", "dk", "dv"), (ours, *our_grads), (theirs, *their_grads),
                             (exact, *exact_grads)):
        ours_error, theirs_error = max_error(a, e), max_error(b, e)
        assert ours_error <= 2 * theirs_error + floor_of(e), (
            f"{name}: qkv's bf16 error {ours_error:.3e} > 2 × SDPA's {theirs_error:.3e}")


FORCED_PAIR_STEP = """
import os, sys, torch, qkv
sys.path.insert(0, os.getcwd())
from test_sparse import BF16_CASES, make, sdpa, torch_sparse, with_grads, floor_of
from attention_math import max_error
case = next(c for c in BF16_CASES if c["name"] == "gqa_groups_of_4")
q, k, v, dout, idx = make(case, dtype=torch.bfloat16)
run = lambda precision: with_grads(lambda *x: qkv.sparse_attention(*x, idx, causal=case["causal"], return_lse=True,
                                                                 precision=precision), q, k, v, dout)
fast, exact = run("fast"), run("exact")
assert not torch.equal(fast[0], exact[0]), "the pair step never ran"
theirs, _, their_grads = with_grads(lambda *x: sdpa(*x, idx, case["causal"]), q, k, v, dout)
ref, _, ref_grads = with_grads(lambda *x: torch_sparse(*x, idx, causal=case["causal"]),
                               q.double(), k.double(), v.double(), dout.double())
for name, a, b, e in zip(("out", "dq", "dk", "dv"), (fast[0], *fast[2]), (theirs, *their_grads), (ref, *ref_grads)):
    assert max_error(a, e) <= 2 * max_error(b, e) + floor_of(e), (name, max_error(a, e), max_error(b, e))
print("ok")
"""


def test_forced_pair_step_within_twice_sdpa():
    """GQA groups of 4 forced onto vdpbf16ps (QKV_DOT_PRODUCTS=on, QKV_AMX=off: on an AMX
    Xeon "fast" takes the tiles, which leave groups under 16 heads on the float step):
    the forward's pair step ran (fast differs from exact), and out and every gradient
    are within 2× PyTorch's bf16 error."""
    with open("/proc/cpuinfo") as cpuinfo:
        if "avx512_bf16" not in cpuinfo.read():
            pytest.skip("no AVX512-BF16 on this CPU")
    env = dict(os.environ, QKV_DOT_PRODUCTS="on", QKV_AMX="off")
    run = subprocess.run([sys.executable, "-c", FORCED_PAIR_STEP], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_empty_and_masked_rows_give_zero_out_minus_inf_lse_and_zero_grads():
    q, k, v, dout = (torch.randn(1, 2, 4, 8) for _ in range(4))
    idx = torch.tensor([[[-1, -1], [3, 3], [0, 1], [2, -1]]])  # row 0 empty, row 1 past its limit
    out, lse, (dq, dk, dv) = with_grads(
        lambda *x: qkv.sparse_attention(*x, idx, causal="top_left", return_lse=True), q, k, v, dout)
    assert torch.all(out[:, :, :2] == 0) and torch.all(torch.isneginf(lse[:, :, :2]))
    assert torch.all(dq[:, :, :2] == 0) and torch.all(dk[:, :, 3] == 0) and torch.all(dv[:, :, 3] == 0)
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()


def test_numpy_matches_torch_and_int32_matches_int64():
    case = CASES[1]
    q, k, v, dout, idx = make(case)
    out_t, lse_t = qkv.sparse_attention(q, k, v, idx, causal="bottom_right", return_lse=True, threads=1)
    grads_t = qkv.sparse_attention_backward(q, k, v, idx, out_t, lse_t, dout, causal="bottom_right")
    arrays = [x.numpy() for x in (q, k, v)]
    out_n, lse_n = qkv.sparse_attention(*arrays, idx.to(torch.int32).numpy(), causal="bottom_right",
                                        return_lse=True, threads=3)
    assert isinstance(out_n, np.ndarray)
    np.testing.assert_array_equal(out_n, out_t.numpy())
    np.testing.assert_array_equal(lse_n, lse_t.numpy())
    grads_n = qkv.sparse_attention_backward(*arrays, idx.numpy(), out_n, lse_n, dout.numpy(),
                                            causal="bottom_right", threads=2)
    for a, b in zip(grads_n, grads_t):
        np.testing.assert_array_equal(a, b.numpy())


def test_bshd_layout_is_the_same_call():
    case = CASES[0]
    q, k, v, _, idx = make(case)
    expected = qkv.sparse_attention(q, k, v, idx, causal="bottom_right")
    got = qkv.sparse_attention(*(x.transpose(1, 2) for x in (q, k, v)), idx, causal="bottom_right",
                               layout="bshd")
    torch.testing.assert_close(got.transpose(1, 2), expected, rtol=0, atol=0)


def test_bshd_bfloat16_gradients_are_the_bhsd_ones():
    """Contiguous bshd rows (a row's heads consecutive, which the pair step's backward reads
    in place instead of copying) give the bhsd call's out and gradients bit for bit."""
    case = next(c for c in BF16_CASES if c["name"] == "gqa_groups_of_4")
    q, k, v, dout, idx = make(case, dtype=torch.bfloat16)
    out, _, grads = with_grads(lambda *x: (qkv.sparse_attention(*x, idx, causal=case["causal"]), None), q, k, v, dout)
    bshd = [x.transpose(1, 2).contiguous() for x in (q, k, v, dout)]
    out_s, _, grads_s = with_grads(
        lambda *x: (qkv.sparse_attention(*x, idx, causal=case["causal"], layout="bshd"), None), *bshd)
    for a, b in zip((out, *grads), (out_s, *grads_s)):
        assert torch.equal(a, b.transpose(1, 2))


def test_bad_index_names_the_row_and_writes_nothing():
    q, k, v = (torch.randn(2, 2, 3, 8) for _ in range(3))
    idx = torch.zeros(2, 3, 2, dtype=torch.int64)
    idx[1, 2, 0] = 3  # Nk = 3
    with pytest.raises(qkv.Error, match=r"indices\[1, 2, 0\] \(batch 1, query row 2\): expected -1"):
        qkv.sparse_attention(q, k, v, idx)
    with pytest.raises(TypeError, match="indices: expected dtype int32 or int64"):
        qkv.sparse_attention(q, k, v, idx.float())
    with pytest.raises(qkv.Error, match="indices.shape"):
        qkv.sparse_attention(q, k, v, torch.zeros(2, 4, 2, dtype=torch.int64))


def test_operator_passes_opcheck():
    q = torch.randn(1, 4, 6, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, 6, 8, requires_grad=True) for _ in range(2))
    idx = random_indices(1, 2, 6, 6, 4, seed=3)
    sinks = torch.randn(4, requires_grad=True)
    args = (q, k, v, idx, None, "bottom_right", "bhsd", "auto", 1, 2.0, sinks)
    torch.library.opcheck(torch.ops.qkv.sparse_attention.default, args)
    torch.library.opcheck(torch.ops.qkv.sparse_attention.default, args[:9])


def test_compiles_fullgraph():
    case = CASES[0]
    q, k, v, _, idx = make(case)
    fn = torch.compile(lambda *x: qkv.sparse_attention(*x, causal="bottom_right"), fullgraph=True)
    torch.testing.assert_close(fn(q, k, v, idx), qkv.sparse_attention(q, k, v, idx, causal="bottom_right"),
                               rtol=0, atol=0)
