"""qkv.decode and qkv.KVCache against torch SDPA (enable_gqa=True) on the same, rounded,
cache values; torch bfloat16/float16 caches read in place; paged caches; errors.

Tolerance: qkv's error against a float64 SDPA of the same values is at most twice
float32 SDPA's error plus 1e-6 (a few float32 roundings of O(1) outputs)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import qkv  # noqa: E402


def sdpa(q, k, v, lengths, causal=True):
    """Reference per sequence: float64 SDPA over its first lengths[b] keys, bottom-right
    aligned (the queries are the sequence's last tokens)."""
    outs = []
    for b, n in enumerate(lengths):
        qb, kb, vb = q[b:b + 1].double(), k[b:b + 1, :, :n].double(), v[b:b + 1, :, :n].double()
        nq = qb.shape[2]
        mask = torch.ones(nq, n, dtype=torch.bool)
        if causal:
            mask = torch.arange(n)[None, :] <= torch.arange(nq)[:, None] + (n - nq)
        if n == 0 or not mask.any(dim=1).all():
            out = torch.zeros(1, qb.shape[1], nq, vb.shape[-1], dtype=torch.float64)
            rows = mask.any(dim=1)
            if n and rows.any():
                out[:, :, rows] = F.scaled_dot_product_attention(qb[:, :, rows], kb, vb, attn_mask=mask[rows],
                                                                 enable_gqa=True)
            outs.append(out)
            continue
        outs.append(F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, enable_gqa=True))
    return torch.cat(outs)


def sdpa32_error(q, k, v, lengths, ref):
    worst = 0.0
    for b, n in enumerate(lengths):
        if n < q.shape[2]:
            continue
        nq = q.shape[2]
        mask = torch.arange(n)[None, :] <= torch.arange(nq)[:, None] + (n - nq)
        out = F.scaled_dot_product_attention(q[b:b + 1].float(), k[b:b + 1, :, :n].float(),
                                             v[b:b + 1, :, :n].float(), attn_mask=mask, enable_gqa=True)
        worst = max(worst, (out.double() - ref[b:b + 1]).abs().max().item())
    return worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (16, 2)])
@pytest.mark.parametrize("nq", [1, 3, 16])
def test_decode_matches_sdpa(dtype, heads, nq):
    torch.manual_seed(nq * 100 + heads[0])
    hq, hkv = heads
    batch, capacity, d = 3, 600, 64
    lengths = [600, 1, 0] if nq == 1 else [600, 250, nq + 5]
    q = torch.randn(batch, hq, nq, d)
    k = torch.randn(batch, hkv, capacity, d).to(dtype)
    v = torch.randn(batch, hkv, capacity, d).to(dtype)
    out = qkv.decode(q, k, v, torch.tensor(lengths))
    assert out.shape == (batch, hq, nq, d) and out.dtype == torch.float32
    ref = sdpa(q, k.float(), v.float(), lengths)
    bound = 2 * sdpa32_error(q, k, v, lengths, ref) + 1e-6
    assert (out.double() - ref).abs().max().item() <= bound


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("paged", [False, True])
def test_kv_cache_generation_loop(dtype, paged):
    torch.manual_seed(1)
    batch, hq, hkv, d = 2, 8, 2, 32
    cache = qkv.KVCache(batch, 300, hkv, d, dtype=dtype, paged=paged, block_size=16)
    keys = torch.zeros(batch, hkv, 0, d)
    values = torch.zeros(batch, hkv, 0, d)
    to = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    for step, tokens in enumerate([20, 1, 1, 4, 1]):
        k = torch.randn(batch, hkv, tokens, d)
        v = torch.randn(batch, hkv, tokens, d)
        cache.append(k, v)
        keys = torch.cat([keys, k.to(to).float()], dim=2)
        values = torch.cat([values, v.to(to).float()], dim=2)
        q = torch.randn(batch, hq, tokens, d)
        out, lse = cache.attend(q, return_lse=True)
        lengths = cache.lengths
        assert lengths == [keys.shape[2]] * batch
        ref = sdpa(q, keys, values, lengths)
        bound = 2 * sdpa32_error(q, keys, values, lengths, ref) + 1e-6
        assert (out.double() - ref).abs().max().item() <= bound, step
        assert lse.shape == (batch, hq, tokens)
    # The cache's memory, seen as torch tensors without copying, holds the rounded values.
    k_store, _ = cache.torch_storage()
    assert k_store.dtype == to
    if not paged:
        assert torch.equal(k_store[:, :keys.shape[2]].transpose(1, 2).float(), keys)


