"""Attention health: qkv.attention(..., return_stats=True), qkv.varlen_attention's, and
qkv.torch.collect_stats, against the same statistics computed in PyTorch from the
materialized attention weights.

Yardsticks: float64 weights from the definitions (attention_math.math_attention with
V = I, so out = P). float32 results must be no worse than twice PyTorch's own float32
evaluation of the same statistics on the same inputs (assert_no_worse_than_torch, the
rule of every float32 test here); float64 inputs (reference backend) agree to 1e-10.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import qkv
import qkv.torch
from attention_math import assert_close_fp64, assert_no_worse_than_torch, math_attention

HEAD_KEYS = ("max_weight_mean", "max_weight_max", "entropy_mean", "saturated_share", "rows")
ROW_KEYS = ("row_max_weight", "row_entropy")
THRESHOLD = 0.3  # random rows fall on both sides of it


def weights_of(q, k, **mask):
    """P [B, Hq, Nq, Nk] and whether each row has a key, from the definitions."""
    batch, kv_heads, k_len, _ = k.shape
    eye = torch.eye(k_len, dtype=q.dtype).expand(batch, kv_heads, k_len, k_len)
    weights, lse = math_attention(q, k, eye, **mask)
    return weights, lse > float("-inf")


def stats_of(weights, live, threshold):
    """The statistics from P, in P's dtype, as qkv documents them."""
    row_max = weights.amax(dim=-1) if weights.shape[-1] else torch.zeros(weights.shape[:-1],
                                                                         dtype=weights.dtype)
    logs = torch.where(weights > 0, weights.log(), torch.zeros_like(weights))
    row_entropy = -(weights * logs).sum(dim=-1)
    rows = live.sum(dim=-1)
    count = rows.to(weights.dtype)
    nan = torch.tensor(float("nan"), dtype=weights.dtype)

    def mean(x):
        return torch.where(rows > 0, (x * live).sum(dim=-1) / count, nan)

    masked_max = torch.where(live, row_max, torch.zeros_like(row_max)).amax(dim=-1) \
        if row_max.shape[-1] else torch.zeros(rows.shape, dtype=weights.dtype)
    return {
        "max_weight_mean": mean(row_max),
        "max_weight_max": torch.where(rows > 0, masked_max, nan),
        "entropy_mean": mean(row_entropy),
        "saturated_share": mean((row_max > threshold).to(weights.dtype)),
        "rows": rows,
        "row_max_weight": row_max,
        "row_entropy": row_entropy,
    }


def check_against_torch(stats, q, k, threshold=THRESHOLD, **mask):
    """qkv's stats (float32 or float64) against PyTorch's evaluation of the definitions."""
    exact_p, live = weights_of(q.double(), k.double(), **mask)
    exact = stats_of(exact_p, live, threshold)
    assert torch.equal(torch.as_tensor(stats["rows"]), exact["rows"])
    ours = {key: torch.as_tensor(np.asarray(value)) if isinstance(value, np.ndarray) else value
            for key, value in stats.items()}
    if q.dtype == torch.float64:
        for key in ("max_weight_mean", "max_weight_max", "entropy_mean", "saturated_share",
                    *ROW_KEYS):
            if key in ours:
                torch.testing.assert_close(ours[key], exact[key], rtol=1e-10, atol=1e-10,
                                           equal_nan=True, msg=lambda m, key=key: f"{key}: {m}")
        return
    theirs_p, _ = weights_of(q, k, **mask)
    theirs = stats_of(theirs_p, live, threshold)
    counted = exact["rows"] > 0
    for key in ("max_weight_mean", "max_weight_max", "entropy_mean"):
        assert torch.equal(torch.isnan(ours[key]), ~counted), key
        assert_no_worse_than_torch(ours[key][counted], theirs[key][counted],
                                   exact[key][counted], key)
    for key in ROW_KEYS:
        if key in ours:
            assert_no_worse_than_torch(ours[key], theirs[key], exact[key], key)
    # Saturated rows: the same count, except rows within float32 error of the threshold.
    near = ((exact["row_max_weight"] - threshold).abs() < 1e-5) & live
    # (A share is count/rows rounded to float32: the count comes back by rounding.)
    ours_count = (ours["saturated_share"].double().nan_to_num(0) * exact["rows"]).round()
    exact_count = (exact["saturated_share"].nan_to_num(0) * exact["rows"]).round()
    assert ((ours_count - exact_count).abs() <= near.sum(-1)).all()


