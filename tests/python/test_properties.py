"""Property-based tests (hypothesis): randomized shapes, strides, dtypes, masks, variants,
varlen batches, decode calls and KV caches, each checked against exact results.

The exact result of a case is qkv's fp64 reference backend on the same (widened) inputs,
itself checked against property_math.plain_attention in float64 (to 1e-10). The bound is
the numerics contract of docs/numerics.md:

* float32 (``backend="cpu"``): max error (forward, and dq/dk/dv where drawn) at most
  2 × that of plain_attention in float32 on the same inputs, plus a floor of 8 float32
  ulps of max(1, the largest exact value) — the rule of tests/cpp/cpu_check.hpp
  (expect_within_rule). For dq and dk the floor is 8 ulps of the terms their dP − D is a
  difference of (dv·|dO|·|V|, times scale·|K|, or scale·|Q|·Nq), as D comes from the
  forward's out (check_attention_case says why). Every gradient's floor also carries
  the float32 log-sum-exp the backward recomputes P = exp(S − lse) from (as PyTorch's
  and FlashAttention's do): its rounding gives P a relative error of about ε₃₂·|lse|,
  so the bound adds 2·ε₃₂·|lse|max·max(Pᵀ·|dO|) to dv's and 4·ε₃₂·|lse|max × their
  terms to dq's and dk's. The forward's out adds 2·ε₃₂·max_i Σ_j P_ij·|v_j − out_i|·
  scale·Σ_c |q_ic·k_jc|: the logits' own rounding through the softmax, which dominates
  both qkv's and the plain loop's error when a few keys with large logits share a row.
* float16 / bfloat16: at most u · max|exact| (u = 2⁻¹¹ / 2⁻⁸, the one rounding of the
  float32 result to the storage type) plus the float32 bound above.
* decode and caches: the float32 bound against the values as the cache stores them
  (rounded to its dtype, or int8 · scale).

Which schedule a case took (the decode kernel for ≤ 16 queries without an elementwise
mask, varlen or dropout; the tiled kernels otherwise) is recorded with hypothesis.event:
``pytest --hypothesis-show-statistics`` lists the counts.

Budget: derandomized (the same examples every run) and sized for CI (the whole file in
about a minute on two cores). QKV_HYPOTHESIS_EXAMPLES=N runs N examples per test instead,
QKV_HYPOTHESIS_SEED=S draws them at random from seed S (scripts/property_soak.sh).
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

pytest.importorskip("hypothesis", reason="pip install hypothesis (scripts/test_python.sh does)")
from hypothesis import HealthCheck, event, example, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import qkv  # noqa: E402
from property_math import largest, max_error, plain_attention  # noqa: E402

pytestmark = pytest.mark.skipif("cpu" not in qkv.available_backends(), reason="cpu backend not built")

FP32_EPS = float(torch.finfo(torch.float32).eps)
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 0.0}
DECODE_QUERIES = 16  # docs/decode-and-caches.md: attention_forward uses the decode kernel up to here


def budget(examples: int, at_least: bool = False):
    """The test's settings: `examples` in CI, or what QKV_HYPOTHESIS_EXAMPLES says (never
    fewer with `at_least`: a strict xfail needs enough examples to find its failure)."""
    count = int(os.environ.get("QKV_HYPOTHESIS_EXAMPLES", examples))
    count = max(count, examples) if at_least else count
    random_seed = os.environ.get("QKV_HYPOTHESIS_SEED")
    chosen = settings(max_examples=count, derandomize=random_seed is None, deadline=None, database=None,
                      print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

    def apply(test):
        test = chosen(test)
        return seed(int(random_seed))(test) if random_seed is not None else test

    return apply


def check_bound(ours, plain32, exact, what: str, dtype=torch.float32, terms=0.0, rounding_terms=0.0):
    """The bound of docs/numerics.md (module docstring) for one output or gradient; `terms`: the
    size of the terms a gradient is a difference of; `rounding_terms`: the derived size,
    in units of ε₃₂, of the float32 roundings that reach it through the softmax (the
    logits', the lse's; see check_attention_case)."""
    assert torch.isfinite(torch.as_tensor(ours)).all(), f"{what}: non-finite result"
    scale = largest(exact)
    error, plain = max_error(ours, exact), max_error(plain32, exact)
    bound = (UNIT_ROUNDOFF[dtype] * scale + 2 * plain + 8 * FP32_EPS * max(scale, 1.0, terms)
             + FP32_EPS * rounding_terms)
    assert error <= bound, (f"{what}: error {error:.3e} > bound {bound:.3e} "
                            f"(plain fp32 error {plain:.3e}, max |exact| {scale:.3e})")


def strided(rng: torch.Generator, shape, permuted: bool):
    """A standard-normal float64 tensor of `shape`, stored in another axis order when
    `permuted` (a transposed/permuted view, last axis kept contiguous as qkv requires)."""
    if not permuted:
        return torch.randn(*shape, generator=rng, dtype=torch.float64)
    order = [2, 0, 1, 3]  # stored [N, B, H, d]: sequence outermost
    stored = torch.randn(*[shape[a] for a in order], generator=rng, dtype=torch.float64)
    return stored.permute(*np.argsort(order).tolist())


@st.composite
def attention_cases(draw, dtype_choices=(torch.float32,), grad=False, schedule_of=None):
    """A dense attention case. grad: with the backward. schedule_of: None (either), "tiled"
    or "decode kernel" (the shapes and masks that attention_forward sends there)."""
    case = dict(
        dtype=draw(st.sampled_from(dtype_choices)),
        batch=draw(st.integers(1, 2)),
        kv_heads=draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 2, 3])),
        # ≤ 16 queries take the decode kernel (without an elementwise mask); > 64 several tiles.
        q_len=draw(st.one_of(st.integers(1, DECODE_QUERIES), st.integers(1, 140))),
        k_len=draw(st.integers(0, 140)),
        head_dim=draw(st.sampled_from([1, 3, 8, 16, 33, 64, 256])),
        scale=draw(st.sampled_from([None, None, 0.05, 1.6])),
        causal=draw(st.sampled_from([None, "top_left", "bottom_right"])),
        mask=draw(st.sampled_from(["none", "bool", "float", "key_padding", "key_lengths"])),
        layout=draw(st.sampled_from(["bhsd", "bshd"])),
        permuted=draw(st.booleans()),
        logit_scale=draw(st.sampled_from([1.0, 3.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )
    case["v_dim"] = draw(st.sampled_from([case["head_dim"], 5, 16]))
    if case["mask"] in ("bool", "float"):  # broadcast axes: [B|1, H|1, Nq|1, Nk]
        case["mask_shape"] = tuple(draw(st.sampled_from([1, n])) for n in
                                   (case["batch"], case["kv_heads"] * case["group"], case["q_len"]))
    if draw(st.booleans()):
        case["window"] = (draw(st.sampled_from([-1, 0, 3, 40])), draw(st.sampled_from([-1, 0, 5])))
    case["softcap"] = draw(st.sampled_from([None, None, 2.5]))
    case["alibi"] = draw(st.booleans())
    case["sinks"] = draw(st.booleans())
    case["grad"] = grad
    if schedule_of == "decode kernel":
        case["q_len"] = min(case["q_len"], DECODE_QUERIES)
        case["mask"] = draw(st.sampled_from(["none", "key_lengths"]))
        case.pop("mask_shape", None)
    elif schedule_of == "tiled" and schedule(case) != "tiled":
        case["q_len"] += DECODE_QUERIES
        if "mask_shape" in case:
            case["mask_shape"] = case["mask_shape"][:2] + (1,)
    return case


def make_inputs(case):
    """float64 q, k, v, mask tensors and per-head vectors for a case ([B, H, N, d] logical)."""
    rng = torch.Generator().manual_seed(case["seed"])
    b, hk, g = case["batch"], case["kv_heads"], case["group"]
    h, nq, nk = hk * g, case["q_len"], case["k_len"]
    q = strided(rng, (b, h, nq, case["head_dim"]), case["permuted"]) * case["logit_scale"]
    k = strided(rng, (b, hk, nk, case["head_dim"]), case["permuted"])
    v = strided(rng, (b, hk, nk, case["v_dim"]), case["permuted"])
    rules = dict(causal=case["causal"], window=case.get("window"), softcap=case["softcap"], scale=case["scale"])
    if case["mask"] == "bool":
        rules["keep"] = torch.rand(*case["mask_shape"], nk, generator=rng) < 0.7
    elif case["mask"] == "float":
        bias = torch.randn(*case["mask_shape"], nk, generator=rng, dtype=torch.float64)
        bias[torch.rand(*bias.shape, generator=rng) < 0.2] = float("-inf")
        rules["bias"] = bias.float().double()  # qkv computes the bias in float32
    elif case["mask"] in ("key_padding", "key_lengths"):
        lengths = torch.randint(0, nk + 1, (b,), generator=rng)
        if case["mask"] == "key_lengths":
            rules["key_lengths"] = lengths
        else:
            rules["keep"] = (torch.arange(nk).view(1, 1, 1, nk) < lengths.view(b, 1, 1, 1))
    if case["alibi"]:
        rules["alibi"] = (torch.rand(h, generator=rng) * 0.5).float().double()
    if case["sinks"]:
        rules["sinks"] = torch.randn(h, generator=rng).float().double()
    return q, k, v, rules


def to_layout(x, layout):
    return x if layout == "bhsd" else x.transpose(1, 2)


def upstream(case, shape):
    """The backward's dout, [B, H, Nq, dv] logical, the same for every implementation."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(case["seed"] + 1), dtype=torch.float64)


