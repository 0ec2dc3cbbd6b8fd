"""qkv.mla_decode (absorbed latent attention) against a float64 NumPy oracle of the formula,
S = scale*(q_nope . ckv + q_pe . kpe), out = softmax(S) @ ckv, over the caches' stored
(rounded) values: contiguous and paged (shuffled blocks), Nq 1..4 (bottom-right causal),
cache lengths 0..N, every storage dtype, indices with -1 and repeats. Tolerance as
tests/python/test_decode.py's float32 bound (docs/numerics.md): 2e-5 absolute on out values
of size ~1. Also: the same result as qkv.decode over the concatenated cache (the dense
path), errors naming the argument with nothing written, torch.compile and opcheck of
torch.ops.qkv.mla_decode."""

import os

import numpy as np
import pytest
import torch

import qkv

TOL = 2e-5
SCALE = 0.2


def oracle(q_nope, q_pe, ckv, kpe, lengths, idx=None):
    """q [B, Nq, H, dc|dr]; ckv[b] [len, dc], kpe[b] [len, dr] (float64); idx [B, Nq, topk]."""
    batch, q_len, heads, dc = q_nope.shape
    out = np.zeros((batch, q_len, heads, dc))
    lse = np.full((batch, heads, q_len), -np.inf)
    for b in range(batch):
        n = lengths[b]
        for i in range(q_len):
            end = min(max(i + n - q_len + 1, 0), n)
            keys = range(end) if idx is None else sorted({int(j) for j in idx[b, i] if 0 <= j < end})
            keys = np.array(list(keys), dtype=np.int64)
            if keys.size == 0:
                continue
            s = SCALE * (q_nope[b, i].astype(np.float64) @ ckv[b][keys].T + q_pe[b, i].astype(np.float64) @ kpe[b][keys].T)
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            l = p.sum(axis=1, keepdims=True)
            out[b, i] = (p / l) @ ckv[b][keys]
            lse[b, :, i] = (m + np.log(l))[:, 0]
    return out, lse