def test_decode_reads_the_cache_in_place():
    """A torch bfloat16 cache changed after the call changes the next result: no copy was
    kept; and the cache is never written."""
    torch.manual_seed(2)
    q = torch.randn(1, 4, 1, 16)
    k = torch.randn(1, 4, 50, 16).to(torch.bfloat16)
    v = torch.randn(1, 4, 50, 16).to(torch.bfloat16)
    before = k.clone()
    first = qkv.decode(q, k, v, [50])
    assert torch.equal(k, before)
    v.mul_(2)
    second = qkv.decode(q, k, v, [50])
    torch.testing.assert_close(second, 2 * first, rtol=1e-6, atol=1e-6)


def test_paged_decode_with_a_block_table_matches_contiguous():
    torch.manual_seed(3)
    batch, hkv, d, block = 2, 2, 32, 16
    lengths = [70, 33]
    k = torch.randn(batch, 80, hkv, d).to(torch.float16)  # bshd
    v = torch.randn(batch, 80, hkv, d).to(torch.float16)
    pool_k = torch.full((12, block, hkv, d), float("nan"), dtype=torch.float16)
    pool_v = pool_k.clone()
    table = torch.full((batch, 5), -1, dtype=torch.int32)
    free = list(np.random.default_rng(0).permutation(12))
    for b, n in enumerate(lengths):
        for j in range((n + block - 1) // block):
            table[b, j] = int(free.pop())
            rows = slice(j * block, min(n, (j + 1) * block))
            count = rows.stop - rows.start
            pool_k[table[b, j], :count] = k[b, rows]
            pool_v[table[b, j], :count] = v[b, rows]
    q = torch.randn(batch, 2, 8, d)  # bshd: 2 queries, 8 heads
    paged = qkv.decode(q, pool_k, pool_v, lengths, block_table=table, layout="bshd")
    contiguous = qkv.decode(q, k, v, lengths, layout="bshd")
    assert torch.equal(paged, contiguous)
    assert torch.isfinite(paged).all()  # the NaN rows of the pool were never read


def test_numpy_float16_cache():
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 2, 1, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 10, 8)).astype(np.float16)
    v = rng.standard_normal((1, 2, 10, 8)).astype(np.float16)
    out = qkv.decode(q, k, v, np.array([10]))
    ref = sdpa(torch.from_numpy(q), torch.from_numpy(k).float(), torch.from_numpy(v).float(), [10])
    assert isinstance(out, np.ndarray)
    assert np.abs(out - ref.numpy()).max() < 1e-6


def test_errors_name_the_argument():
    q = torch.randn(2, 4, 1, 8)
    k = torch.randn(2, 2, 10, 8)
    with pytest.raises(qkv.Error, match=r"cache_lengths\[0\]: expected 0..10"):
        qkv.decode(q, k, k, [11, 3])
    with pytest.raises(qkv.Error, match=r"cache_lengths: expected one length per sequence \(2\), got 1"):
        qkv.decode(q, k, k, [3])
    with pytest.raises(TypeError, match="v_cache: expected the dtype of k_cache"):
        qkv.decode(q, k, k.to(torch.bfloat16), [3, 3])
    with pytest.raises(TypeError, match="k_cache: expected dtype float32, bfloat16, float16, int8, float8_e4m3fn or float8_e5m2"):
        qkv.decode(q, k.double(), k.double(), [3, 3])
    with pytest.raises(qkv.Error, match=r"block_table\[0, 0\]: expected a pool block"):
        qkv.decode(q, k.transpose(1, 2), k.transpose(1, 2), [3, 3],
                   block_table=torch.tensor([[7], [0]], dtype=torch.int32))
    cache = qkv.KVCache(1, 4, 1, 8)
    with pytest.raises(qkv.Error, match="sequence 0 holds 0 of 4 keys; 5 more do not fit"):
        cache.append(torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8))
    with pytest.raises(qkv.Error, match="dtype: expected float32, bfloat16, float16, int8, int4, float8_e4m3fn or float8_e5m2"):
        qkv.KVCache(1, 4, 1, 8, dtype="int2")
    with pytest.raises(qkv.Error, match="config.block_size"):
        qkv.KVCache(1, 4, 1, 8, paged=True, block_size=0)