def run_qkv(q, k, v, rules, case, backend, dtype):
    """qkv.attention on the case's inputs in `dtype`; returns (out [B,H,N,dv] float64,
    (dq, dk, dv) or None)."""
    layout = case["layout"]
    leaves = [to_layout(x, layout).to(dtype).detach().requires_grad_(case["grad"]) for x in (q, k, v)]
    mask = rules.get("keep")
    if mask is None and "bias" in rules:
        mask = rules["bias"].float()
    per_head = torch.float64 if dtype == torch.float64 else torch.float32
    out = qkv.attention(*leaves, causal=rules["causal"], mask=mask, key_lengths=rules.get("key_lengths"),
                        scale=rules["scale"],
                        layout=layout, backend=backend, window=rules["window"], softcap=rules["softcap"],
                        alibi_slopes=None if "alibi" not in rules else rules["alibi"].to(per_head),
                        sinks=None if "sinks" not in rules else rules["sinks"].to(per_head))
    grads = None
    if case["grad"]:
        out.backward(to_layout(upstream(case, to_layout(out, layout).shape), layout).to(dtype))
        grads = tuple(to_layout(x.grad, layout).double() for x in leaves)
    return to_layout(out.detach(), layout).double(), grads


def logit_rounding(q, k, v, rules, case, exact) -> float:
    """max_i Σ_j P_ij·|v_j − out_i|·scale·Σ_c |q_ic·k_jc| (exact, float64): the size of the
    logits' float32 rounding in the forward's out, in units of ε₃₂."""
    kwargs = dict(rules)
    _, p = plain_attention(q, k, v, return_weights=True, **kwargs)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    step = case["scale"] or 1.0 / math.sqrt(case["head_dim"])
    sizes = step * (q.abs() @ k.abs().transpose(-1, -2))  # [B, H, Nq, Nk]
    worst = 0.0
    for b in range(q.shape[0]):  # per head: |v_j − out_i| is [Nq, Nk, dv]
        for h in range(q.shape[1]):
            spread = (v[b, h].unsqueeze(0) - exact[b, h].unsqueeze(1)).abs()
            worst = max(worst, largest(((p[b, h] * sizes[b, h]).unsqueeze(-1) * spread).sum(1)))
    return worst


