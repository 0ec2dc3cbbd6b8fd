"""qkv.mla_decode over float8 latent caches kept as two arrays (c_kv and k_pe in
float8_e4m3fn / float8_e5m2, one scale per tensor each), against test_mla_decode.py's
float64 oracle of the formula over the stored values (the float8 elements times their
scale). precision="exact": the float32 bound of every other storage (TOL). "fast" (the
default; on an AVX512-BF16 CPU the latent step on vdpbf16ps, the query rounded to bf16 once
and each weight P·s once): within that plus 2^-8·max|v|, the most one bf16 rounding of the
weights moves a weighted sum of values (test_mla_decode.py's float8 pool bound). Equal
scales give exactly the bits of qkv.decode over the combined [c_kv | k_pe] pool; torch
tensors and ml_dtypes arrays alike; bad scales are refused by name; the torch operator
passes opcheck and compiles."""

import ml_dtypes
import numpy as np
import pytest
import torch

import qkv
from test_mla_decode import SCALE, TOL, lists, oracle

FORMATS = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
CKV_SCALE, KPE_SCALE = 0.05, 0.3


def make(rng, fmt, batch, q_len, heads, dc, dr, capacity, block_size=0, scales=(CKV_SCALE, KPE_SCALE)):
    """(q_nope, q_pe, ckv, kpe, table, stored c_kv rows, stored k_pe rows) — the caches in
    float8 with elements of about unit size over their scale; the stored rows per sequence
    (float64, element times scale) for the oracle."""
    dtype = getattr(torch, fmt)
    q_nope = torch.from_numpy(rng.standard_normal((batch, q_len, heads, dc)).astype(np.float32))
    q_pe = torch.from_numpy(rng.standard_normal((batch, q_len, heads, dr)).astype(np.float32))
    outer, inner = (batch * -(-capacity // block_size), block_size) if block_size else (batch, capacity)
    ckv = (torch.randn(outer, inner, dc) / scales[0]).to(dtype)
    kpe = (torch.randn(outer, inner, dr) / scales[1]).to(dtype)
    flat_c = ckv.double().reshape(-1, dc).numpy() * scales[0]
    flat_p = kpe.double().reshape(-1, dr).numpy() * scales[1]
    if not block_size:
        rows = [np.arange(capacity) + b * capacity for b in range(batch)]
        return q_nope, q_pe, ckv, kpe, None, [flat_c[r] for r in rows], [flat_p[r] for r in rows]
    table = torch.from_numpy(rng.permutation(outer).reshape(batch, -1).astype(np.int32))
    rows = [np.array([int(table[b, j // block_size]) * block_size + j % block_size for j in range(capacity)])
            for b in range(batch)]
    return q_nope, q_pe, ckv, kpe, table, [flat_c[r] for r in rows], [flat_p[r] for r in rows]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("block_size", [0, 16])
@pytest.mark.parametrize("q_len", [1, 3])
def test_two_float8_arrays_match_the_formula(fmt, block_size, q_len):
    rng = np.random.default_rng(q_len * 7 + block_size)
    lengths = [0, 5, 300]
    q_nope, q_pe, ckv, kpe, table, c_rows, p_rows = make(rng, fmt, 3, q_len, 16, 64, 16, 304, block_size)
    fast_bound = TOL + 2.0 ** -8 * max(np.abs(r).max() for r in c_rows)
    for idx in (None, lists(rng, 3, q_len, 40, lengths)):
        want, want_lse = oracle(q_nope.numpy(), q_pe.numpy(), c_rows, p_rows, lengths, idx)
        for precision, bound in (("exact", TOL), ("fast", fast_bound)):
            out, lse = qkv.mla_decode(q_nope, q_pe, ckv, kpe, torch.tensor(lengths), block_table=table, scale=SCALE,
                                      indices=None if idx is None else torch.from_numpy(idx), return_lse=True,
                                      ckv_scale=CKV_SCALE, kpe_scale=torch.tensor(KPE_SCALE), precision=precision)
            np.testing.assert_allclose(out.numpy(), want, atol=bound, rtol=0, err_msg=precision)
            finite = np.isfinite(want_lse)
            np.testing.assert_allclose(lse.numpy()[finite], want_lse[finite], atol=max(bound, 1e-4), rtol=1e-6)
            assert np.all(np.isneginf(lse.numpy()[~finite]))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_equal_scales_give_the_combined_pools_bits(fmt):
    """One scale for both parts: the same bits as qkv.decode over the [c_kv | k_pe] pool with
    that per-tensor scale (v_cache=None, the values its first dc channels), both precisions;
    ml_dtypes arrays give the torch tensors' bits."""
    rng = np.random.default_rng(31)
    s8 = 0.04
    q_nope, q_pe, ckv, kpe, _, _, _ = make(rng, fmt, 2, 2, 16, 64, 16, 300, scales=(s8, s8))
    lengths = torch.tensor([300, 77])
    pool = torch.cat([ckv, kpe], dim=-1)[:, :, None, :]  # [B, cap, 1, dc + dr]
    q = torch.cat([q_nope, q_pe], dim=-1)
    for precision in ("exact", "fast"):
        got = qkv.mla_decode(q_nope, q_pe, ckv, kpe, lengths, scale=SCALE, ckv_scale=s8, kpe_scale=s8,
                             precision=precision)
        pooled = qkv.decode(q, pool, None, lengths, v_dim=64, scale=SCALE, layout="bshd", k_scale=s8,
                            precision=precision)
        assert torch.equal(got, pooled), precision
        as_numpy = [x.view(torch.uint8).numpy().view(FORMATS[fmt]) for x in (ckv, kpe)]
        from_numpy = qkv.mla_decode(q_nope.numpy(), q_pe.numpy(), *as_numpy, lengths.numpy(), scale=SCALE,
                                    ckv_scale=s8, kpe_scale=s8, precision=precision)
        assert np.array_equal(from_numpy, got.numpy()), precision


def test_bad_scales_are_refused_by_name():
    rng = np.random.default_rng(37)
    q_nope, q_pe, ckv, kpe, _, _, _ = make(rng, "float8_e4m3fn", 2, 1, 4, 16, 8, 12)
    lengths = torch.tensor([5, 12])

    def call(**scales):
        return qkv.mla_decode(q_nope, q_pe, ckv, kpe, lengths, scale=SCALE, **scales)

    with pytest.raises(qkv.Error, match="mla_decode: ckv_scale: a float8 cache needs its scale"):
        call(kpe_scale=1.0)
    with pytest.raises(qkv.Error, match="kpe_scale: a float8 cache needs its scale"):
        call(ckv_scale=1.0)
    with pytest.raises(qkv.Error, match="ckv_scale: expected a positive finite scale, got -2"):
        call(ckv_scale=-2.0, kpe_scale=1.0)
    with pytest.raises(qkv.Error, match="kpe_scale: expected a positive finite scale, got nan"):
        call(ckv_scale=1.0, kpe_scale=float("nan"))
    with pytest.raises(qkv.Error, match=r"kpe_scale: expected one scale \(per tensor\).*got 2"):
        call(ckv_scale=1.0, kpe_scale=torch.tensor([1.0, 2.0]))
    with pytest.raises(qkv.Error, match="kpe_scale: kpe_scale / ckv_scale"):
        call(ckv_scale=1e-30, kpe_scale=1e30)
    bf16 = [x.float().bfloat16() for x in (ckv, kpe)]
    with pytest.raises(qkv.Error, match="ckv_scale: only float8 caches take scales"):
        qkv.mla_decode(q_nope, q_pe, *bf16, lengths, scale=SCALE, ckv_scale=1.0)
    with pytest.raises(TypeError, match="kpe_cache: expected the dtype of ckv_cache"):
        qkv.mla_decode(q_nope, q_pe, ckv, kpe.float().bfloat16(), lengths, scale=SCALE, ckv_scale=1.0,
                       kpe_scale=1.0)  # FlashMLA's layout (k_pe in bf16) is not this call's


def test_torch_operator_with_scales_passes_opcheck_and_compiles():
    import qkv.torch  # noqa: F401  (registers the operators)

    rng = np.random.default_rng(41)
    q_nope, q_pe, ckv, kpe, table, _, _ = make(rng, "float8_e5m2", 2, 2, 4, 16, 8, 24, 8)
    lengths = torch.tensor([20, 6])
    idx = torch.from_numpy(lists(rng, 2, 2, 5, [20, 6]))
    scales = torch.tensor(CKV_SCALE), torch.tensor(KPE_SCALE)
    args = (q_nope, q_pe, ckv, kpe, lengths, table, SCALE, "bottom_right", 1, 0.0, None, idx, *scales)
    # opcheck's test_schema multiplies the inputs, which torch cannot do for float8
    # ("mul_cpu_reduced_float" not implemented): the fake and the traced graph are checked
    # (as test_float8.py does for torch.ops.qkv.decode).
    torch.library.opcheck(torch.ops.qkv.mla_decode.default, args,
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    out = torch.ops.qkv.mla_decode(*args)[0]
    eager = qkv.mla_decode(q_nope, q_pe, ckv, kpe, lengths, block_table=table, scale=SCALE, indices=idx,
                           ckv_scale=CKV_SCALE, kpe_scale=KPE_SCALE)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)

    def step(qn, qp):
        return qkv.mla_decode(qn, qp, ckv, kpe, lengths, block_table=table, scale=SCALE, indices=idx,
                              ckv_scale=scales[0], kpe_scale=scales[1]) * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q_nope, q_pe), eager * 2, rtol=0, atol=0)