def random_qkv(batch, q_heads, kv_heads, q_len, k_len, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, q_len, d, generator=g, dtype=dtype)
    k = torch.randn(batch, kv_heads, k_len, d, generator=g, dtype=dtype)
    v = torch.randn(batch, kv_heads, k_len, d, generator=g, dtype=dtype)
    return q, k, v


CASES = {
    "plain": dict(shape=(2, 3, 3, 37, 45, 16)),
    "gqa_causal": dict(shape=(2, 4, 2, 70, 70, 32), causal="top_left"),
    "bottom_right_rows_without_keys": dict(shape=(2, 2, 1, 90, 40, 8), causal="bottom_right"),
    "key_lengths": dict(shape=(3, 2, 2, 20, 30, 8), key_lengths=[30, 7, 0]),
    "bool_mask": dict(shape=(2, 2, 1, 33, 65, 16), mask="bool"),
    "float_mask": dict(shape=(2, 2, 2, 33, 65, 16), mask="float"),
    "everything": dict(shape=(2, 4, 2, 65, 80, 24), mask="float", causal="bottom_right",
                       key_lengths=[80, 50]),
    "decode": dict(shape=(3, 8, 2, 1, 200, 64), causal="bottom_right", key_lengths=[200, 13, 1]),
}


def case_inputs(name, dtype):
    spec = CASES[name]
    batch, q_heads, kv_heads, q_len, k_len, d = spec["shape"]
    q, k, v = random_qkv(batch, q_heads, kv_heads, q_len, k_len, d, dtype, seed=len(name))
    g = torch.Generator().manual_seed(7)
    mask_kind = spec.get("mask")
    kwargs, math_kwargs = {}, {}
    if mask_kind == "bool":
        keep = torch.rand(batch, 1, q_len, k_len, generator=g) < 0.7
        kwargs["mask"], math_kwargs["keep"] = keep, keep
    elif mask_kind == "float":
        bias = torch.randn(1, q_heads, q_len, k_len, generator=g)
        bias[torch.rand(bias.shape, generator=g) < 0.2] = float("-inf")
        kwargs["mask"], math_kwargs["bias"] = bias, bias
    if "causal" in spec:
        kwargs["causal"] = math_kwargs["causal"] = spec["causal"]
    if "key_lengths" in spec:
        kwargs["key_lengths"] = math_kwargs["key_lengths"] = spec["key_lengths"]
    return q, k, v, kwargs, math_kwargs


@pytest.mark.parametrize("name", CASES)
def test_stats_match_torch_from_weights(name, backend):
    q, k, v, kwargs, math_kwargs = case_inputs(name, torch.float32)
    out, lse, stats = qkv.attention(q, k, v, return_lse=True, return_row_stats=True,
                                    saturation_threshold=THRESHOLD, backend=backend, **kwargs)
    assert set(stats) == set(HEAD_KEYS + ROW_KEYS)
    batch, q_heads, q_len = q.shape[0], q.shape[1], q.shape[2]
    for key in HEAD_KEYS:
        assert stats[key].shape == (batch, q_heads)
        assert stats[key].dtype == (torch.int64 if key == "rows" else torch.float32)
    for key in ROW_KEYS:
        assert stats[key].shape == (batch, q_heads, q_len)
    check_against_torch(stats, q, k, **math_kwargs)
    # The statistics change nothing else, except that calls the decode kernel would take
    # (<= 16 queries, no elementwise mask) run the tiled forward with them: same result
    # up to float32 rounding.
    plain_out, plain_lse = qkv.attention(q, k, v, return_lse=True, backend=backend, **kwargs)
    if q_len <= 16:
        torch.testing.assert_close(out, plain_out, rtol=0, atol=1e-5)
        torch.testing.assert_close(lse, plain_lse, rtol=0, atol=1e-5)
    else:
        assert torch.equal(out, plain_out) and torch.equal(lse, plain_lse)