def lse_sizes(q, k, v, rules, case):
    """(the largest finite |lse| of the case, max Pᵀ·|dO|), exact (the reference backend in
    float64): the size of the float32 log-sum-exp's rounding in the gradients."""
    layout = case["layout"]
    leaves = [to_layout(x, layout).detach().requires_grad_(True) for x in (q, k, v)]
    mask = rules.get("keep")
    if mask is None and "bias" in rules:
        mask = rules["bias"].double()
    out, lse = qkv.attention(*leaves, causal=rules["causal"], mask=mask, key_lengths=rules.get("key_lengths"),
                             scale=rules["scale"], layout=layout, backend="reference", return_lse=True,
                             window=rules["window"], softcap=rules["softcap"],
                             alibi_slopes=rules.get("alibi"), sinks=rules.get("sinks"))
    out.backward(to_layout(upstream(case, to_layout(out, layout).shape).abs(), layout))
    finite = lse[torch.isfinite(lse)]
    return largest(finite.detach()), largest(leaves[2].grad)


def run_plain(q, k, v, rules, case, dtype):
    leaves = [x.to(dtype).detach().requires_grad_(case["grad"]) for x in (q, k, v)]
    kwargs = dict(rules)
    for name in ("bias", "alibi", "sinks"):
        if name in kwargs:
            kwargs[name] = kwargs[name].to(dtype)
    out = plain_attention(*leaves, **kwargs)
    grads = None
    if case["grad"]:
        out.backward(upstream(case, out.shape).to(dtype))
        grads = tuple(x.grad.double() for x in leaves)
    return out.detach().double(), grads


