"""qkv.KVCache.index_topk — the indexer over a cache of index keys — against the PyTorch
formula and torch.topk on the cache's stored keys (KVCache.stored: the values it reads), by
test_index_topk.py's rule (float32 scores within a stated tolerance of the exact ones), and
against qkv.index_topk over those stored keys, which must give the very same indices."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import qkv  # noqa: E402
from test_index_topk import check_against_torch, inputs  # noqa: E402

STORAGES = [dict(dtype="float32"), dict(dtype="bfloat16"), dict(dtype="float16"), dict(dtype="int8"),
            dict(dtype="int8", key_scales="channel"), dict(dtype="int4"), dict(dtype="int4", float_window=16)]


def index_cache(lengths, di, seed=0, **config):
    """A cache of index keys (kv_heads 1, v_dim 1: values unused) holding lengths[b] keys of
    sequence b, appended in two steps."""
    batch, capacity = len(lengths), max(lengths) + 4
    cache = qkv.KVCache(batch, capacity, 1, di, v_dim=1, block_size=32, **config)
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, 1, capacity, di, generator=g)
    for b, length in enumerate(lengths):
        for lo, hi in ((0, length // 3), (length // 3, length)):
            if hi > lo:
                cache.append(keys[b:b + 1, :, lo:hi], torch.zeros(1, 1, hi - lo, 1), seq=b)
    return cache


def stored_keys(cache, lengths, di):
    k = torch.zeros(len(lengths), max(max(lengths), 1), di)
    for b, length in enumerate(lengths):
        k[b, :length] = torch.from_numpy(cache.stored(b)[0][0])  # "bhsd": [1, length, di]
    return k


@pytest.mark.parametrize("config", STORAGES, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("nq", [1, 4])
def test_matches_the_torch_formula_on_the_stored_keys(config, paged, nq):
    lengths, di, heads, topk = [300, 90], 32, 6, 64
    cache = index_cache(lengths, di, paged=paged, **config)
    q, _, w = inputs(2, nq, 1, heads, di, seed=3)
    got = cache.index_topk(q, w, topk, threads=2)
    assert got.dtype == torch.int32 and got.shape == (2, nq, topk)
    k = stored_keys(cache, lengths, di)
    check_against_torch(q, k, w, got, topk, key_lengths=lengths)
    assert torch.equal(got, qkv.index_topk(q, k, w, topk, key_lengths=lengths, threads=2))


def test_numpy_any_thread_count_and_padding():
    lengths, di = [2100, 5, 0], 16
    cache = index_cache(lengths, di, dtype="bfloat16", paged=True)
    q, _, w = inputs(3, 1, 1, 8, di, seed=4)
    one = cache.index_topk(q.numpy(), w.numpy(), 40, threads=1)
    assert isinstance(one, np.ndarray) and one.dtype == np.int32
    for threads in (2, 3):
        assert np.array_equal(one, cache.index_topk(q.numpy(), w.numpy(), 40, threads=threads))
    assert (one[1, 0, 5:] == -1).all() and (one[1, 0, :5] >= 0).all() and (one[2] == -1).all()
    check_against_torch(q, stored_keys(cache, lengths, di), w, torch.from_numpy(one), 40, key_lengths=lengths)


def test_errors_name_the_function_and_argument():
    cache = index_cache([10, 10], 8)
    q, _, w = inputs(2, 1, 1, 2, 8)
    with pytest.raises(qkv.Error, match=r"qkv.KVCache.index_topk: q: expected 4 dimensions"):
        cache.index_topk(q[0], w, 4)
    with pytest.raises(qkv.Error, match=r"qkv::KVCache::index_topk: q.shape\[3\] \(head_dim\)"):
        cache.index_topk(q[..., :4], w, 4)
    with pytest.raises(TypeError, match=r"qkv.KVCache.index_topk: q"):
        cache.index_topk(q.double(), w, 4)
    with pytest.raises(qkv.Error, match=r"qkv.KVCache.index_topk: topk"):
        cache.index_topk(q, w, -1)
    attention_cache = qkv.KVCache(2, 8, 2, 8)
    with pytest.raises(qkv.Error, match=r"config.kv_heads = 2"):
        attention_cache.index_topk(q, w, 4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int8"])
@pytest.mark.parametrize("paged", [False, True])
def test_bf16_queries_both_precisions(dtype, paged):
    """bfloat16 q (a bf16 model's): over a bf16 cache "fast" (the default) takes vdpbf16ps
    where that is the CPU's bf16 unit and equals qkv.index_topk with the same bf16 q over the
    stored keys as bf16 (the same call, the same bits); "exact", and other storages, equal
    the float32 call with q widened. All meet test_index_topk.py's float32 rule; ml_dtypes
    bfloat16 arrays give the torch tensors' bits."""
    import ml_dtypes

    lengths, di, heads, topk = [3000, 90], 64, 64, 128
    cache = index_cache(lengths, di, paged=paged, dtype=dtype)
    q, _, w = inputs(2, 3, 1, heads, di, torch.bfloat16, seed=5)
    k = stored_keys(cache, lengths, di)
    for precision in ("fast", "exact"):
        got = cache.index_topk(q, w, topk, threads=2, precision=precision)
        check_against_torch(q, k, w, got, topk, key_lengths=lengths)
        if dtype == "bfloat16" and precision == "fast":
            want = qkv.index_topk(q, k.bfloat16(), w, topk, key_lengths=lengths, threads=2)
        else:
            want = qkv.index_topk(q.float(), k, w, topk, key_lengths=lengths, threads=2)
        assert torch.equal(got, want), precision
        as_numpy = q.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        assert np.array_equal(cache.index_topk(as_numpy, w.numpy(), topk, threads=1, precision=precision),
                              got.numpy())