@pytest.mark.parametrize("name", ["gqa_causal", "everything", "decode"])
def test_float64_reference_stats(name):
    q, k, v, kwargs, math_kwargs = case_inputs(name, torch.float64)
    _, stats = qkv.attention(q, k, v, return_row_stats=True, saturation_threshold=THRESHOLD,
                             **kwargs)
    assert stats["entropy_mean"].dtype == torch.float64
    check_against_torch(stats, q, k, **math_kwargs)


def test_numpy_returns_numpy_and_matches_torch(backend):
    q, k, v, kwargs, math_kwargs = case_inputs("everything", torch.float32)
    mask = kwargs.pop("mask").numpy()
    out, stats = qkv.attention(q.numpy(), k.numpy(), v.numpy(), mask=mask, return_stats=True,
                               saturation_threshold=THRESHOLD, backend=backend, **kwargs)
    assert isinstance(out, np.ndarray)
    assert set(stats) == set(HEAD_KEYS)
    assert all(isinstance(x, np.ndarray) for x in stats.values())
    assert stats["rows"].dtype == np.int64
    check_against_torch({key: torch.from_numpy(x) for key, x in stats.items()}, q, k,
                        **math_kwargs)


def test_return_forms():
    q, k, v = random_qkv(1, 2, 2, 5, 6, 4)
    assert isinstance(qkv.attention(q, k, v), torch.Tensor)
    out, stats = qkv.attention(q, k, v, return_stats=True)
    assert isinstance(stats, dict) and set(stats) == set(HEAD_KEYS)
    out, lse, stats = qkv.attention(q, k, v, return_lse=True, return_stats=True)
    assert lse.shape == (1, 2, 5)
    out_bshd, stats_bshd = qkv.attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), layout="bshd", return_stats=True)
    for key in HEAD_KEYS:
        assert torch.equal(stats[key], stats_bshd[key])


def test_saturated_logits_give_one_hot_rows(backend):
    # Keys e_j and queries 100·e_{σ(i)}: logit 100 on one key, 0 on the others.
    n = 64
    k = torch.eye(n).expand(1, 1, n, n).contiguous()
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    q = (100.0 * torch.eye(n)[perm]).expand(1, 2, n, n).contiguous()
    _, stats = qkv.attention(q, k, k, scale=1.0, return_stats=True, backend=backend)
    assert torch.all(stats["max_weight_mean"] == 1.0)
    assert torch.all(stats["max_weight_max"] == 1.0)
    assert torch.all(stats["entropy_mean"] >= 0) and torch.all(stats["entropy_mean"] < 1e-30)
    assert torch.all(stats["saturated_share"] == 1.0)
    # The same inputs at the 1/√d scale (logits 12.5): still mostly one key, but the
    # entropy sees the rest.
    _, scaled = qkv.attention(q, k, k, return_stats=True, backend=backend)
    assert torch.all(scaled["entropy_mean"] > 1e-3)