def schedule(case) -> str:
    elementwise = case["mask"] in ("bool", "float", "key_padding")
    return "decode kernel" if case["q_len"] <= DECODE_QUERIES and not elementwise else "tiled"


def check_attention_case(case):
    event(f"schedule: {schedule(case)}")
    event(f"dtype: {str(case['dtype']).replace('torch.', '')}")
    q, k, v, rules = make_inputs(case)
    dtype = case["dtype"]
    # The inputs as qkv sees them: rounded once to the dtype, then exact.
    q, k, v = (x.to(dtype).double() for x in (q, k, v))
    exact, exact_grads = run_qkv(q, k, v, rules, case, "reference", torch.float64)
    check, check_grads = run_plain(q, k, v, rules, case, torch.float64)
    torch.testing.assert_close(exact, check, rtol=1e-10, atol=1e-10, msg=lambda m: f"reference out: {m}")
    for name, a, b in zip(("dq", "dk", "dv"), exact_grads or (), check_grads or ()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m, name=name: f"reference {name}: {m}")
    ours, our_grads = run_qkv(q, k, v, rules, case, "cpu", dtype)
    plain, plain_grads = run_plain(q, k, v, rules, case, torch.float32)
    # The logits' float32 rounding (≈ ε₃₂·scale·Σ_c |q_c·k_c| each, in qkv's blocked FMA
    # sums and the plain loop's alike) moves out_i by Σ_j P_ij·(v_j − out_i)·δS_ij: where
    # few keys with large logits share a row, both errors are that one term, and their
    # ratio is a ratio of two random roundings, not ≤ 2. Bounded by twice its size.
    check_bound(ours, plain, exact, f"out ({schedule(case)})", dtype,
                rounding_terms=2 * logit_rounding(q, k, v, rules, case, exact))
    if dtype == torch.float32 and case["grad"]:  # half gradients: test_half_precision.py
        # dq and dk are scale·Σ dS·k (·q) with dS = P·(dP − D): like FlashAttention, qkv
        # takes D_i = ⟨dO_i, out_i⟩ from the forward's out, which the plain loop does not
        # (its D is Σ_j P·dP, the same sum as dP), so where dP − D cancels (one key: exactly
        # 0) their floor is ulps of the terms: D and dP are sums of dv products |dO|·|V|,
        # times scale·|K| for dq_i (Σ_j P_ij = 1), and summed over the Nq rows times
        # scale·|Q| for dk_j. dv = Pᵀ·dO has no such difference: the documented floor.
        #
        #
        # Each gradient also uses P = exp(S − lse) with the forward's float32 lse (as
        # PyTorch's and FlashAttention's backward do), which the plain loop's exp(S − m)/l
        # has not (its largest P is exact). x = S − lse near 0 carries the roundings of lse
        # (stored, and m + log l: ε₃₂·|lse|) and of S (ε₃₂/2·|S| ≈ ε₃₂/2·|lse| there):
        # every P has a relative error up to 1.5·ε₃₂·|lse|, |lse| reaching 100s with large
        # logits. Bounded by 2·ε₃₂·|lse|max times Pᵀ|dO| for dv (the exact dv of the
        # upstream |dO|), and times 2× the dq/dk terms (dS = P·(dP − D), |dP − D| ≤ 2 terms).
        step = case["scale"] or 1.0 / math.sqrt(case["head_dim"])
        products = largest(upstream(case, exact.shape)) * largest(v) * case["v_dim"]
        terms = {"dq": step * products * largest(k), "dk": step * products * largest(q) * case["q_len"]}
        lse, p_dout = lse_sizes(q, k, v, rules, case)
        lse_part = {"dq": 4 * lse * terms["dq"], "dk": 4 * lse * terms["dk"], "dv": 2 * lse * p_dout}
        for name, a, b, c in zip(("dq", "dk", "dv"), our_grads, plain_grads, exact_grads):
            check_bound(a, b, c, f"{name} ({schedule(case)})", terms=terms.get(name, 0.0),
                        rounding_terms=lse_part[name])