def make(rng, batch, q_len, heads, dc, dr, lengths, capacity, dtype, block_size=0):
    """(q_nope, q_pe, ckv, kpe, table, stored ckv/kpe rows per sequence as float64)."""
    q_nope = torch.from_numpy(rng.standard_normal((batch, q_len, heads, dc)).astype(np.float32))
    q_pe = torch.from_numpy(rng.standard_normal((batch, q_len, heads, dr)).astype(np.float32))
    if block_size:
        per_seq = -(-capacity // block_size)
        blocks = batch * per_seq
        ckv = torch.randn(blocks, block_size, dc).to(dtype)
        kpe = torch.randn(blocks, block_size, dr).to(dtype)
        table = torch.from_numpy(rng.permutation(blocks).reshape(batch, per_seq).astype(np.int32))
        flat_c, flat_p = ckv.double().reshape(-1, dc).numpy(), kpe.double().reshape(-1, dr).numpy()
        rows = [np.array([int(table[b, j // block_size]) * block_size + j % block_size for j in range(capacity)])
                for b in range(batch)]
        return q_nope, q_pe, ckv, kpe, table, [flat_c[r] for r in rows], [flat_p[r] for r in rows]
    ckv = torch.randn(batch, capacity, dc).to(dtype)
    kpe = torch.randn(batch, capacity, dr).to(dtype)
    return q_nope, q_pe, ckv, kpe, None, list(ckv.double().numpy()), list(kpe.double().numpy())


def lists(rng, batch, q_len, topk, lengths):
    idx = np.full((batch, q_len, topk), -1, np.int64)
    for b in range(batch):
        if lengths[b] > 0:
            idx[b] = rng.integers(-1, lengths[b], size=(q_len, topk))
    if topk > 1:
        idx[..., 1] = idx[..., 0]  # repeats
    return idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [0, 8])
@pytest.mark.parametrize("q_len", [1, 2, 4])
@pytest.mark.parametrize("dims", [(32, 16), (20, 4)])
def test_matches_the_formula(dtype, block_size, q_len, dims):
    rng = np.random.default_rng(q_len * 10 + block_size)
    dc, dr = dims
    lengths = [0, 3, 70]
    q_nope, q_pe, ckv, kpe, table, c_rows, p_rows = make(rng, 3, q_len, 6, dc, dr, lengths, 72, dtype, block_size)
    for idx in (None, lists(rng, 3, q_len, 9, lengths)):
        out, lse = qkv.mla_decode(q_nope, q_pe, ckv, kpe, torch.tensor(lengths), block_table=table, scale=SCALE,
                                  indices=None if idx is None else torch.from_numpy(idx), return_lse=True)
        want, want_lse = oracle(q_nope.numpy(), q_pe.numpy(), c_rows, p_rows, lengths, idx)
        assert out.shape == (3, q_len, 6, dc) and out.dtype == torch.float32
        np.testing.assert_allclose(out.numpy(), want, atol=TOL, rtol=0)
        finite = np.isfinite(want_lse)
        np.testing.assert_allclose(lse.numpy()[finite], want_lse[finite], atol=TOL, rtol=1e-6)
        assert np.all(np.isneginf(lse.numpy()[~finite]))


def test_numpy_arrays_and_the_dense_decode_agree():
    """NumPy float16 caches; the result equals qkv.decode over one concatenated [ckv, kpe] key
    cache whose values are its first dc columns (within float32 rounding: the scores are
    summed in two parts here)."""
    rng = np.random.default_rng(5)
    q_nope = rng.standard_normal((2, 1, 16, 64)).astype(np.float32)
    q_pe = rng.standard_normal((2, 1, 16, 16)).astype(np.float32)
    ckv = rng.standard_normal((2, 300, 64)).astype(np.float16)
    kpe = rng.standard_normal((2, 300, 16)).astype(np.float16)
    lengths = np.array([300, 129])
    out = qkv.mla_decode(q_nope, q_pe, ckv, kpe, lengths, scale=SCALE)
    assert isinstance(out, np.ndarray) and out.shape == (2, 1, 16, 64)
    key = np.concatenate([ckv, kpe], axis=-1)[:, :, None, :]  # [B, cap, 1, 80]
    dense = qkv.decode(np.concatenate([q_nope, q_pe], axis=-1), key, key[..., :64], lengths, scale=SCALE,
                       layout="bshd")
    np.testing.assert_allclose(out, dense, atol=TOL, rtol=0)
    want, _ = oracle(q_nope, q_pe, list(ckv.astype(np.float64)), list(kpe.astype(np.float64)), lengths)
    np.testing.assert_allclose(out, want, atol=TOL, rtol=0)


def test_bf16_queries_come_back_bf16_and_threads_agree():
    rng = np.random.default_rng(6)
    q_nope, q_pe, ckv, kpe, table, _, _ = make(rng, 2, 2, 16, 64, 16, [900, 1500], 1504, torch.bfloat16, 16)
    lengths = torch.tensor([900, 1500])
    results = [qkv.mla_decode(q_nope, q_pe, ckv, kpe, lengths, block_table=table, scale=SCALE, threads=t,
                              return_lse=True) for t in (1, 2, 3)]
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    out16 = qkv.mla_decode(q_nope.bfloat16(), q_pe.bfloat16(), ckv, kpe, lengths, block_table=table, scale=SCALE)
    assert out16.dtype == torch.bfloat16


def test_bad_calls_name_the_argument():
    rng = np.random.default_rng(7)
    q_nope, q_pe, ckv, kpe, table, _, _ = make(rng, 2, 1, 4, 16, 8, [5, 9], 16, torch.float32, 8)
    lengths = torch.tensor([5, 9])
    with pytest.raises(qkv.Error, match="scale: required"):
        qkv.mla_decode(q_nope, q_pe, ckv, kpe, lengths, block_table=table, scale=None)
    with pytest.raises(TypeError, match="scale"):
        qkv.mla_decode(q_nope, q_pe, ckv, kpe, lengths, block_table=table)  # keyword-only, no default
    with pytest.raises(qkv.Error, match="kpe_cache"):
        qkv.mla_decode(q_nope, q_pe[..., :4], ckv, kpe, lengths, block_table=table, scale=SCALE)
    with pytest.raises(qkv.Error, match=r"block_table\[1, 1\]"):
        qkv.mla_decode(q_nope, q_pe, ckv, kpe, lengths, block_table=torch.tensor([[0, 1], [2, 99]]), scale=SCALE)
    with pytest.raises(qkv.Error, match=r"cache_lengths\[1\]"):
        qkv.mla_decode(q_nope, q_pe, ckv, kpe, torch.tensor([5, 17]), block_table=table, scale=SCALE)
    with pytest.raises(qkv.Error, match="indices"):
        qkv.mla_decode(q_nope, q_pe, ckv, kpe, lengths, block_table=table, scale=SCALE,
                       indices=torch.tensor([[[0, 7]], [[1, 2]]]))  # sequence 0 holds 5 keys
    with pytest.raises(TypeError, match="kpe_cache"):
        qkv.mla_decode(q_nope, q_pe, ckv, kpe.bfloat16(), lengths, block_table=table, scale=SCALE)
    with pytest.raises(TypeError, match="ckv_cache"):
        qkv.mla_decode(q_nope, q_pe, ckv.to(torch.int8), kpe.to(torch.int8), lengths, block_table=table, scale=SCALE)
    with pytest.raises(ValueError, match="requires grad"):
        qkv.mla_decode(q_nope.requires_grad_(), q_pe, ckv, kpe, lengths, block_table=table, scale=SCALE)


def test_torch_operator_passes_opcheck_and_compiles():
    import qkv.torch  # noqa: F401  (registers the operators)

    rng = np.random.default_rng(8)
    q_nope, q_pe, ckv, kpe, table, _, _ = make(rng, 2, 2, 4, 16, 8, [20, 6], 24, torch.bfloat16, 8)
    lengths = torch.tensor([20, 6])
    idx = torch.from_numpy(lists(rng, 2, 2, 5, [20, 6]))
    args = (q_nope, q_pe, ckv, kpe, lengths, table, SCALE, "bottom_right", 1, 0.0, None, idx)
    torch.library.opcheck(torch.ops.qkv.mla_decode.default, args)
    out = torch.ops.qkv.mla_decode(*args)[0]
    eager = qkv.mla_decode(q_nope, q_pe, ckv, kpe, lengths, block_table=table, scale=SCALE, indices=idx)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)

    def step(qn, qp):
        return qkv.mla_decode(qn, qp, ckv, kpe, lengths, block_table=table, scale=SCALE, indices=idx) * 2

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q_nope, q_pe), eager * 2, rtol=0, atol=0)


def test_values_in_the_keys_decode_and_batch_plan():
    """v_cache=None: the values are the keys' first v_dim channels, read in place — the same
    bits as passing that slice as v_cache, on qkv.decode (both layouts, int8 with the keys'
    scales) and BatchPlan.run (the plan's v_dim)."""
    rng = np.random.default_rng(9)
    q = torch.randn(2, 4, 3, 24)  # bhsd
    k = torch.randn(2, 1, 40, 24)
    lengths = torch.tensor([40, 17])
    got = qkv.decode(q, k, None, lengths, v_dim=16)
    assert torch.equal(got, qkv.decode(q, k, k[..., :16].contiguous(), lengths))
    k8 = torch.from_numpy(rng.integers(-127, 128, (2, 40, 1, 24)).astype(np.int8))
    s8 = torch.rand(2, 40, 1) + 0.5
    q_bshd = q.transpose(1, 2).contiguous()
    got8 = qkv.decode(q_bshd, k8, None, lengths, v_dim=16, k_scale=s8, layout="bshd")
    assert torch.equal(got8, qkv.decode(q_bshd, k8, k8[..., :16].contiguous(), lengths, k_scale=s8, v_scale=s8,
                                        layout="bshd"))
    with pytest.raises(qkv.Error, match="v_cache: None needs v_dim"):
        qkv.decode(q, k, None, lengths)
    with pytest.raises(qkv.Error, match=r"v_dim: expected an integer in 1\.\.24"):
        qkv.decode(q, k, None, lengths, v_dim=25)
    with pytest.raises(qkv.Error, match="v_dim: only with v_cache=None"):
        qkv.decode(q, k, k, lengths, v_dim=16)

    pool = torch.randn(10, 4, 1, 24)
    table = torch.from_numpy(rng.permutation(10).reshape(2, 5).astype(np.int32))
    plan = qkv.BatchPlan([0, 1, 3], [19, 11], num_heads=3, num_kv_heads=1, head_dim=24, v_dim=16,
                         block_table=table, block_size=4)
    qp = torch.randn(3, 3, 24)
    assert torch.equal(plan.run(qp, pool, None), plan.run(qp, pool, pool[..., :16].contiguous()))


def torch_bf16_formula(q_nope, q_pe, ckv, kpe):
    """PyTorch's absorbed formula in bfloat16 (what an engine writes without a kernel):
    bf16 matmuls, float32 softmax, P rounded to bf16; contiguous caches, Nq = 1."""
    qn, qp = q_nope[:, 0].bfloat16(), q_pe[:, 0].bfloat16()
    s = (torch.matmul(qn, ckv.transpose(1, 2)) + torch.matmul(qp, kpe.transpose(1, 2))).float() * SCALE
    return torch.matmul(torch.softmax(s, dim=-1).bfloat16(), ckv).unsqueeze(1).double()


@pytest.mark.parametrize("heads", [16, 128])
def test_bf16_cache_fast_within_twice_pytorchs_bf16_error(heads):
    """precision "fast" (default) over a bfloat16 cache: on a CPU with AVX512-BF16 the
    products run on vdpbf16ps (q and P rounded to bf16 once): out within 2× the error of
    PyTorch's bf16 formula (the bf16 contract); "exact" keeps the float32 bound."""
    rng = np.random.default_rng(heads)
    q_nope, q_pe, ckv, kpe, _, c_rows, p_rows = make(rng, 2, 1, heads, 64, 16, [300, 300], 300, torch.bfloat16)
    lengths = torch.tensor([300, 300])
    want, _ = oracle(q_nope.numpy(), q_pe.numpy(), c_rows, p_rows, [300, 300])
    peer = (torch_bf16_formula(q_nope, q_pe, ckv, kpe).numpy() - want)
    fast = qkv.mla_decode(q_nope, q_pe, ckv, kpe, lengths, scale=SCALE)
    assert np.abs(fast.numpy() - want).max() <= 2 * np.abs(peer).max()
    exact = qkv.mla_decode(q_nope, q_pe, ckv, kpe, lengths, scale=SCALE, precision="exact")
    np.testing.assert_allclose(exact.numpy(), want, atol=TOL, rtol=0)


def test_one_kv_head_bf16_on_the_dot_path_everywhere():
    """The dot path is a property of the call (one bf16 kv head, ≥ 16 query heads, fast),
    not of the entry point: qkv.decode with v_cache=None and with the values passed apart
    give the same bits, and so do BatchPlan over a combined [c_kv | k_pe] pool and
    mla_decode over its two parts (test_mla_decode.cpp forces the unit on and off)."""
    rng = np.random.default_rng(17)
    dc, dr, heads, lengths = 64, 16, 16, [300, 77]
    pool = torch.randn(40, 16, 1, dc + dr).bfloat16()
    table = torch.from_numpy(rng.permutation(40).reshape(2, 20).astype(np.int32))
    q = torch.randn(2, heads, dc + dr)
    plan = qkv.BatchPlan([0, 1, 2], lengths, num_heads=heads, num_kv_heads=1, head_dim=dc + dr, v_dim=dc,
                         block_table=table, block_size=16, scale=SCALE, dtype=torch.bfloat16)
    planned = plan.run(q, pool, None)
    latent = qkv.mla_decode(q[:, None, :, :dc], q[:, None, :, dc:], pool[:, :, 0, :dc], pool[:, :, 0, dc:],
                            torch.tensor(lengths), block_table=table, scale=SCALE)
    assert torch.equal(planned, latent[:, 0])
    dense = pool[table.long()].reshape(2, 20 * 16, 1, dc + dr)  # [B, N, 1, d] contiguous caches
    q_bhsd = q[:, :, None]
    together = qkv.decode(q_bhsd, dense.transpose(1, 2), None, torch.tensor(lengths), v_dim=dc, scale=SCALE)
    apart = qkv.decode(q_bhsd, dense.transpose(1, 2), dense.transpose(1, 2)[..., :dc].contiguous(),
                       torch.tensor(lengths), scale=SCALE)
    assert torch.equal(together, apart)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_float8_latent_pool_through_batch_plan_and_decode(fmt):
    """An FP8 latent cache as vLLM keeps it: one [c_kv | k_pe] row per token in float8 with
    one per-tensor scale, read in place as a combined pool (v_cache=None: the values are the
    keys' first dc channels, lent the keys' scale), paged through BatchPlan.run and
    contiguous through qkv.decode, 16 heads. Against the formula over the stored values
    (the float8 bytes times the scale): precision="exact" within the float32 bound of the
    other storages; the default "fast" (on an AVX512-BF16 CPU the latent step on vdpbf16ps:
    the query rounded to bf16 once, each weight P·s once) within that plus u·max|v|,
    u = 2^-8, the most P's rounding moves a weighted sum of values."""
    rng = np.random.default_rng(23)
    dc, dr, heads, lengths, block = 64, 16, 16, [300, 77], 16
    dtype = getattr(torch, fmt)
    scale8 = 0.02
    pool = (torch.randn(40, block, 1, dc + dr) / scale8).to(dtype)
    stored = pool.double().reshape(40 * block, dc + dr) * scale8
    table = torch.from_numpy(rng.permutation(40).reshape(2, 20).astype(np.int32))
    rows = [np.array([int(table[b, j // block]) * block + j % block for j in range(20 * block)]) for b in range(2)]
    q = torch.randn(2, heads, dc + dr)
    want, _ = oracle(q[:, None, :, :dc].numpy(), q[:, None, :, dc:].numpy(),
                     [stored[r, :dc].numpy() for r in rows], [stored[r, dc:].numpy() for r in rows], lengths)
    fast_bound = TOL + 2.0 ** -8 * float(stored[:, :dc].abs().max())
    plan = qkv.BatchPlan([0, 1, 2], lengths, num_heads=heads, num_kv_heads=1, head_dim=dc + dr, v_dim=dc,
                         block_table=table, block_size=block, scale=SCALE, dtype=dtype)
    planned = plan.run(q, pool, None, k_scale=scale8)
    np.testing.assert_allclose(planned.numpy(), want[:, 0], atol=fast_bound, rtol=0)
    dense = pool[table.long()].reshape(2, 20 * block, 1, dc + dr)
    for precision, bound in (("exact", TOL), ("fast", fast_bound)):
        out = qkv.decode(q[:, None], dense, None, torch.tensor(lengths), v_dim=dc, scale=SCALE, layout="bshd",
                         k_scale=scale8, precision=precision)
        np.testing.assert_allclose(out[:, 0].numpy(), want[:, 0], atol=bound, rtol=0)


def test_batch_plan_takes_precision_exact_as_decode_does():
    """BatchPlan(precision="exact") over a bf16 latent pool with 16 heads: the float32 step,
    equal to qkv.decode(precision="exact") over the same rows within float32 rounding (the
    two split the keys differently). "fast" (the default) differs from it where the CPU has
    AVX512-BF16 (the latent step ran), within what one bf16 rounding of P adds."""
    rng = np.random.default_rng(29)
    dc, dr, heads, lengths = 64, 16, 16, [300, 77]
    pool = torch.randn(40, 16, 1, dc + dr).bfloat16()
    table = torch.from_numpy(rng.permutation(40).reshape(2, 20).astype(np.int32))
    q = torch.randn(2, heads, dc + dr)
    dense = pool[table.long()].reshape(2, 20 * 16, 1, dc + dr)
    runs = {}
    for precision in ("exact", "fast"):
        plan = qkv.BatchPlan([0, 1, 2], lengths, num_heads=heads, num_kv_heads=1, head_dim=dc + dr, v_dim=dc,
                             block_table=table, block_size=16, scale=SCALE, dtype=torch.bfloat16,
                             precision=precision)
        runs[precision] = plan.run(q, pool, None)
    decoded = qkv.decode(q[:, None], dense, None, torch.tensor(lengths), v_dim=dc, scale=SCALE, layout="bshd",
                         precision="exact")
    np.testing.assert_allclose(runs["exact"].numpy(), decoded[:, 0].numpy(), atol=TOL, rtol=0)
    bound = TOL + 2.0 ** -8 * float(pool[..., :dc].float().abs().max())
    np.testing.assert_allclose(runs["fast"].numpy(), runs["exact"].numpy(), atol=bound, rtol=0)
    with open("/proc/cpuinfo") as cpuinfo:
        info = cpuinfo.read()
    # vdpbf16ps is taken where it pays: AMD's (cpu/dot_products.hpp); AMX Xeons keep float32 here.
    unit = "avx512_bf16" in info and "AuthenticAMD" in info
    if unit and os.environ.get("QKV_DOT_PRODUCTS", "auto").lower() != "off":
        assert not torch.equal(runs["fast"], runs["exact"]), "the fast plan never took the dot products"