def test_uniform_rows_have_entropy_log_n(backend):
    q, k, v = random_qkv(2, 3, 3, 100, 100, 8)
    q.zero_()
    _, stats = qkv.attention(q, k, v, causal="top_left", return_row_stats=True,
                             backend=backend)
    keys = torch.arange(1, 101, dtype=torch.float64)
    torch.testing.assert_close(stats["row_entropy"].double(), keys.log().expand(2, 3, 100),
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(stats["row_max_weight"].double(), (1 / keys).expand(2, 3, 100),
                               rtol=0, atol=1e-7)
    torch.testing.assert_close(stats["entropy_mean"].double(),
                               torch.full((2, 3), keys.log().mean().item(), dtype=torch.float64),
                               rtol=0, atol=1e-6)


def test_rows_without_keys_are_not_counted():
    q, k, v = random_qkv(2, 2, 2, 4, 6, 8)
    _, stats = qkv.attention(q, k, v, key_lengths=[0, 6], return_row_stats=True)
    assert stats["rows"].tolist() == [[0, 0], [4, 4]]
    assert torch.isnan(stats["entropy_mean"][0]).all()
    assert torch.isnan(stats["max_weight_max"][0]).all()
    assert (stats["row_max_weight"][0] == 0).all() and (stats["row_entropy"][0] == 0).all()
    assert not torch.isnan(stats["entropy_mean"][1]).any()


def test_deterministic_across_thread_counts():
    q, k, v, kwargs, _ = case_inputs("everything", torch.float32)
    first = qkv.attention(q, k, v, return_row_stats=True, threads=1, backend="cpu", **kwargs)[1]
    for threads in (2, 3, 8):
        again = qkv.attention(q, k, v, return_row_stats=True, threads=threads, backend="cpu",
                              **kwargs)[1]
        for key in first:
            assert torch.equal(first[key].nan_to_num(-1), again[key].nan_to_num(-1)), key


def test_autograd_still_works_with_stats():
    # (More than 16 queries: fewer would take the decode kernel without statistics, and
    # the tiled forward with them, equal only up to rounding.)
    q, k, v = random_qkv(1, 2, 1, 20, 23, 8)
    for x in (q, k, v):
        x.requires_grad_(True)
    out, stats = qkv.attention(q, k, v, causal="top_left", return_stats=True)
    assert not any(x.requires_grad for x in stats.values())
    out.square().sum().backward()
    expected = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    qkv.attention(q, k, v, causal="top_left").square().sum().backward()
    for x, g in zip((q, k, v), expected):
        assert torch.equal(x.grad, g)


def test_threshold_errors():
    q, k, v = random_qkv(1, 1, 1, 3, 3, 4)
    with pytest.raises(qkv.Error, match="saturation_threshold: expected a weight in"):
        qkv.attention(q, k, v, return_stats=True, saturation_threshold=1.5)
    with pytest.raises(TypeError, match="saturation_threshold"):
        qkv.attention(q, k, v, return_stats=True, saturation_threshold="high")
    with pytest.raises(qkv.Error, match="saturation_threshold"):
        qkv.torch.collect_stats(saturation_threshold=-0.1).__enter__()


# ---- varlen --------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_varlen_stats_equal_dense_per_sequence(causal, backend):
    q_lens, k_lens = [5, 0, 70, 3], [7, 4, 90, 0]
    heads, kv_heads, d = 4, 2, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(q_lens), heads, d, generator=g)
    k = torch.randn(sum(k_lens), kv_heads, d, generator=g)
    v = torch.randn(sum(k_lens), kv_heads, d, generator=g)
    cu_q = torch.tensor(np.cumsum([0, *q_lens]), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0, *k_lens]), dtype=torch.int32)
    out, stats = qkv.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, return_row_stats=True,
                                      backend=backend)
    assert stats["max_weight_mean"].shape == (4, heads)
    assert stats["row_entropy"].shape == (heads, sum(q_lens))
    for s, (nq, nk) in enumerate(zip(q_lens, k_lens)):
        rows_q = slice(int(cu_q[s]), int(cu_q[s + 1]))
        rows_k = slice(int(cu_k[s]), int(cu_k[s + 1]))
        dense_q = q[rows_q].transpose(0, 1)[None]
        dense_k = k[rows_k].transpose(0, 1)[None]
        dense_v = v[rows_k].transpose(0, 1)[None]
        _, dense = qkv.attention(dense_q, dense_k, dense_v, causal=causal,
                                 return_row_stats=True, backend=backend)
        for key in HEAD_KEYS:
            assert torch.equal(stats[key][s].nan_to_num(-1), dense[key][0].nan_to_num(-1)), key
        for key in ROW_KEYS:
            assert torch.equal(stats[key][:, rows_q], dense[key][0]), key


