"""qkv.decode, KVCache.attend and BatchPlan.run with key lists (indices=) against a
float64 NumPy oracle over the cache's stored values: per row, the listed keys (-1 and
repeats dropped) that bottom-right causality allows, attended densely. Tolerance as
tests/python/test_decode.py's float32 bound (docs/numerics.md): 2e-5 absolute on out
values of size ~1 for float32 caches; the 16-bit and quantized caches are compared over
their stored (rounded) values, so the same bound holds. Errors name the function; the
torch operators pass opcheck."""

import numpy as np
import pytest
import torch

import qkv

TOL = 2e-5


def lists(rng, batch, lists_per, q_len, topk, lengths):
    idx = np.full((batch, lists_per, q_len, topk), -1, np.int64)
    for b in range(batch):
        if lengths[b] > 0:
            idx[b] = rng.integers(-1, lengths[b], size=(lists_per, q_len, topk))
    idx[0, :, 0, :] = -1  # an empty row
    if topk > 1:
        idx[..., 1] = idx[..., 0]  # repeats
    return idx


def oracle(q, keys, values, lengths, idx, sinks=None):
    """q [B, Nq, Hq, d]; keys[b] [len, Hkv, d]; idx [B, L, Nq, topk] -> out, lse [B, Hq, Nq]."""
    batch, q_len, hq, d = q.shape
    hkv = keys[0].shape[1]
    dv = values[0].shape[2]
    group = hq // hkv
    out = np.zeros((batch, q_len, hq, dv))
    lse = np.full((batch, hq, q_len), -np.inf)
    for b in range(batch):
        end_base = lengths[b] - q_len
        for i in range(q_len):
            end = min(max(i + end_base + 1, 0), lengths[b])
            for h in range(hq):
                g = h // group
                row = idx[b, 0 if idx.shape[1] == 1 else g, i]
                sel = sorted({int(j) for j in row if 0 <= j < end})
                s = np.array([q[b, i, h].astype(np.float64) @ keys[b][j, g].astype(np.float64) for j in sel])
                s = s / np.sqrt(d)
                sink = -np.inf if sinks is None else float(sinks[h])
                if not sel and sinks is None:
                    continue
                m = max([sink, *s]) if len(s) else sink
                p = np.exp(s - m) if len(s) else np.zeros(0)
                l = p.sum() + (np.exp(sink - m) if sinks is not None else 0.0)
                if sel:
                    out[b, i, h] = (p[:, None] * np.stack([values[b][j, g] for j in sel]).astype(np.float64)).sum(0) / l
                lse[b, h, i] = m + np.log(l)
    return out, lse


def filled_cache(dtype, paged, lengths, hkv=2, d=32, seed=0, **kw):
    rng = np.random.default_rng(seed)
    cache = qkv.KVCache(len(lengths), 96, hkv, d, dtype=dtype, paged=paged, block_size=16, layout="bshd", **kw)
    for b, n in enumerate(lengths):
        cache.append(rng.standard_normal((1, n, hkv, d)).astype(np.float32),
                     rng.standard_normal((1, n, hkv, d)).astype(np.float32), seq=b)
    stored = [cache.stored(b) for b in range(len(lengths))]
    keys = [np.asarray(k).reshape(n, hkv, d) for (k, _), n in zip(stored, lengths)]
    values = [np.asarray(v).reshape(n, hkv, d) for (_, v), n in zip(stored, lengths)]
    return cache, keys, values


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8", "int4"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_kv_cache_attend_matches_the_oracle(dtype, paged, per_head):
    lengths = [90, 13]
    kw = {"key_scales": "channel", "group_size": 8} if dtype == "int4" else {}
    cache, keys, values = filled_cache(dtype, paged, lengths, **kw)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 3, 4, 32)).astype(np.float32)
    idx = lists(rng, 2, 2 if per_head else 1, 3, 20, lengths)
    arg = idx if per_head else idx[:, 0]
    sinks = np.array([0.5, -1.0, 0.0, 1.5], np.float32)
    for index_dtype in (np.int32, np.int64):
        out, lse = cache.attend(q, indices=arg.astype(index_dtype), return_lse=True, sinks=sinks, threads=2)
        ref_out, ref_lse = oracle(q, keys, values, lengths, idx, sinks)
        np.testing.assert_allclose(out, ref_out, atol=TOL, rtol=0)
        np.testing.assert_allclose(lse, ref_lse, atol=TOL, rtol=0)


@pytest.mark.parametrize("paged", [False, True])
def test_decode_matches_the_oracle(paged):
    rng = np.random.default_rng(2)
    lengths = np.array([40, 7])
    cap, hkv, d = 48, 1, 16
    k = rng.standard_normal((2, cap, hkv, d)).astype(np.float32)
    v = rng.standard_normal((2, cap, hkv, d)).astype(np.float32)
    q = rng.standard_normal((2, 2, 2, d)).astype(np.float32)
    idx = lists(rng, 2, 1, 2, 12, lengths)
    ref_out, ref_lse = oracle(q, [k[0], k[1]], [v[0], v[1]], lengths, idx)
    if paged:
        table = np.array([[2, 0, 5], [4, 1, 3]], np.int32)
        pool_k = np.full((6, 16, hkv, d), np.nan, np.float32)
        pool_v = np.full((6, 16, hkv, d), np.nan, np.float32)
        for b in range(2):
            for n in range(3):
                pool_k[table[b, n]] = k[b, n * 16:(n + 1) * 16]
                pool_v[table[b, n]] = v[b, n * 16:(n + 1) * 16]
        out, lse = qkv.decode(q, pool_k, pool_v, lengths, block_table=table, layout="bshd", return_lse=True,
                              indices=idx[:, 0])
    else:
        out, lse = qkv.decode(q, k, v, lengths, layout="bshd", return_lse=True, indices=idx[:, 0])
    np.testing.assert_allclose(out, ref_out, atol=TOL, rtol=0)
    np.testing.assert_allclose(lse, ref_lse, atol=TOL, rtol=0)