# ----------------------------------------------------------------------------------
# The inference variants in the decode kernel (sliding window, soft-cap, ALiBi, sinks),
# against the same math written in torch (test_variants.torch_math) per sequence: qkv's
# error at most twice float32 torch's own plus a floor (attention_math's rule).

DECODE_VARIANTS = {
    "window": dict(window=(40, -1)),
    "window_two_sided": dict(window=(30, 2), causal=None),
    "softcap": dict(softcap=0.7),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "everything": dict(window=(64, -1), softcap=20.0, alibi=True, sinks=True),
}


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(DECODE_VARIANTS))
def test_decode_variants_match_torch_math(name, cache_dtype):
    from attention_math import assert_no_worse_than_torch
    from test_variants import torch_math

    case = DECODE_VARIANTS[name]
    torch.manual_seed(len(name))
    batch, hq, hkv, d, nq = 2, 8, 2, 64, 3
    lengths = [700, 90]
    q = torch.randn(batch, hq, nq, d)
    k = torch.randn(batch, hkv, 700, d).to(cache_dtype)
    v = torch.randn(batch, hkv, 700, d).to(cache_dtype)
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / hq) for h in range(hq)]) if case.get("alibi") else None
    sinks = torch.randn(hq) if case.get("sinks") else None
    causal = case.get("causal", "bottom_right")
    keywords = dict(window=case.get("window"), softcap=case.get("softcap"), alibi_slopes=slopes, sinks=sinks)
    out = qkv.decode(q, k, v, torch.tensor(lengths), causal=causal, **keywords)

    # The same through an owned paged cache (block 16): the kernel reads any layout alike.
    cache = qkv.KVCache(batch, 700, hkv, d, dtype=cache_dtype, paged=True, block_size=16)
    for b, n in enumerate(lengths):
        cache.append(k[b:b + 1, :, :n].float(), v[b:b + 1, :, :n].float(), seq=b)
    assert torch.equal(cache.attend(q, causal=causal, **keywords), out)

    for b, n in enumerate(lengths):
        args = dict(window=case.get("window"), softcap=case.get("softcap"), causal=causal or "none")
        kb, vb = k[b:b + 1, :, :n].float(), v[b:b + 1, :, :n].float()
        exact = torch_math(q[b:b + 1].double(), kb.double(), vb.double(),
                           alibi=None if slopes is None else slopes.double(),
                           sinks=None if sinks is None else sinks.double(), **args)
        theirs = torch_math(q[b:b + 1], kb, vb, alibi=slopes, sinks=sinks, **args)
        assert_no_worse_than_torch(out[b:b + 1], theirs, exact, f"{name} sequence {b}")


def test_decode_window_reads_only_the_window():
    """NaN in keys before the window changes nothing (those keys are never read); in the
    window's first key it reaches the output."""
    torch.manual_seed(3)
    q = torch.randn(1, 4, 1, 32)
    k = torch.randn(1, 2, 2000, 32)
    v = torch.randn(1, 2, 2000, 32)
    clean = qkv.decode(q, k, v, torch.tensor([2000]), window=(100, -1))
    # The query (position 1999) sees keys 1899..1999.
    k[:, :, :1899] = float("nan")
    v[:, :, :1899] = float("inf")
    assert torch.equal(qkv.decode(q, k, v, torch.tensor([2000]), window=(100, -1)), clean)
    k[:, :, 1899] = float("nan")
    assert qkv.decode(q, k, v, torch.tensor([2000]), window=(100, -1)).isnan().all()


def test_decode_variant_errors():
    q = torch.randn(1, 4, 1, 8)
    k = torch.randn(1, 2, 10, 8)
    with pytest.raises(qkv.Error, match="sinks: expected one value per query head"):
        qkv.decode(q, k, k, torch.tensor([10]), sinks=torch.zeros(3))
    with pytest.raises(qkv.Error, match="softcap"):
        qkv.decode(q, k, k, torch.tensor([10]), softcap=-1.0)
    with pytest.raises(qkv.Error, match="window"):
        qkv.decode(q, k, k, torch.tensor([10]), window=(-3, 0))


