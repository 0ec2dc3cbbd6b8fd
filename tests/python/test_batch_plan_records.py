"""qkv.BatchPlan.run(..., cache_format="fp8_ds_mla") over FlashMLA's FP8 records: a step of
decode tokens, a speculative step and a 40-query prefill chunk over one paged pool of
records (written by qkv.pack_mla_records, read back with NumPy and ml_dtypes in
test_mla_decode_records.unpack). Against the fp64 formula over the stored values
(float32 arithmetic at 8 heads: TOL), and each sequence's rows bitwise
qkv.mla_decode's over the same records alone; packed key lists; the operator under
opcheck and torch.compile; the arguments records do not take refused by name."""

import numpy as np
import pytest
import torch

import qkv
from test_mla_decode import SCALE, TOL
from test_mla_decode_records import unpack

QUERIES = [1, 3, 40, 2]
LENGTHS = [77, 600, 120, 33]
HEADS, DC, DR, BLOCK = 8, 128, 16, 16


def step(seed=0, topk=0):
    """(cu, q [total, H, dc+dr], records pool, table, stored keys per sequence float64, packed lists)."""
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(QUERIES)]).astype(np.int64)
    per_seq = -(-max(LENGTHS) // BLOCK)
    blocks = len(QUERIES) * per_seq + 2
    records = qkv.pack_mla_records(torch.from_numpy(rng.standard_normal((blocks, BLOCK, DC)).astype(np.float32)),
                                   torch.from_numpy(rng.standard_normal((blocks, BLOCK, DR)).astype(np.float32)))
    table = torch.from_numpy(rng.permutation(blocks)[:len(QUERIES) * per_seq].reshape(len(QUERIES), per_seq)
                             .astype(np.int32))
    q = torch.from_numpy(rng.standard_normal((int(cu[-1]), HEADS, DC + DR)).astype(np.float32))
    stored_c, stored_p = unpack(records, DC, DR)
    whole = np.concatenate([stored_c, stored_p], axis=-1)
    keys = [whole[table[b].numpy()].reshape(-1, DC + DR)[:LENGTHS[b]] for b in range(len(QUERIES))]
    lists = None
    if topk:
        lists = np.concatenate([rng.integers(-1, LENGTHS[b], size=(QUERIES[b], topk)) for b in range(len(QUERIES))])
    return cu, q, records, table, keys, lists


def plan_for(cu, table):
    return qkv.BatchPlan(cu, LENGTHS, num_heads=HEADS, num_kv_heads=1, head_dim=DC + DR, v_dim=DC,
                         block_table=table, block_size=BLOCK, scale=SCALE)


def oracle(cu, q, keys, lists=None):
    out = np.zeros((q.shape[0], HEADS, DC))
    lse = np.full((HEADS, q.shape[0]), -np.inf)
    for b, k in enumerate(keys):
        n = cu[b + 1] - cu[b]
        for i in range(n):
            row = cu[b] + i
            end = LENGTHS[b] - n + i + 1
            seen = np.arange(end) if lists is None else np.array(sorted({int(j) for j in lists[row] if 0 <= j < end}))
            if seen.size == 0:
                continue
            s = SCALE * (q[row].double().numpy() @ k[seen].T)
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            out[row] = (p / p.sum(axis=1, keepdims=True)) @ k[seen, :DC]
            lse[:, row] = (m + np.log(p.sum(axis=1, keepdims=True)))[:, 0]
    return out, lse


@pytest.mark.parametrize("topk", [0, 24])
def test_records_step_matches_the_formula_and_mla_decode(topk):
    cu, q, records, table, keys, lists = step(topk=topk)
    plan = plan_for(cu, table)
    indices = None if lists is None else torch.from_numpy(lists)
    out, lse = plan.run(q, records, None, cache_format="fp8_ds_mla", return_lse=True, indices=indices)
    want, want_lse = oracle(cu, q, keys, lists)
    np.testing.assert_allclose(out.double().numpy(), want, atol=TOL, rtol=0)
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse.double().numpy()[finite], want_lse[finite], atol=TOL, rtol=1e-6)
    assert np.all(np.isneginf(lse.numpy()[~finite]))
    for b in range(len(QUERIES)):
        n = int(cu[b + 1] - cu[b])
        rows = q[cu[b]:cu[b + 1]].reshape(1, n, HEADS, DC + DR)
        alone, alone_lse = qkv.mla_decode(rows[..., :DC], rows[..., DC:], records, None, torch.tensor([LENGTHS[b]]),
                                          block_table=table[b:b + 1], scale=SCALE, return_lse=True,
                                          cache_format="fp8_ds_mla",
                                          indices=None if lists is None else indices[cu[b]:cu[b + 1]][None])
        assert torch.equal(out[cu[b]:cu[b + 1]], alone[0]), b
        assert torch.equal(lse[:, cu[b]:cu[b + 1]], alone_lse[0]), b
    # NumPy arrays the same way.
    assert np.array_equal(plan.run(q.numpy(), records.numpy(), None, cache_format="fp8_ds_mla", indices=lists),
                          out.numpy())


def test_bad_calls_name_the_argument():
    cu, q, records, table, _, _ = step()
    plan = plan_for(cu, table)
    with pytest.raises(qkv.Error, match="cache_format: expected None or 'fp8_ds_mla'"):
        plan.run(q, records, None, cache_format="fp8")
    for name, value in (("v_cache", records), ("k_scale", 1.0), ("k_rope_cache", records),
                        ("v_new", torch.zeros(int(cu[-1]), 1, DC))):
        kwargs = {name: value} if name != "v_cache" else {}
        with pytest.raises(qkv.Error, match=f"{name}: expected None with cache_format='fp8_ds_mla'"):
            plan.run(q, records, value if name == "v_cache" else None, cache_format="fp8_ds_mla", **kwargs)
    with pytest.raises(qkv.Error, match=r"records\.shape\[2\] \(record bytes\)"):
        plan.run(q, records[..., :-2], None, cache_format="fp8_ds_mla")
    with pytest.raises(qkv.Error, match="num_kv_heads must be 1"):
        qkv.BatchPlan(cu, LENGTHS, num_heads=HEADS, num_kv_heads=2, head_dim=DC + DR, v_dim=DC, block_table=table,
                      block_size=BLOCK, scale=SCALE).run(q, records, None, cache_format="fp8_ds_mla")
    with pytest.raises(qkv.Error, match="options.window"):
        qkv.BatchPlan(cu, LENGTHS, num_heads=HEADS, num_kv_heads=1, head_dim=DC + DR, v_dim=DC, block_table=table,
                      block_size=BLOCK, scale=SCALE, window=(64, 0)).run(q, records, None, cache_format="fp8_ds_mla")
    with pytest.raises(TypeError, match="records"):
        plan.run(q, records.view(torch.int8), None, cache_format="fp8_ds_mla")


def test_operator_passes_opcheck_and_compiles():
    import qkv.torch  # noqa: F401  (registers the operators)

    cu, q, records, table, _, lists = step(seed=4, topk=16)
    plan = plan_for(cu, table)
    indices = torch.from_numpy(lists)
    eager = plan.run(q, records, None, cache_format="fp8_ds_mla", indices=indices)
    torch.library.opcheck(torch.ops.qkv.batch_plan_run_records.default, (plan._handle, q, records, indices))

    def layer(x):
        return plan.run(x, records, None, cache_format="fp8_ds_mla", indices=indices) * 2

    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q), eager * 2, rtol=0, atol=0)
