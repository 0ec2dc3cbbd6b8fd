"""float8 KV caches from Python: caller-owned torch.float8_e4m3fn / float8_e5m2 tensors
and ml_dtypes arrays through qkv.decode and qkv.BatchPlan.run, and qkv.KVCache with
float8 storage.

The oracle is torch's own float8 conversion, which defines the formats here: a cache
holds bytes c and a scale s, and the values attention reads are ``c.to(torch.float32) *
s`` (float32, as torch computes it). The reference is attention over those values in
float64 (bottom-right causal, GQA by repeating kv heads).

Tolerance (TOL below): the kernel computes in float32 what the reference computes in
float64 over the same stored values, so the only error is float32 rounding: dot products
of d ≤ 40 terms scaled by s (logits of order 10, whose absolute error exp turns into a
relative one), then sums over at most 64 keys, each step a relative error of an ulp
(ε = 2⁻²⁴). The bound used, 2⁻¹⁶ = 256 ε of the largest stored |v|, is about 14× the
largest error measured over every case here (≤ 1.1e-6 of max |v| across seeds), and far below what a
wrong scale, a swapped head or a misread byte gives (one code step is 2⁻³ (e4m3fn) or
2⁻² (e5m2) of a value; swapping the two heads' value scales errs by 0.35 of max |v|).
"""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest
import torch

import qkv
from qkv import _qkv

TOL = 2.0**-16  # of max |v|: float32 rounding against the fp64 reference (module docstring)

# (torch dtype, ml_dtypes type, largest finite value, the positive NaN code).
FORMATS = {
    "float8_e4m3fn": (torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn, 448.0, 0x7F),
    "float8_e5m2": (torch.float8_e5m2, ml_dtypes.float8_e5m2, 57344.0, 0x7E),
}
FORMAT_NAMES = list(FORMATS)


def quantize(x, fmt, scale):
    """torch's float8 bytes of x / scale, finite values beyond the format clipped first
    (what qkv's narrowing does, whatever torch's cast does there: torch 2.13's CPU cast
    saturates e4m3fn but overflows e5m2 to inf). x [..., Hkv, d] float32; scale a float
    or a per-head [Hkv] tensor."""
    dtype, _, largest, _ = FORMATS[fmt]
    s = torch.as_tensor(scale, dtype=torch.float32)
    s = s[:, None] if s.ndim == 1 else s
    return (x / s).clamp(-largest, largest).to(dtype)


def dequantize(x8, scale):
    """The stored values by torch's definition: x8.to(float32) * scale (per head [.., Hkv, d])."""
    s = torch.as_tensor(scale, dtype=torch.float32)
    return x8.to(torch.float32) * (s[:, None] if s.ndim == 1 else s)


def head_scales(x, fmt, per_head):
    """max |x| / the format's largest: per kv head ([Hkv] tensor) or per tensor (a float).
    x [B, N, Hkv, d]."""
    largest = FORMATS[fmt][2]
    if per_head:
        return x.abs().amax(dim=(0, 1, 3)) / largest
    return float(x.abs().max()) / largest


def reference(q, k, v, lengths):
    """fp64 attention of q [B, Nq, Hq, d] over k, v [B, N, Hkv, d] (stored values),
    bottom-right causal over each sequence's first lengths[b] keys; rows that see no key
    are 0 (qkv's rule). Returns [B, Nq, Hq, dv] float64."""
    batch, nq, hq, d = q.shape
    group = hq // k.shape[2]
    out = torch.zeros(batch, nq, hq, v.shape[-1], dtype=torch.float64)
    for b, n in enumerate(lengths):
        kb = k[b, :n].double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n, d]
        vb = v[b, :n].double().repeat_interleave(group, dim=1).transpose(0, 1)
        s = q[b].double().transpose(0, 1) @ kb.transpose(1, 2) / math.sqrt(d)  # [Hq, Nq, n]
        visible = torch.arange(n)[None, :] <= torch.arange(nq)[:, None] + n - nq
        p = torch.softmax(s.masked_fill(~visible, -math.inf), dim=-1).nan_to_num(0.0)
        out[b] = (p @ vb).transpose(0, 1)
    return out


def assert_close(out, want, v_stored):
    bound = TOL * float(v_stored.abs().max())
    error = float((torch.as_tensor(out).double() - want).abs().max())
    assert error <= bound, f"max error {error:.3g} > {bound:.3g}"


