"""qkv.BatchPlan.run over MLA's latent cache kept as two pools (FlashInfer's ckv / kpe):
k_rope_cache holds each key's last dr channels, k_cache its first dc, v_cache=None the
values (k_cache's rows). The step — decode tokens, a speculative step and a prefill chunk
of 40 queries — against an fp64 oracle of the absorbed formula; bitwise the combined
[c_kv | k_pe] pool's step and qkv.mla_decode's rows; torch and NumPy; the operator under
opcheck and torch.compile; bad calls named."""

import numpy as np
import pytest
import torch

import qkv

SCALE = 0.2
QUERIES = [1, 3, 40, 2]
LENGTHS = [77, 150, 120, 33]
HEADS, DC, DR, BLOCK = 8, 32, 16, 16


def step(dtype, seed=0, queries=QUERIES, lengths=LENGTHS):
    """(cu, q [total, H, dc+dr], ckv [blocks, BLOCK, 1, dc], kpe [.., dr], table, keys per sequence float64)."""
    g = torch.Generator().manual_seed(seed)
    cu = np.concatenate([[0], np.cumsum(queries)]).astype(np.int32)
    per_seq = -(-max(lengths) // BLOCK)
    blocks = len(queries) * per_seq + 2
    ckv = torch.randn(blocks, BLOCK, 1, DC, generator=g).to(dtype)
    kpe = torch.randn(blocks, BLOCK, 1, DR, generator=g).to(dtype)
    table = torch.from_numpy(np.random.default_rng(seed).permutation(blocks)[:len(queries) * per_seq]
                             .reshape(len(queries), per_seq).astype(np.int32))
    q = torch.randn(int(cu[-1]), HEADS, DC + DR, generator=g)
    whole = torch.cat([ckv, kpe], dim=-1).double()
    keys = [whole[table[b].long()].reshape(-1, DC + DR)[:lengths[b]].numpy() for b in range(len(queries))]
    return cu, q, ckv, kpe, table, keys


def plan_for(cu, table, lengths=LENGTHS, dtype=None):
    return qkv.BatchPlan(cu, lengths, num_heads=HEADS, num_kv_heads=1, head_dim=DC + DR, v_dim=DC,
                         block_table=table, block_size=BLOCK, scale=SCALE, dtype=dtype)


def oracle(cu, q, keys, lengths=LENGTHS):
    out = np.zeros((q.shape[0], HEADS, DC))
    lse = np.zeros((HEADS, q.shape[0]))
    for b, k in enumerate(keys):
        n = cu[b + 1] - cu[b]
        for i in range(n):
            row = cu[b] + i
            visible = k[:lengths[b] - n + i + 1]
            s = SCALE * (q[row].double().numpy() @ visible.T)
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            out[row] = (p / p.sum(axis=1, keepdims=True)) @ visible[:, :DC]
            lse[:, row] = (m + np.log(p.sum(axis=1, keepdims=True)))[:, 0]
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_two_pools_match_the_formula_and_the_combined_pool(dtype):
    cu, q, ckv, kpe, table, keys = step(dtype)
    plan = plan_for(cu, table)
    out, lse = plan.run(q, ckv, None, k_rope_cache=kpe, return_lse=True)
    assert out.shape == (cu[-1], HEADS, DC) and lse.shape == (HEADS, cu[-1])
    want, want_lse = oracle(cu, q, keys)
    # float32 arithmetic over the stored values (bf16 with precision "exact" the same; the
    # one-kv-head bf16 fast path needs >= 16 heads): a few float32 ulps of O(1) results.
    np.testing.assert_allclose(out.double().numpy(), want, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse.double().numpy(), want_lse, atol=2e-5, rtol=1e-6)
    combined = torch.cat([ckv, kpe], dim=-1)
    same, same_lse = plan.run(q, combined, None, return_lse=True)
    assert torch.equal(out, same) and torch.equal(lse, same_lse)
    # FlashInfer's 3-D pools [blocks, block_size, dc | dr]: the same call, a view.
    assert torch.equal(plan.run(q, ckv[:, :, 0], None, k_rope_cache=kpe[:, :, 0]), out)
    # NumPy arrays (float32 and float16: NumPy has no bfloat16 here) read the same way.
    if dtype != torch.bfloat16:
        np_out = plan.run(q.numpy(), ckv.numpy(), None, k_rope_cache=kpe.numpy())
        assert np.array_equal(np_out, out.numpy())


def test_a_decode_step_is_mla_decodes_rows():
    """Every sequence with 2 new tokens: the plan's rows are qkv.mla_decode's over the same
    FlashInfer pools ([blocks, block_size, dc] without the kv-head axis), bit for bit."""
    queries = [2, 2, 2]
    lengths = [77, 9, 150]
    cu, q, ckv, kpe, table, _ = step(torch.bfloat16, seed=3, queries=queries, lengths=lengths)
    plan = plan_for(cu, table, lengths)
    out, lse = plan.run(q, ckv, None, k_rope_cache=kpe, return_lse=True)
    qb = q.reshape(3, 2, HEADS, DC + DR)
    ref, ref_lse = qkv.mla_decode(qb[..., :DC], qb[..., DC:], ckv[:, :, 0], kpe[:, :, 0], torch.tensor(lengths),
                                  block_table=table, scale=SCALE, return_lse=True)
    assert torch.equal(out, ref.reshape(6, HEADS, DC))
    assert torch.equal(lse, ref_lse.permute(1, 0, 2).reshape(HEADS, 6))


def test_bad_calls_name_the_argument():
    cu, q, ckv, kpe, table, _ = step(torch.float32)
    plan = plan_for(cu, table)
    with pytest.raises(TypeError, match="k_rope_cache: expected the dtype of k_cache"):
        plan.run(q, ckv, None, k_rope_cache=kpe.bfloat16())
    with pytest.raises(qkv.Error, match=r"k_rope_cache\.shape\[3\] \(dr\)"):
        plan.run(q, ckv, None, k_rope_cache=torch.cat([ckv, kpe], dim=-1))
    with pytest.raises(qkv.Error, match="k_cache"):
        plan.run(q, ckv, None, k_rope_cache=kpe[..., :8])
    with pytest.raises(qkv.Error, match="k_rope_cache"):
        plan.run(q, ckv, None, k_rope_cache=kpe[:, :8].contiguous())
    # New rows need both parts (test_latent_append.py tests the appending run itself).
    with pytest.raises(qkv.Error, match="k_rope_new: expected with k_rope_cache"):
        plan.run(q, ckv, None, k_rope_cache=kpe, k_new=torch.zeros(cu[-1], 1, DC))
    with pytest.raises(qkv.Error, match="k_rope_cache: not with a qkv.KVCache"):
        plan.run(q, qkv.KVCache(4, 160, 1, DC + DR, v_dim=DC), None, k_rope_cache=kpe)
    with pytest.raises(qkv.Error, match="k_rope_cache: not with int8"):
        plan.run(q, torch.zeros_like(ckv, dtype=torch.int8), None, k_rope_cache=torch.zeros_like(kpe, dtype=torch.int8),
                 k_scale=torch.ones(ckv.shape[:3]))


def test_operator_passes_opcheck_and_compiles():
    import qkv.torch  # noqa: F401  (registers the operators)

    cu, q, ckv, kpe, table, _ = step(torch.bfloat16, seed=5)
    plan = plan_for(cu, table)
    eager = plan.run(q, ckv, None, k_rope_cache=kpe)
    torch.library.opcheck(torch.ops.qkv.batch_plan_run.default,
                          (plan._handle, q, ckv, ckv, None, None, None, kpe))

    def layer(x):
        return plan.run(x, ckv, None, k_rope_cache=kpe) * 2

    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q), eager * 2, rtol=0, atol=0)