@budget(200)
@given(attention_cases())
def test_float32_forward_within_the_documented_bound(case):
    check_attention_case(case)


@budget(100)
@given(attention_cases(grad=True, schedule_of="tiled"))
def test_float32_gradients_within_the_documented_bound(case):
    check_attention_case(case)


# Issue 22 item 6: the forward of a decode-shaped call runs the split-K schedule; its
# backward takes the same logits (docs/decode-and-caches.md, "The decode kernel"), so the gradients
# keep the bound.
@budget(40, at_least=True)
@given(attention_cases(grad=True, schedule_of="decode kernel"))
# Found by a 22-minute soak (seed 121563): |lse| ≈ 14 from logits ×3 made the dv error 20×
# plain fp32's (qkv's and PyTorch's alike), which the lse term of the floor now states.
@example(case={"dtype": torch.float32, "batch": 1, "kv_heads": 1, "group": 1, "q_len": 1, "k_len": 31,
               "head_dim": 33, "scale": 1.6, "causal": None, "mask": "none", "layout": "bhsd",
               "permuted": False, "logit_scale": 3.0, "seed": 0, "v_dim": 33, "softcap": None,
               "alibi": False, "sinks": False, "grad": True})
def test_float32_decode_shaped_gradients_within_the_documented_bound(case):
    check_attention_case(case)


@budget(100)
@given(attention_cases(dtype_choices=(torch.float16, torch.bfloat16)))
def test_half_forward_within_the_documented_bound(case):
    check_attention_case(case)


@st.composite
def varlen_cases(draw):
    count = draw(st.integers(1, 4))
    return dict(
        q_lens=draw(st.lists(st.integers(0, 80), min_size=count, max_size=count)),
        k_lens=draw(st.lists(st.integers(0, 80), min_size=count, max_size=count)),
        kv_heads=draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 2])),
        head_dim=draw(st.sampled_from([4, 16, 64])),
        causal=draw(st.sampled_from([None, "top_left", "bottom_right"])),
        window=draw(st.sampled_from([None, (8, 0), (20, 4)])),
        softcap=draw(st.sampled_from([None, 3.0])),
        sinks=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@budget(80)
@given(varlen_cases())
def test_varlen_equals_each_sequence_alone(case):
    rng = torch.Generator().manual_seed(case["seed"])
    hk, h, d = case["kv_heads"], case["kv_heads"] * case["group"], case["head_dim"]
    tq, tk = sum(case["q_lens"]), sum(case["k_lens"])
    q = torch.randn(tq, h, d, generator=rng)
    k, v = torch.randn(tk, hk, d, generator=rng), torch.randn(tk, hk, d, generator=rng)
    sinks = torch.randn(h, generator=rng) if case["sinks"] else None
    cu_q = torch.tensor([0, *np.cumsum(case["q_lens"])], dtype=torch.int32)
    cu_k = torch.tensor([0, *np.cumsum(case["k_lens"])], dtype=torch.int32)
    variants = dict(window=case["window"], softcap=case["softcap"], sinks=sinks)
    out = qkv.varlen_attention(q, k, v, cu_q, cu_k, causal=case["causal"], backend="cpu", **variants)
    for s, (nq, nk) in enumerate(zip(case["q_lens"], case["k_lens"])):
        if nq == 0:
            continue
        rows = slice(int(cu_q[s]), int(cu_q[s + 1]))
        keys = slice(int(cu_k[s]), int(cu_k[s + 1]))
        qs, ks, vs = (x[r].transpose(0, 1)[None] for x, r in ((q, rows), (k, keys), (v, keys)))
        rules = dict(causal=case["causal"], window=case["window"], softcap=case["softcap"],
                     sinks=None if sinks is None else sinks.double())
        exact = plain_attention(qs.double(), ks.double(), vs.double(), **rules)
        plain = plain_attention(qs, ks, vs, **dict(rules, sinks=sinks))
        check_bound(out[rows].transpose(0, 1)[None], plain, exact, f"varlen sequence {s}")


STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": None}