def random_kv(batch, n, hkv, d, seed):
    """k, v [B, N, Hkv, d] float32, kv head h h·9+1 times larger than head 0 (so that a
    per-head scale matters and a wrong head shows)."""
    g = torch.Generator().manual_seed(seed)
    gain = (torch.arange(hkv, dtype=torch.float32) * 9 + 1)[:, None]
    return (torch.randn(batch, n, hkv, d, generator=g) * gain, torch.randn(batch, n, hkv, d, generator=g) * 2 * gain)


def as_kind(x8, kind):
    """A float8 torch tensor as the caller's array: itself, or an ml_dtypes NumPy array
    over the same bytes."""
    if kind == "torch":
        return x8
    return x8.view(torch.uint8).numpy().view(FORMATS[str(x8.dtype).replace("torch.", "")][1])


def scale_argument(scale, kind):
    """A scale as a caller passes it: a Python float, a torch tensor or a NumPy array."""
    if isinstance(scale, float):
        return scale if kind == "numpy" else torch.tensor(scale)
    return scale if kind == "torch" else scale.numpy()


def poison(x8, fmt):
    """x8 with every byte a NaN code (rows that must never be read)."""
    x8.view(torch.uint8).fill_(FORMATS[fmt][3])
    return x8


def paged_pool(x8, lengths, block_size, fmt, seed):
    """(pool [num_blocks, block_size, Hkv, d], block_table int32 [B, blocks]) holding the
    rows of x8 [B, capacity, Hkv, d] in shuffled blocks, two spare blocks and the rows past
    each length NaN codes."""
    batch, capacity = x8.shape[:2]
    per_seq = capacity // block_size
    num_blocks = batch * per_seq + 2
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    pool = poison(torch.empty(num_blocks, block_size, *x8.shape[2:], dtype=x8.dtype), fmt)
    table = order[: batch * per_seq].reshape(batch, per_seq).to(torch.int32)
    for b in range(batch):
        for j in range(lengths[b]):
            pool[table[b, j // block_size], j % block_size] = x8[b, j]
    return pool, table


# -- qkv.decode over caller-owned float8 caches ------------------------------------------


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("nq", [1, 3])
@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_decode_matches_fp64_attention_over_the_stored_values(fmt, per_head, paged, nq, kind):
    batch, capacity, hkv, hq, d, lengths = 3, 64, 2, 6, 40, [37, 2, 64]
    k, v = random_kv(batch, capacity, hkv, d, seed=nq)
    k_scale, v_scale = head_scales(k, fmt, per_head), head_scales(v, fmt, per_head)
    k8, v8 = quantize(k, fmt, k_scale), quantize(v, fmt, v_scale)
    k_stored, v_stored = dequantize(k8, k_scale), dequantize(v8, v_scale)
    for b, n in enumerate(lengths):  # keys past a length are never read
        poison(k8[b, n:], fmt), poison(v8[b, n:], fmt)
    q = torch.randn(batch, nq, hq, d)
    want = reference(q, k_stored, v_stored, lengths)
    scales = dict(k_scale=scale_argument(k_scale, kind), v_scale=scale_argument(v_scale, kind))
    q_in = q if kind == "torch" else q.numpy()
    if paged:
        k_pool, table = paged_pool(k8, lengths, 16, fmt, seed=1)
        v_pool, _ = paged_pool(v8, lengths, 16, fmt, seed=1)
        out = qkv.decode(q_in, as_kind(k_pool, kind), as_kind(v_pool, kind), lengths, block_table=table.numpy(),
                         layout="bshd", **scales)
    else:  # torch in PyTorch's [B, H, N, d] layout (a transposed view), NumPy in [B, N, H, d]
        layout = "bhsd" if kind == "torch" else "bshd"
        if layout == "bhsd":
            k8, v8, q_in = k8.transpose(1, 2), v8.transpose(1, 2), q.transpose(1, 2)
        out = qkv.decode(q_in, as_kind(k8, kind), as_kind(v8, kind), lengths, layout=layout, **scales)
        if layout == "bhsd":
            out = out.transpose(1, 2)
    assert_close(out, want, v_stored)


def test_decode_with_values_in_the_keys_lends_them_the_key_scales():
    """v_cache=None (K = V layers, MLA's latent cache): the values are the float8 keys'
    first v_dim channels, scaled by k_scale."""
    k = torch.randn(2, 20, 2, 16) * torch.tensor([1.0, 10.0])[:, None]
    k_scale = head_scales(k, "float8_e5m2", per_head=True)
    k8 = quantize(k, "float8_e5m2", k_scale)
    stored = dequantize(k8, k_scale)
    q = torch.randn(2, 1, 4, 16)
    out = qkv.decode(q, k8, None, [20, 9], v_dim=8, layout="bshd", k_scale=k_scale)
    assert_close(out, reference(q, stored, stored[..., :8], [20, 9]), stored[..., :8])
    with pytest.raises(qkv.Error, match="v_scale: not with v_cache=None"):
        qkv.decode(q, k8, None, [20, 9], v_dim=8, layout="bshd", k_scale=k_scale, v_scale=k_scale)


def test_decode_reads_float8_caches_and_scales_in_place():
    """No copy: the library is handed the caller's float8 bytes (same address, same
    strides: a transposed torch view stays transposed), and per-head / per-tensor scales
    as views that repeat them along the rows by strides 0."""
    _qkv._debug_record_views(True)
    try:
        k8 = quantize(torch.randn(2, 8, 3, 16), "float8_e4m3fn", 0.01).transpose(1, 2)  # [B, Hkv, N, d] view
        v8 = quantize(torch.randn(2, 8, 3, 16), "float8_e4m3fn", 0.02).transpose(1, 2)
        qkv.decode(torch.randn(2, 3, 1, 16), k8, v8, [8, 5], k_scale=[0.01, 0.02, 0.03], v_scale=0.02)
        views = _qkv._debug_last_views()
        for name, x in (("k_cache", k8), ("v_cache", v8)):
            address, shape, strides = views[name]
            assert address == x.data_ptr(), f"{name} was copied"
            assert strides == (x.stride(0), x.stride(2), x.stride(1), x.stride(3))
        assert views["k_scale"][1:] == ((2, 8, 3), (0, 0, 1))  # per kv head
        assert views["v_scale"][1:] == ((2, 8, 3), (0, 0, 0))  # per tensor
        pool = quantize(torch.randn(5, 4, 3, 16), "float8_e5m2", 1.0)
        plan = qkv.BatchPlan([0, 1], [4], num_heads=3, num_kv_heads=3, head_dim=16,
                             block_table=np.array([[3]], np.int32), block_size=4)
        plan.run(torch.randn(1, 3, 16), pool, pool, k_scale=1.0, v_scale=np.ones(3, np.float32))
        views = _qkv._debug_last_views()
        assert views["k_cache"][0] == pool.data_ptr() and views["k_scale"][2] == (0, 0, 0)
    finally:
        _qkv._debug_record_views(False)


# -- BatchPlan.run over a mixed batch ----------------------------------------------------


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_batch_plan_runs_a_mixed_step_over_a_shuffled_float8_pool(fmt, per_head, kind):
    """Decode tokens and prefill chunks of four sequences in one planned step over a paged
    float8 pool with shuffled blocks; each sequence equals the fp64 reference."""
    hkv, hq, d, capacity, block = 2, 4, 32, 48, 16
    lengths, new = [40, 7, 48, 1], [1, 5, 16, 1]
    k, v = random_kv(len(lengths), capacity, hkv, d, seed=11)
    k_scale, v_scale = head_scales(k, fmt, per_head), head_scales(v, fmt, per_head)
    k8, v8 = quantize(k, fmt, k_scale), quantize(v, fmt, v_scale)
    k_pool, table = paged_pool(k8, lengths, block, fmt, seed=2)
    v_pool, _ = paged_pool(v8, lengths, block, fmt, seed=2)
    cu = np.concatenate([[0], np.cumsum(new)])
    q = torch.randn(int(cu[-1]), hq, d)
    plan = qkv.BatchPlan(cu, lengths, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_table=table,
                         block_size=block, dtype=FORMATS[fmt][0])
    out = plan.run(q if kind == "torch" else q.numpy(), as_kind(k_pool, kind), as_kind(v_pool, kind),
                   k_scale=scale_argument(k_scale, kind), v_scale=scale_argument(v_scale, kind))
    k_stored, v_stored = dequantize(k8, k_scale), dequantize(v8, v_scale)
    for b, n in enumerate(new):
        want = reference(q[None, cu[b]:cu[b + 1]], k_stored[b:b + 1], v_stored[b:b + 1], [lengths[b]])[0]
        assert_close(torch.as_tensor(out[cu[b]:cu[b + 1]]), want, v_stored)


# -- qkv.KVCache with float8 storage -----------------------------------------------------


def codes_and_midpoints(fmt):
    """Every finite value of the format, the midpoint between each pair of neighbours
    (ties: round to even decides) and values just beyond the largest (saturation)."""
    dtype, _, largest, _ = FORMATS[fmt]
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(torch.float32)
    finite = values[torch.isfinite(values)].unique()  # sorted, -largest .. largest
    midpoints = (finite[1:] + finite[:-1]) / 2  # exact in float32: 5 significant bits
    beyond = torch.tensor([largest * 1.03, largest * 1.2, largest * 2, 1e30, -largest * 1.2, -1e30])
    return torch.cat([finite, midpoints, beyond, torch.tensor([-0.0])])


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("scale", [1.0, 0.0371])
def test_kv_cache_quantizes_as_torch_does_to_the_bit(fmt, scale):
    """The bytes a float8 KVCache stores are torch's (x / scale).to(float8) for every value
    within range — every code, every midpoint between neighbours (round to nearest even),
    subnormals, -0 — and finite values beyond the range saturate to ±largest, the largest
    finite code (torch 2.13's CPU cast does so for e4m3fn and gives inf for e5m2; older
    casts gave NaN for e4m3fn)."""
    dtype, _, largest, _ = FORMATS[fmt]
    x = codes_and_midpoints(fmt) * scale
    d = 8
    x = torch.cat([x, torch.zeros((-len(x)) % (2 * d))]).reshape(1, -1, 2, d)  # [B, N, Hkv=2, d]
    n = x.shape[1]
    cache = qkv.KVCache(1, n, 2, d, dtype=fmt, layout="bshd", k_scale=scale, v_scale=[scale, scale])
    cache.append(x, -x)
    keys, values = cache.storage()
    assert keys.dtype == np.uint8
    want = quantize(x, fmt, scale)
    assert np.array_equal(keys[0], want[0].view(torch.uint8).numpy())
    assert np.array_equal(values[0], quantize(-x, fmt, scale)[0].view(torch.uint8).numpy())
    # stored() is torch's dequantization of those bytes, bitwise.
    k_stored, v_stored = cache.stored(0)
    assert torch.equal(torch.from_numpy(k_stored), dequantize(want[0], scale))
    # Beyond the range: the largest finite code, with the value's sign.
    beyond = (x / scale).abs() > largest * 1.125
    assert int(beyond.sum()) == 5
    largest_code = {"float8_e4m3fn": 0x7E, "float8_e5m2": 0x7B}[fmt]
    codes = torch.from_numpy(keys[0]).reshape(x.shape)[beyond]
    assert torch.equal(codes, torch.where(x[beyond] > 0, largest_code, largest_code | 0x80).to(torch.uint8))
    saturated = torch.tensor(largest) * torch.tensor(scale)  # float32, as stored() multiplies
    assert torch.equal(torch.from_numpy(k_stored).reshape(x.shape)[beyond].abs(), saturated.expand(int(beyond.sum())))
    # The torch view of the storage is a float8 tensor over the same bytes.
    tk, _ = cache.torch_storage()
    assert tk.dtype == dtype and tk.data_ptr() == keys.ctypes.data


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("given", ["computed", "per_tensor", "per_head"])
def test_kv_cache_appends_and_attends_over_its_stored_values(fmt, paged, given):
    """Append (prompt, then single tokens) and attend (GQA, Nq = 1 and 2): the scales are
    the given ones, or per kv head max|x| / largest of the first append; stored() is
    torch's float8 of x / scale times scale; attention equals the fp64 reference over it."""
    batch, capacity, hkv, hq, d = 2, 48, 2, 6, 24
    k, v = random_kv(batch, 12, hkv, d, seed=5)  # [B, T, Hkv, d]
    largest = FORMATS[fmt][2]
    scales = {"computed": {}, "per_tensor": dict(k_scale=0.05, v_scale=0.125),
              "per_head": dict(k_scale=[0.01, 0.1], v_scale=torch.tensor([0.02, 0.2]))}[given]
    cache = qkv.KVCache(batch, capacity, hkv, d, dtype=FORMATS[fmt][0], paged=paged, block_size=8, layout="bshd",
                        **scales)
    assert cache.dtype == fmt
    if given == "computed":
        assert cache.scales() is None  # not yet known
    cache.append(k[:, :10], v[:, :10])
    k_scale, v_scale = cache.scales()
    assert k_scale.shape == v_scale.shape == (hkv,) and k_scale.dtype == np.float32
    if given == "computed":  # from the first append only, in float32
        assert np.array_equal(k_scale, (k[:, :10].abs().amax(dim=(0, 1, 3)) / largest).numpy())
        assert np.array_equal(v_scale, (v[:, :10].abs().amax(dim=(0, 1, 3)) / largest).numpy())
    else:
        for got, name in ((k_scale, "k_scale"), (v_scale, "v_scale")):
            assert np.array_equal(got, np.broadcast_to(np.asarray(scales[name], dtype=np.float32), hkv))
    for t in (10, 11):  # later tokens (head 1's largest may exceed the first append's: saturation)
        cache.append(k[:, t:t + 1] * 1.5, v[:, t:t + 1] * 1.5)
    k_all = torch.cat([k[:, :10], k[:, 10:] * 1.5], dim=1)
    v_all = torch.cat([v[:, :10], v[:, 10:] * 1.5], dim=1)
    ks, vs = torch.from_numpy(k_scale), torch.from_numpy(v_scale)
    k_want, v_want = dequantize(quantize(k_all, fmt, ks), ks), dequantize(quantize(v_all, fmt, vs), vs)
    for b in range(batch):
        k_stored, v_stored = cache.stored(b)
        assert torch.equal(torch.from_numpy(k_stored), k_want[b])
        assert torch.equal(torch.from_numpy(v_stored), v_want[b])
    for nq in (1, 2):
        q = torch.randn(batch, nq, hq, d)
        out = cache.attend(q)
        assert_close(out, reference(q, k_want, v_want, cache.lengths), v_want)
    # BatchPlan.run over the cache itself reads the same values.
    cu = np.arange(batch + 1)
    plan = qkv.BatchPlan(cu, cache.lengths, num_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=fmt,
                         block_table=cache.block_table() if paged else None, block_size=8 if paged else None)
    q = torch.randn(batch, hq, d)
    out = plan.run(q, cache, None)
    assert_close(out, reference(q[:, None], k_want, v_want, cache.lengths)[:, 0], v_want)
    # reset keeps the scales.
    cache.reset()
    cache.append(k[:, :1] * 100, v[:, :1] * 100)
    assert np.array_equal(cache.scales()[0], k_scale)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_kv_cache_scales_ignore_non_finite_values_and_zero_heads(fmt):
    """Computed scales take the finite values only; a head with none nonzero gets 1. A
    non-finite value is never made finite: NaN stays NaN, inf is inf in e5m2 and NaN in
    e4m3fn, which has no infinity (torch 2.13's CPU cast makes it 448 there)."""
    largest = FORMATS[fmt][2]
    k = torch.zeros(1, 2, 2, 4)
    k[0, 0, 0] = torch.tensor([3.0, math.inf, -math.nan, -largest * 4])
    cache = qkv.KVCache(1, 4, 2, 4, dtype=fmt, layout="bshd")
    cache.append(k, k)
    assert cache.scales()[0].tolist() == [4.0, 1.0]
    stored = cache.stored(0)[0]
    assert stored[0, 0, 0] == 3.0 and np.isnan(stored[0, 0, 2]) and stored[0, 0, 3] == -largest * 4
    assert np.isnan(stored[0, 0, 1]) if fmt == "float8_e4m3fn" else stored[0, 0, 1] == math.inf


def test_kv_cache_dtype_spellings():
    for dtype in ("float8_e5m2", torch.float8_e5m2, ml_dtypes.float8_e5m2, np.dtype(ml_dtypes.float8_e5m2)):
        assert qkv.KVCache(1, 4, 1, 4, dtype=dtype).dtype == "float8_e5m2"


# -- errors: named, the same for the same bad value, nothing changed ---------------------


def _float8_call(fmt="float8_e4m3fn", hkv=2):
    q = torch.randn(1, 2 * hkv, 1, 8)
    k8 = quantize(torch.randn(1, hkv, 4, 8), fmt, 0.01)
    return q, k8


@pytest.mark.parametrize("bad, index, shown", [(0.0, 0, "0.000000"), (-1.0, 0, "-1.000000"),
                                               (math.nan, 0, "nan"), (math.inf, 0, "inf"), (1e39, 0, "inf"),
                                               ([1.0, 0.0], 1, "0.000000")])
def test_a_bad_scale_gets_the_same_words_from_every_entry_point(bad, index, shown):
    words = f"k_scale[{index}]: expected a positive finite scale, got {shown}"
    q, k8 = _float8_call()
    with pytest.raises(qkv.Error, match=rf"^qkv\.decode: {re.escape(words)}$"):
        qkv.decode(q, k8, k8, [4], k_scale=bad, v_scale=1.0)
    plan = qkv.BatchPlan([0, 1], [4], num_heads=4, num_kv_heads=2, head_dim=8)
    with pytest.raises(qkv.Error, match=rf"^qkv\.BatchPlan\.run: {re.escape(words)}$"):
        plan.run(q[0].transpose(0, 1), k8.transpose(1, 2), k8.transpose(1, 2), k_scale=bad, v_scale=1.0)
    with pytest.raises(qkv.Error, match=rf"^qkv::KVCache: config\.{re.escape(words)}$"):
        qkv.KVCache(1, 4, 2, 8, dtype="float8_e4m3fn", k_scale=bad, v_scale=1.0)


def test_scale_count_missing_and_misplaced_scales_are_named():
    q, k8 = _float8_call(hkv=2)
    count = r"k_scale: expected 1 \(per tensor\) or 2 \(k_cache.shape\[2\], per kv head\) scales for a float8 " \
            r"cache, got 3"
    with pytest.raises(qkv.Error, match=count):
        qkv.decode(q, k8, k8, [4], k_scale=[1.0, 2.0, 3.0], v_scale=1.0)
    with pytest.raises(qkv.Error, match=r"config.k_scale: expected 1 \(per tensor\) or 2 .* got 3"):
        qkv.KVCache(1, 4, 2, 8, dtype="float8_e4m3fn", k_scale=[1.0, 2.0, 3.0], v_scale=1.0)
    with pytest.raises(qkv.Error, match="k_scale: expected a float .* for a float8 cache, got shape"):
        qkv.decode(q, k8, k8, [4], k_scale=np.ones((1, 4, 2), np.float32), v_scale=1.0)
    # Missing: named (vLLM's 1.0 is spelled out, never assumed).
    with pytest.raises(qkv.Error, match=r"qkv.decode: k_scale: a float8 cache needs its scale.*k_scale=1.0"):
        qkv.decode(q, k8, k8, [4])
    with pytest.raises(qkv.Error, match=r"qkv.decode: v_scale: a float8 cache needs its scale"):
        qkv.decode(q, k8, k8, [4], k_scale=1.0)
    plan = qkv.BatchPlan([0, 1], [4], num_heads=4, num_kv_heads=2, head_dim=8)
    with pytest.raises(qkv.Error, match=r"qkv.BatchPlan.run: k_scale: a float8 cache needs its scale"):
        plan.run(q[0].transpose(0, 1), k8.transpose(1, 2), k8.transpose(1, 2))
    with pytest.raises(qkv.Error, match="config.v_scale: given without the other"):
        qkv.KVCache(1, 4, 2, 8, dtype="float8_e4m3fn", k_scale=1.0)
    with pytest.raises(TypeError, match="k_scale: expected a float"):
        qkv.decode(q, k8, k8, [4], k_scale="1.0", v_scale=1.0)
    # Scales for a cache that takes none.
    for cache in (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8).to(torch.bfloat16)):
        with pytest.raises(qkv.Error, match=r"k_scale: only int8 and float8 caches take scales \(this cache is"):
            qkv.decode(q, cache, cache, [4], k_scale=0.5, v_scale=0.5)
    with pytest.raises(qkv.Error, match="config.k_scale: only float8 caches take given scales"):
        qkv.KVCache(1, 4, 2, 8, dtype="int8", k_scale=1.0, v_scale=1.0)


def test_float8_dtype_mismatches_are_refused_by_name():
    q, k8 = _float8_call()
    e5 = k8.to(torch.float32).to(torch.float8_e5m2)
    for v in (e5, k8.to(torch.float32), as_kind(e5, "numpy")):
        with pytest.raises(TypeError, match="v_cache: expected the dtype of k_cache"):
            qkv.decode(q, k8, v, [4], k_scale=1.0, v_scale=1.0)
    fnuz = k8.to(torch.float32).to(torch.float8_e4m3fnuz)
    with pytest.raises(TypeError, match="k_cache: expected dtype float8_e4m3fn or float8_e5m2 among the float8 "
                                        r"formats \(the bits differ\), got float8_e4m3fnuz"):
        qkv.decode(q, fnuz, fnuz, [4], k_scale=1.0, v_scale=1.0)
    numpy_fnuz = np.zeros((1, 2, 4, 8), ml_dtypes.float8_e4m3fnuz)
    with pytest.raises(TypeError, match="got float8_e4m3fnuz"):
        qkv.decode(q.numpy(), numpy_fnuz, numpy_fnuz, [4], k_scale=1.0, v_scale=1.0)
    plan = qkv.BatchPlan([0, 1], [4], num_heads=4, num_kv_heads=2, head_dim=8)
    with pytest.raises(TypeError, match="v_cache: expected the dtype of k_cache"):
        plan.run(q[0].transpose(0, 1), k8.transpose(1, 2), e5.transpose(1, 2), k_scale=1.0, v_scale=1.0)


def test_nothing_is_written_or_changed_when_a_call_fails():
    """A bad scale is found before the kernel runs: the binding leaves out untouched; a
    failed append leaves a float8 cache without scales or tokens."""
    from qkv._decode_eager import _options

    q, k8 = _float8_call()
    q_lib = q.transpose(1, 2).contiguous().numpy()
    k_lib = k8.view(torch.uint8).transpose(1, 2).numpy()
    out = np.full((1, 1, 4, 8), 7.0, np.float32)
    options = _options("qkv.decode", q_lib, None, "bottom_right", None, None, None, None, None)
    for k_scale in (np.array([1.0, -2.0], np.float32), np.ones(3, np.float32), None):
        with pytest.raises(qkv.Error, match="k_scale"):
            _qkv.decode(q_lib, k_lib, k_lib, np.array([4]), out, bits_as="float8_e4m3fn", options=options,
                        k_scale=k_scale, v_scale=np.ones(1, np.float32))
        assert np.all(out == 7.0)
    _qkv.decode(q_lib, k_lib, k_lib, np.array([4]), out, bits_as="float8_e4m3fn", options=options,
                k_scale=np.ones(1, np.float32), v_scale=np.ones(1, np.float32))
    assert not np.any(out == 7.0)  # the same call with good scales writes it

    cache = qkv.KVCache(1, 4, 2, 8, dtype="float8_e5m2")
    with pytest.raises(qkv.Error):
        cache.append(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))  # past capacity
    assert cache.scales() is None and cache.lengths == [0]
    cache.append(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))
    assert cache.scales() is not None and cache.lengths == [4]