def test_varlen_numpy_and_autograd():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(12, 2, 8, generator=g, requires_grad=True)
    k = torch.randn(15, 1, 8, generator=g, requires_grad=True)
    v = torch.randn(15, 1, 8, generator=g, requires_grad=True)
    cu_q, cu_k = [0, 5, 12], [0, 9, 15]
    out, lse, stats = qkv.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True,
                                           return_stats=True)
    out.sum().backward()
    assert q.grad is not None
    out_np, stats_np = qkv.varlen_attention(q.detach().numpy(), k.detach().numpy(),
                                            v.detach().numpy(), np.array(cu_q), np.array(cu_k),
                                            return_stats=True)
    for key in HEAD_KEYS:
        np.testing.assert_array_equal(stats_np[key], stats[key].numpy())


# ---- qkv.torch.collect_stats ---------------------------------------------------------


def test_collect_stats_records_every_call_and_changes_nothing():
    q, k, v = random_qkv(2, 4, 4, 33, 33, 16)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    plain = qkv.torch.scaled_dot_product_attention(q, k, v, is_causal=True)
    with qkv.torch.collect_stats() as stats:
        with qkv.torch.stats_label("layer 0"):
            first = qkv.torch.scaled_dot_product_attention(q, k, v, is_causal=True)
        second = qkv.torch.scaled_dot_product_attention(q[:1], k[:1], v[:1])
    assert torch.equal(first, plain)
    torch.testing.assert_close(first, expected)
    assert [r["call"] for r in stats] == [0, 1]
    assert [r["label"] for r in stats] == ["layer 0", None]
    assert stats[0]["shape"] == (2, 4, 33, 33) and stats[1]["shape"] == (1, 4, 33, 33)
    assert set(stats[0]) == {"call", "label", "shape", *HEAD_KEYS}
    _, direct = qkv.attention(q, k, v, causal="top_left", return_stats=True)
    for key in HEAD_KEYS:
        assert torch.equal(stats[0][key], direct[key]), key
    assert torch.equal(second, qkv.attention(q[:1], k[:1], v[:1]))
    # Outside the block nothing is recorded.
    qkv.torch.scaled_dot_product_attention(q, k, v)
    assert len(stats) == 2


def test_collect_stats_rows_threshold_nesting_and_training():
    q, k, v = random_qkv(1, 2, 2, 20, 20, 8)
    q.requires_grad_(True)
    mask = torch.rand(20, 20, generator=torch.Generator().manual_seed(5)) < 0.8
    with qkv.torch.collect_stats() as outer:
        with qkv.torch.collect_stats(row_stats=True, saturation_threshold=0.2) as inner:
            out = qkv.torch.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out.sum().backward()  # the statistics take no part in autograd
    assert q.grad is not None and len(outer) == 1 and len(inner) == 1
    record = inner[0]
    assert outer[0]["entropy_mean"] is record["entropy_mean"]
    assert record["row_entropy"].shape == (1, 2, 20)
    check_against_torch({key: record[key] for key in (*HEAD_KEYS, *ROW_KEYS)}, q.detach(), k,
                        threshold=0.2, keep=mask.expand(1, 1, 20, 20))


def test_collect_stats_labels_layers_of_a_model():
    layers = [torch.nn.Linear(32, 96) for _ in range(3)]
    x = torch.randn(3, 10, 32)
    with qkv.torch.collect_stats() as stats:
        for depth, layer in enumerate(layers):
            q, k, v = layer(x).view(3, 10, 3, 4, 8).permute(2, 0, 3, 1, 4)
            with qkv.torch.stats_label(f"layers.{depth}.attn"):
                x = x + qkv.torch.scaled_dot_product_attention(
                    q, k, v, is_causal=True).transpose(1, 2).reshape(3, 10, 32)
    assert [r["label"] for r in stats] == [f"layers.{d}.attn" for d in range(3)]
    assert all(r["rows"].eq(10).all() for r in stats)
    assert all(math.isfinite(r["entropy_mean"].sum().item()) for r in stats)