@st.composite
def cache_cases(draw):
    batch = draw(st.integers(1, 3))
    capacity = draw(st.integers(1, 90))
    return dict(
        batch=batch,
        capacity=capacity,
        kv_heads=draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 2, 4])),
        head_dim=draw(st.sampled_from([2, 16, 64])),
        dtype=draw(st.sampled_from(list(STORAGE))),
        paged=draw(st.booleans()),
        block_size=draw(st.sampled_from([1, 4, 16])),
        # Tokens appended per sequence, in chunks: the lengths differ across the batch.
        chunks=draw(st.lists(st.lists(st.integers(0, capacity), min_size=batch, max_size=batch),
                             min_size=1, max_size=3)),
        q_len=draw(st.integers(1, 4)),
        window=draw(st.sampled_from([None, (5, -1), (0, -1)])),
        softcap=draw(st.sampled_from([None, 4.0])),
        alibi=draw(st.booleans()),
        sinks=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def stored(cache, keys: bool):
    """What the cache holds as float64 [B, Hkv, capacity, d] (paged: gathered through the
    block table), int8 rows times their scales."""
    k, v = cache.torch_storage()
    x = (k if keys else v).double()
    if cache.dtype == "int8":
        scales = cache.scales()[0 if keys else 1]
        x = x * torch.from_numpy(np.array(scales)).double()[..., None]
    if cache.paged:
        table = torch.from_numpy(np.array(cache.block_table())).long().clamp(min=0)
        x = x[table].flatten(1, 2)  # [B, blocks·block_size, Hkv, d]
    # Rows past a sequence's length were never written (the memory is not cleared): 0
    # here, so that 0 · garbage cannot reach plain_attention's P·V.
    lengths = torch.tensor(cache.lengths).view(-1, 1, 1, 1)
    x = torch.where(torch.arange(x.shape[1]).view(1, -1, 1, 1) < lengths, x, torch.zeros_like(x))
    return x.transpose(1, 2)


@budget(150)
@given(cache_cases())
def test_cache_attend_and_decode_match_the_stored_values(case):
    event(f"cache: {case['dtype']} {'paged' if case['paged'] else 'contiguous'}")
    rng = torch.Generator().manual_seed(case["seed"])
    b, hk, d = case["batch"], case["kv_heads"], case["head_dim"]
    h = hk * case["group"]
    cache = qkv.KVCache(b, case["capacity"], hk, d, dtype=case["dtype"], paged=case["paged"],
                        block_size=case["block_size"])
    lengths = [0] * b
    for chunk in case["chunks"]:
        for s, tokens in enumerate(chunk):
            tokens = min(tokens, case["capacity"] - lengths[s])
            if tokens == 0:
                continue
            k_new, v_new = torch.randn(1, hk, tokens, d, generator=rng), torch.randn(1, hk, tokens, d, generator=rng)
            cache.append(k_new, v_new, seq=s)
            lengths[s] += tokens
    assert cache.lengths == lengths
    if case["paged"]:  # the books: blocks held + free == pool, none held twice
        table = np.array(cache.block_table())
        held = table[table >= 0]
        assert len(set(held.tolist())) == held.size
        assert held.size + cache.free_blocks == b * -(-case["capacity"] // case["block_size"])
    q = torch.randn(b, h, case["q_len"], d, generator=rng)
    alibi = (torch.rand(h, generator=rng) * 0.5) if case["alibi"] else None
    sinks = torch.randn(h, generator=rng) if case["sinks"] else None
    variants = dict(window=case["window"], softcap=case["softcap"], alibi_slopes=alibi, sinks=sinks)
    out = cache.attend(q, **variants)
    k_all, v_all = stored(cache, True), stored(cache, False)
    width = k_all.shape[2]
    rules = dict(causal="bottom_right", key_lengths=torch.tensor(lengths), window=case["window"],
                 softcap=case["softcap"])
    exact = plain_attention(q.double(), k_all, v_all, **rules,
                            alibi=None if alibi is None else alibi.double(),
                            sinks=None if sinks is None else sinks.double())
    plain = plain_attention(q, k_all.float(), v_all.float(), **rules, alibi=alibi, sinks=sinks)
    check_bound(out, plain, exact, f"KVCache.attend ({case['dtype']})")
    # The same through qkv.decode over caller-owned memory (contiguous caches: the
    # cache's own storage; paged: the pool and its block table), read in place.
    if case["dtype"] != "int8" and not case["paged"]:
        k_mem, v_mem = cache.torch_storage()
        again = qkv.decode(q, k_mem.transpose(1, 2), v_mem.transpose(1, 2), lengths, **variants)
        assert torch.equal(again, out), "qkv.decode differs from KVCache.attend"
    assert width >= max(lengths, default=0)