# -- torch.compile -----------------------------------------------------------------------


def test_float8_decode_and_plan_run_compile_to_the_eager_result():
    """Under torch.compile the calls are the operators torch.ops.qkv.decode and
    batch_plan_run, float scales passed as tensors: the same result as eagerly."""
    q, k8 = _float8_call("float8_e5m2")
    v8 = quantize(torch.randn(1, 2, 4, 8), "float8_e5m2", 0.02)
    scales = torch.tensor([0.01, 0.03])

    def step(q):
        return qkv.decode(q, k8, v8, torch.tensor([4]), k_scale=scales, v_scale=0.02)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(step, backend="aot_eager", fullgraph=True)(q), step(q))
    # opcheck's test_schema multiplies the inputs, which torch cannot do for float8
    # ("mul_cpu_reduced_float" not implemented): the fake and the traced graph are checked.
    torch.library.opcheck(torch.ops.qkv.decode.default,
                          (q, k8, v8, torch.tensor([4]), None, scales, torch.tensor(0.02), None, "bottom_right",
                           "bhsd", 1), test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    plan = qkv.BatchPlan([0, 1], [4], num_heads=4, num_kv_heads=2, head_dim=8)
    packed = q[0].transpose(0, 1)
    k_packed, v_packed = k8.transpose(1, 2), v8.transpose(1, 2)

    def layer(q):
        return plan.run(q, k_packed, v_packed, k_scale=0.01, v_scale=scales)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(layer, backend="aot_eager", fullgraph=True)(packed), layer(packed))