def test_batch_plan_runs_packed_lists():
    lengths = [60, 9, 30]
    counts = [1, 3, 2]
    cache, keys, values = filled_cache("bfloat16", True, lengths)
    rng = np.random.default_rng(3)
    cu = np.concatenate([[0], np.cumsum(counts)])
    q = rng.standard_normal((cu[-1], 4, 32)).astype(np.float32)
    per_seq = [lists(rng, 1, 1, n, 16, [lengths[b]]) for b, n in enumerate(counts)]
    packed = np.concatenate([x[0, 0] for x in per_seq])
    plan = qkv.BatchPlan(cu, np.array(lengths), num_heads=4, num_kv_heads=2, head_dim=32,
                         block_table=cache.block_table(), block_size=16)
    out, lse = plan.run(q, cache, None, indices=packed, return_lse=True)
    for b, n in enumerate(counts):
        ref_out, ref_lse = oracle(q[None, cu[b]:cu[b + 1]], [keys[b]], [values[b]], [lengths[b]], per_seq[b])
        np.testing.assert_allclose(out[cu[b]:cu[b + 1]], ref_out[0], atol=TOL, rtol=0)
        np.testing.assert_allclose(lse[:, cu[b]:cu[b + 1]], ref_lse[0], atol=TOL, rtol=0)


def test_errors_name_the_function_and_write_nothing():
    cache, _, _ = filled_cache("float32", False, [10, 5])
    q = np.zeros((2, 1, 4, 32), np.float32)
    bad = np.zeros((2, 1, 4), np.int64)
    bad[1, 0, 2] = 5  # sequence 1 holds 5 keys
    with pytest.raises(qkv.Error, match=r"indices\[1, 0, 2\] \(batch 1, query row 0\).*cache_lengths\[1\] = 5"):
        cache.attend(q, indices=bad)
    with pytest.raises(qkv.Error, match="options.window"):
        cache.attend(q, indices=np.zeros((2, 1, 4), np.int64), window=(4, 0))
    with pytest.raises(TypeError, match="qkv.KVCache.attend: indices"):
        cache.attend(q, indices=np.zeros((2, 1, 4), np.float32))


def test_torch_operators_pass_opcheck():
    """torch.ops.qkv.decode, kv_cache_attend and batch_plan_run with key lists: opcheck
    (schema, fake, no mutation beyond the declared) and the eager call's bits."""
    import qkv.torch  # noqa: F401  (registers the operators)

    rng = np.random.default_rng(4)
    lengths = torch.tensor([20, 6])
    q = torch.randn(2, 2, 2, 16)  # bhsd
    k = torch.randn(2, 1, 24, 16)
    v = torch.randn(2, 1, 24, 16)
    idx = torch.from_numpy(lists(rng, 2, 1, 2, 8, [20, 6])[:, 0])
    args = (q, k, v, lengths, None, None, None, None, "bottom_right", "bhsd", 1, -1, -1, None, 0.0, None, idx)
    torch.library.opcheck(torch.ops.qkv.decode.default, args)
    out = torch.ops.qkv.decode(*args)[0]
    eager = qkv.decode(q, k, v, lengths, indices=idx)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)

    # KVCache.attend's and BatchPlan.run's operators with lists too.
    cache = qkv.KVCache(2, 24, 1, 16)
    cache.append(k[:, :, :6], v[:, :, :6])
    small = torch.from_numpy(lists(rng, 2, 1, 2, 4, [6, 6])[:, 0])
    attend = (cache.torch_state(), cache.handle, q, "bhsd", 16, None, "bottom_right", 1, -1, -1, None, 0.0, None, small)
    torch.library.opcheck(torch.ops.qkv.kv_cache_attend.default, attend)
    torch.testing.assert_close(torch.ops.qkv.kv_cache_attend(*attend)[0], cache.attend(q, indices=small),
                               rtol=0, atol=0)
    plan = qkv.BatchPlan([0, 2, 4], [20, 6], num_heads=2, num_kv_heads=1, head_dim=16, causal="bottom_right")
    packed_q = q.transpose(1, 2).reshape(4, 2, 16).contiguous()
    k_bshd, v_bshd = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    packed_idx = idx.reshape(4, 8)
    run = (plan._handle, packed_q, k_bshd, v_bshd, None, None, packed_idx)
    torch.library.opcheck(torch.ops.qkv.batch_plan_run.default, run)
    torch.testing.assert_close(torch.ops.qkv.batch_plan_run(*run)[0],
                               plan.run(packed_q, k_bshd, v_bshd, indices=packed_idx), rtol=0, atol=0)