def test_collect_stats_under_torch_compile_records_nothing_and_still_runs():
    """Traced calls go through qkv's operator, which has no statistics output: inside a
    collector a compiled model runs unchanged (fullgraph) and adds no record."""
    torch._dynamo.reset()

    def f(q, k, v):
        return qkv.torch.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = random_qkv(1, 2, 2, 20, 20, 8)  # > 16 queries: the tiled forward either way
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    with qkv.torch.collect_stats() as stats:
        traced = compiled(q, k, v)
        eager = f(q, k, v)
    assert torch.equal(traced, eager)
    assert len(stats) == 1  # the eager call only
    # Asking for statistics explicitly inside traced code is the operator
    # torch.ops.qkv.attention_forward_stats: the eager call's values.
    compiled = torch.compile(lambda q, k, v: qkv.attention(q, k, v, return_stats=True)[1],
                             backend="aot_eager", fullgraph=True)
    eager = qkv.attention(q, k, v, return_stats=True)[1]
    traced = compiled(q, k, v)
    assert list(traced) == list(eager)
    assert all(torch.equal(traced[key], eager[key]) for key in eager)


@pytest.mark.parametrize("variant", [dict(window=(32, 0)), dict(softcap=3.0),
                                     dict(alibi_slopes=[0.5, 0.25, 0.125, 0.0625]),
                                     dict(sinks=[0.5, -1.0, 2.0, 0.0]),
                                     dict(dropout_p=0.2, seed=3)])
def test_variants_stats_float32_cpu_against_float64_reference(variant):
    """The statistics of the P each variant computes (dropout: of P before dropout), the
    cpu kernels against the reference in float64 (a fixed 2e-5: the cpu rows are within
    2e-6 of float64 on these shapes without variants)."""
    q, k, v = random_qkv(2, 4, 2, 90, 120, 16, dtype=torch.float64, seed=9)
    kwargs = dict(variant)
    for key in ("alibi_slopes", "sinks"):
        if key in kwargs:
            kwargs[key] = torch.tensor(kwargs[key], dtype=torch.float32)
    _, exact = qkv.attention(q, k, v, causal="bottom_right", return_row_stats=True, **kwargs)
    _, ours = qkv.attention(q.float(), k.float(), v.float(), causal="bottom_right",
                            return_row_stats=True, backend="cpu", **kwargs)
    assert torch.equal(ours["rows"], exact["rows"])
    for key in ("max_weight_mean", "entropy_mean", *ROW_KEYS):
        torch.testing.assert_close(ours[key].double(), exact[key], rtol=0, atol=2e-5,
                                   msg=lambda m, key=key: f"{key}: {m}")
    if "dropout_p" in variant:  # the statistics of P itself
        _, undropped = qkv.attention(q.float(), k.float(), v.float(), causal="bottom_right",
                                     return_row_stats=True, backend="cpu")
        assert torch.equal(ours["row_entropy"], undropped["row_entropy"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_give_float32_statistics_of_the_widened_values(dtype):
    """16-bit inputs are widened exactly to float32: the statistics (float32, like lse)
    are the bits of a float32 call on the widened values. precision="exact": the default
    "fast" may sum bfloat16 Q·Kᵀ on the CPU's dot-product units in another order (docs/numerics.md;
    AMD's AVX512-BF16)."""
    q, k, v = (x.to(dtype) for x in random_qkv(2, 4, 2, 40, 50, 16, seed=12))
    _, stats = qkv.attention(q, k, v, causal="bottom_right", return_row_stats=True,
                             backend="cpu", precision="exact")
    _, widened = qkv.attention(q.float(), k.float(), v.float(), causal="bottom_right",
                               return_row_stats=True, backend="cpu")
    for key in (*HEAD_KEYS, *ROW_KEYS):
        assert stats[key].dtype == widened[key].dtype, key
        assert torch.equal(stats[key], widened[key]), key
