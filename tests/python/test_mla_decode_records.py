"""qkv.mla_decode(..., cache_format="fp8_ds_mla") over FlashMLA's FP8 records (vLLM's
kv_cache_dtype of that name): per token dc float8_e4m3fn latent values, dc/128 float32
scales (one per 128 values), dr bfloat16 rotary values, as one uint8 array. The records
are written by qkv.pack_mla_records (torch's casts), read back here byte by byte with NumPy
and ml_dtypes (the layout, apart from either side of qkv), and the results checked against test_mla_decode.py's float64 oracle of the stored values (e4m3 times
its group's scale, rounded once to float32; k_pe's bf16 values). precision="exact": the
float32 bound of every other storage (TOL). "fast" with power-of-two scales (every stored
value a bf16 value: the latent step on vdpbf16ps where the CPU has it, q rounded to bf16
once and each weight P once): within 2x the error of PyTorch's bf16 formula over the same
stored values (the bf16 contract). Other scales keep the float kernel: fast gives exact's
bits. Torch tensors and NumPy arrays alike; bad calls refused by
name; the torch operator passes opcheck and compiles."""

import ml_dtypes
import numpy as np
import pytest
import torch

import qkv
from test_mla_decode import SCALE, TOL, lists, oracle


def unpack(records, dc, dr):
    """(stored c_kv, stored k_pe) float64 from the record bytes, read with NumPy and
    ml_dtypes (apart from the torch casts that packed them): e4m3 times its group's float32
    scale, rounded to float32 once; the bf16 rotary values."""
    raw = np.ascontiguousarray(records.numpy() if isinstance(records, torch.Tensor) else records)
    lead = raw.shape[:-1]
    e4m3 = raw[..., :dc].copy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scales = raw[..., dc:dc + 4 * (dc // 128)].copy().view("<f4")
    rope = raw[..., dc + 4 * (dc // 128):].copy().view(ml_dtypes.bfloat16).astype(np.float64)
    stored = (e4m3.reshape(*lead, dc // 128, 128) * scales[..., None]).astype(np.float32)
    return stored.reshape(*lead, dc).astype(np.float64), rope


def make(rng, batch, q_len, heads, dc, dr, capacity, block_size=0, powers_of_two=False):
    q_nope = torch.from_numpy(rng.standard_normal((batch, q_len, heads, dc)).astype(np.float32))
    q_pe = torch.from_numpy(rng.standard_normal((batch, q_len, heads, dr)).astype(np.float32))
    outer, inner = (batch * -(-capacity // block_size), block_size) if block_size else (batch, capacity)
    sizes = torch.from_numpy(rng.uniform(0.25, 2.0, (outer, inner, dc // 128, 1)).astype(np.float32))
    c_kv = (torch.randn(outer, inner, dc // 128, 128) * sizes).reshape(outer, inner, dc)
    records = qkv.pack_mla_records(c_kv, torch.randn(outer, inner, dr), power_of_two_scales=powers_of_two)
    stored_c, stored_p = unpack(records, dc, dr)
    flat_c, flat_p = stored_c.reshape(-1, dc), stored_p.reshape(-1, dr)
    if not block_size:
        rows = [np.arange(capacity) + b * capacity for b in range(batch)]
        return q_nope, q_pe, records, None, [flat_c[r] for r in rows], [flat_p[r] for r in rows]
    table = torch.from_numpy(rng.permutation(outer).reshape(batch, -1).astype(np.int32))
    rows = [np.array([int(table[b, j // block_size]) * block_size + j % block_size for j in range(capacity)])
            for b in range(batch)]
    return q_nope, q_pe, records, table, [flat_c[r] for r in rows], [flat_p[r] for r in rows]


def torch_bf16_formula(q_nope, q_pe, c_rows, p_rows, lengths, idx):
    """PyTorch's bf16 evaluation of the formula over the stored values, row by row: q and
    the caches in bf16 (the stored values are bf16 values here), scores and softmax in
    float32, P rounded to bf16 for P·V (what SDPA's bf16 CPU kernel does)."""
    batch, q_len, heads, dc = q_nope.shape
    out = np.zeros((batch, q_len, heads, dc))
    for b in range(batch):
        length = lengths[b]
        for i in range(q_len):
            end = min(max(i + length - q_len + 1, 0), length)
            keys = sorted({int(j) for j in idx[b, i] if 0 <= j < end}) if idx is not None else list(range(end))
            if not keys:
                continue
            c = torch.from_numpy(c_rows[b][keys]).bfloat16()
            p = torch.from_numpy(p_rows[b][keys]).bfloat16()
            s = (q_nope[b, i].bfloat16() @ c.T + q_pe[b, i].bfloat16() @ p.T).float() * SCALE
            out[b, i] = (torch.softmax(s, dim=-1).bfloat16() @ c).double().numpy()
    return out


@pytest.mark.parametrize("powers_of_two", [False, True])
@pytest.mark.parametrize("block_size", [0, 16])
@pytest.mark.parametrize("q_len", [1, 3])
def test_records_match_the_formula(powers_of_two, block_size, q_len):
    rng = np.random.default_rng(q_len * 7 + block_size + powers_of_two)
    lengths = [0, 5, 1100]
    q_nope, q_pe, records, table, c_rows, p_rows = make(rng, 3, q_len, 16, 256, 64, 1104, block_size, powers_of_two)
    for idx in (None, lists(rng, 3, q_len, 300, lengths)):
        want, want_lse = oracle(q_nope.numpy(), q_pe.numpy(), c_rows, p_rows, lengths, idx)
        fast_bound = TOL
        if powers_of_two:
            peer = torch_bf16_formula(q_nope, q_pe, c_rows, p_rows, lengths, idx)
            fast_bound = 2 * np.abs(peer - want).max()
        results = {}
        for precision, bound in (("exact", TOL), ("fast", fast_bound)):
            out, lse = qkv.mla_decode(q_nope, q_pe, records, None, torch.tensor(lengths), block_table=table,
                                      scale=SCALE, indices=None if idx is None else torch.from_numpy(idx),
                                      return_lse=True, precision=precision, cache_format="fp8_ds_mla")
            np.testing.assert_allclose(out.numpy(), want, atol=bound, rtol=0, err_msg=precision)
            finite = np.isfinite(want_lse)
            np.testing.assert_allclose(lse.numpy()[finite], want_lse[finite], atol=max(bound, 1e-4), rtol=1e-6)
            assert np.all(np.isneginf(lse.numpy()[~finite]))
            results[precision] = out
        if not powers_of_two:  # no block is bf16-exact: the float kernel either way
            assert torch.equal(results["exact"], results["fast"])


@pytest.mark.parametrize("powers_of_two", [False, True])
def test_pack_mla_records_writes_the_layout(powers_of_two):
    """The bytes hold each value within e4m3's rounding (half a step: 2^-4 relative, or
    half the smallest subnormal step 2^-10 times the scale), a scale per 128 values (a power
    of two when asked), and k_pe as its bf16 rounding."""
    c_kv = torch.randn(3, 5, 256) * torch.tensor([0.01, 3.0]).repeat_interleave(128)
    k_pe = torch.randn(3, 5, 64)
    records = qkv.pack_mla_records(c_kv, k_pe, power_of_two_scales=powers_of_two)
    assert records.dtype == torch.uint8 and records.shape == (3, 5, qkv_record_bytes(256, 64)) == (3, 5, 392)
    assert qkv_record_bytes(512, 64) == 656  # DeepSeek's record
    stored_c, stored_p = unpack(records, 256, 64)
    scales = records[..., 256:264].contiguous().view(torch.float32).double().numpy()
    x = c_kv.double().numpy()
    step = np.maximum(2.0 ** -4 * np.abs(x), 2.0 ** -10 * np.repeat(scales, 128, axis=-1))
    assert np.all(np.abs(stored_c - x) <= step * (1 + 1e-6))
    assert np.all(np.abs(x).reshape(3, 5, 2, 128).max(-1) <= 448 * scales * (1 + 2.0 ** -22))  # max|x| / 448, rounded
    if powers_of_two:
        assert np.all(np.exp2(np.round(np.log2(scales))) == scales)
    np.testing.assert_array_equal(stored_p, k_pe.bfloat16().double().numpy())
    with pytest.raises(qkv.Error, match="pack_mla_records: c_kv.shape\\[-1\\] \\(dc\\): expected a positive multiple of 128"):
        qkv.pack_mla_records(c_kv[..., :100], k_pe)
    with pytest.raises(qkv.Error, match="k_pe: expected the leading shape of c_kv"):
        qkv.pack_mla_records(c_kv, k_pe[:2])
    bad = c_kv.clone()
    bad[1, 2, 7] = float("nan")
    with pytest.raises(qkv.Error, match=r"pack_mla_records: c_kv\[7, 7\]: expected a finite value"):
        qkv.pack_mla_records(bad, k_pe)  # row 1·5 + 2 of the flattened rows, channel 7


@pytest.mark.parametrize("powers_of_two", [False, True])
def test_pack_mla_records_gives_pytorchs_bytes(powers_of_two):
    """The library's packer (C++) and the same steps in PyTorch's float32 and casts give
    the same bytes; NumPy arrays in give NumPy arrays out, the same bytes."""
    c_kv = torch.randn(4, 6, 512) * torch.rand(4, 6, 512).mul(3).exp()
    k_pe = torch.randn(4, 6, 64)
    groups = c_kv.reshape(4, 6, 4, 128)
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4) / 448.0
    if powers_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    want = torch.cat([(groups / scale).to(torch.float8_e4m3fn).reshape(4, 6, 512).view(torch.uint8),
                      scale.reshape(4, 6, 4).contiguous().view(torch.uint8),
                      k_pe.to(torch.bfloat16).view(torch.uint8)], dim=-1)
    got = qkv.pack_mla_records(c_kv, k_pe, power_of_two_scales=powers_of_two)
    assert isinstance(got, torch.Tensor) and torch.equal(got, want)
    from_numpy = qkv.pack_mla_records(c_kv.numpy(), k_pe.numpy(), power_of_two_scales=powers_of_two)
    assert isinstance(from_numpy, np.ndarray) and np.array_equal(from_numpy, want.numpy())


def qkv_record_bytes(dc, dr):
    return dc + 4 * (dc // 128) + 2 * dr


def test_numpy_arrays_give_the_tensors_bits():
    rng = np.random.default_rng(5)
    q_nope, q_pe, records, table, _, _ = make(rng, 2, 2, 16, 128, 64, 96, 16, powers_of_two=True)
    lengths = torch.tensor([96, 40])
    got = qkv.mla_decode(q_nope, q_pe, records, None, lengths, block_table=table, scale=SCALE,
                         cache_format="fp8_ds_mla")
    from_numpy = qkv.mla_decode(q_nope.numpy(), q_pe.numpy(), records.numpy(), None, lengths.numpy(),
                                block_table=table.numpy(), scale=SCALE, cache_format="fp8_ds_mla")
    assert np.array_equal(from_numpy, got.numpy())


def test_bad_calls_are_refused_by_name():
    rng = np.random.default_rng(9)
    q_nope, q_pe, records, _, _, _ = make(rng, 2, 1, 4, 128, 8, 12)
    lengths = torch.tensor([5, 12])

    def call(cache=records, kpe=None, **kwargs):
        return qkv.mla_decode(q_nope, q_pe, cache, kpe, lengths, scale=SCALE, cache_format="fp8_ds_mla", **kwargs)

    with pytest.raises(qkv.Error, match="mla_decode: kpe_cache: expected None with cache_format='fp8_ds_mla'"):
        call(kpe=records)
    with pytest.raises(qkv.Error, match="ckv_scale: expected None with cache_format='fp8_ds_mla'"):
        call(ckv_scale=1.0)
    with pytest.raises(qkv.Error, match="cache_format: expected None or 'fp8_ds_mla'"):
        qkv.mla_decode(q_nope, q_pe, records, None, lengths, scale=SCALE, cache_format="fp8")
    with pytest.raises(qkv.Error, match=r"ckv_cache.shape\[2\] \(record bytes\): expected 148"):
        call(cache=records[..., :-2])
    with pytest.raises(TypeError, match="ckv_cache: expected dtype uint8"):
        call(cache=records.float())
    with pytest.raises(qkv.Error, match="multiple of 128"):
        qkv.mla_decode(q_nope[..., :64], q_pe, records, None, lengths, scale=SCALE, cache_format="fp8_ds_mla")
    bad = torch.zeros(2, 1, 3, dtype=torch.int64)
    bad[1, 0, 2] = 12
    with pytest.raises(qkv.Error, match=r"indices\[1, 0, 2\].*expected -1 \(no key\) or a cached position 0..11"):
        call(indices=bad)


def test_torch_operator_passes_opcheck_and_compiles():
    import qkv.torch  # noqa: F401  (registers the operators)

    rng = np.random.default_rng(41)
    q_nope, q_pe, records, table, _, _ = make(rng, 2, 2, 4, 128, 8, 24, 8)
    lengths = torch.tensor([20, 6])
    idx = torch.from_numpy(lists(rng, 2, 2, 5, [20, 6]))
    args = (q_nope, q_pe, records, lengths, table, SCALE, "bottom_right", 1, 0.0, None, idx)
    torch.library.opcheck(torch.ops.qkv.mla_decode_records.default, args,
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    out = torch.ops.qkv.mla_decode_records(*args)[0]
    eager = qkv.mla_decode(q_nope, q_pe, records, None, lengths, block_table=table, scale=SCALE, indices=idx,
                           cache_format="fp8_ds_mla")
    torch.testing.assert_close(out, eager, rtol=0, atol=0)

    def step(qn, qp):
        return qkv.mla_decode(qn, qp, records, None, lengths, block_table=table, scale=SCALE, indices=idx,
                              cache_format="fp8_ds_mla") * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q_nope, q_pe), eager * 2, rtol=0, atol=0)