# ----------------------------------------------------------------------------------
# int8 caches: each row quantized with its own scale; attention over the stored values
# (int8 · scale) matches SDPA on those values by the module's rule.

@pytest.mark.parametrize("paged", [False, True])
def test_int8_kv_cache_matches_sdpa_on_its_stored_values(paged):
    torch.manual_seed(12)
    batch, hq, hkv, d = 2, 8, 2, 64
    cache = qkv.KVCache(batch, 300, hkv, d, dtype="int8", paged=paged, block_size=16)
    k = torch.randn(batch, hkv, 150, d)
    v = torch.randn(batch, hkv, 150, d)
    cache.append(k, v)
    q = torch.randn(batch, hq, 2, d)
    out = cache.attend(q)
    # The stored values, from the cache's own memory: int8 · per-row scale.
    keys, values = cache.storage()
    k_scale, v_scale = cache.scales()
    assert keys.dtype == np.int8 and k_scale.shape == keys.shape[:3]
    if paged:
        table = cache.block_table()
        rows = [np.concatenate([keys[b] for b in table[s][: (150 + 15) // 16]])[:150] for s in range(batch)]
        kq = torch.from_numpy(np.stack(rows)).float()
        srows = [np.concatenate([k_scale[b] for b in table[s][: (150 + 15) // 16]])[:150] for s in range(batch)]
        ks = torch.tensor(np.stack(srows))
        rows = [np.concatenate([values[b] for b in table[s][: (150 + 15) // 16]])[:150] for s in range(batch)]
        vq = torch.from_numpy(np.stack(rows)).float()
        srows = [np.concatenate([v_scale[b] for b in table[s][: (150 + 15) // 16]])[:150] for s in range(batch)]
        vs = torch.tensor(np.stack(srows))
    else:
        kq, vq = torch.from_numpy(keys[:, :150]).float(), torch.from_numpy(values[:, :150]).float()
        ks, vs = torch.tensor(k_scale[:, :150]), torch.tensor(v_scale[:, :150])
    k_stored = (kq.double() * ks.double()[..., None]).transpose(1, 2)  # [B, Hkv, N, d]
    v_stored = (vq.double() * vs.double()[..., None]).transpose(1, 2)
    # Quantization: every stored value within half its row's scale of the appended one.
    assert ((k_stored - k.double()).abs() <= ks.transpose(1, 2).double()[..., None] * 0.5 * (1 + 1e-6)).all()
    lengths = [150] * batch
    ref = sdpa(q, k_stored, v_stored, lengths)
    bound = 2 * sdpa32_error(q, k_stored.float(), v_stored.float(), lengths, ref) + 1e-6
    assert (out.double() - ref).abs().max().item() <= bound
    # The same cache memory through qkv.decode (caller-owned int8 arrays and scales).
    if not paged:
        bshd = qkv.decode(q.transpose(1, 2), torch.from_numpy(keys), torch.from_numpy(values), torch.tensor(lengths),
                          layout="bshd", k_scale=k_scale, v_scale=v_scale)
        assert torch.equal(bshd.transpose(1, 2), out)
        # "bhsd": caches [B, Hkv, capacity, d] and scales [B, Hkv, capacity], here
        # contiguous copies in that layout (read with any strides).
        bhsd = qkv.decode(q, torch.from_numpy(keys).transpose(1, 2).contiguous(),
                          torch.from_numpy(values).transpose(1, 2).contiguous(), torch.tensor(lengths),
                          k_scale=np.ascontiguousarray(np.swapaxes(k_scale, 1, 2)),
                          v_scale=torch.tensor(np.swapaxes(v_scale, 1, 2)).contiguous())
        assert torch.equal(bhsd, out)


def test_int8_decode_needs_scales():
    q = torch.randn(1, 4, 1, 8)
    k = torch.zeros(1, 2, 10, 8, dtype=torch.int8)
    with pytest.raises(qkv.Error, match="k_scale: expected one float32 scale per cached row"):
        qkv.decode(q, k, k, torch.tensor([10]))
