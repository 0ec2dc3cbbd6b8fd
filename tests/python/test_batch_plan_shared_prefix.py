"""qkv.BatchPlan(shared_prefixes=True) from Python: parallel sampling (n sequences on one
prompt), beam search (nested sharing) and a common system prompt over a shuffled paged
pool (float32, bfloat16, int8), against a float64 reference computed here in torch over
the stored values, and against the same plan without sharing; the groups found; rotary +
append in the same call; the errors.

Bound (test_batch_plan.py's, docs/numerics.md's float32 contract, with the plain plan as
the yardstick): max error ≤ 2 × the plain plan's + 8 float32 ulps of max(1, max|exact|).
The shared run partitions each grouped row's keys and merges the parts by LSE: it may
round differently from the plain run, not worse.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv
from property_math import largest, max_error

pytestmark = pytest.mark.skipif("cpu" not in qkv.available_backends(), reason="cpu backend not built")

EPS = float(np.finfo(np.float32).eps)
HEADS, KV_HEADS, D, BLOCK = 8, 2, 64, 16


class Pool:
    """Sequences given as (new queries, shared runs, own keys): each table starts with the
    blocks of its shared runs (run r: runs[r] blocks, the same pool blocks for everyone who
    names it), then blocks of its own; its new tokens are its last keys. Pool blocks in a
    shuffled order; rows nobody's keys reach hold NaN."""

    def __init__(self, runs, seqs, *, dtype=torch.float32, seed=0):
        rng = np.random.default_rng(seed)
        g = torch.Generator().manual_seed(seed)
        own_blocks = [-(-own // BLOCK) for _, _, own in seqs]
        pool = sum(runs) + sum(own_blocks) + 1
        ids = rng.permutation(pool)
        run_ids, start = [], 0
        for blocks in runs:
            run_ids.append(list(ids[start:start + blocks]))
            start += blocks
        rows, self.lengths, self.queries = [], [], []
        for (n, names, own), blocks in zip(seqs, own_blocks):
            row = [b for r in names for b in run_ids[r]] + list(ids[start:start + blocks])
            start += blocks
            rows.append(row)
            self.lengths.append(sum(runs[r] for r in names) * BLOCK + own)
            self.queries.append(n)
        width = max(len(r) for r in rows)
        self.table = np.array([r + [0] * (width - len(r)) for r in rows], dtype=np.int32)
        self.cu = np.concatenate([[0], np.cumsum(self.queries)]).astype(np.int32)
        self.dtype = dtype
        k = torch.randn(pool, BLOCK, KV_HEADS, D, generator=g)
        v = torch.randn(pool, BLOCK, KV_HEADS, D, generator=g)
        used = torch.zeros(pool, BLOCK, dtype=torch.bool)
        for row, length in zip(rows, self.lengths):
            for j in range(length):
                used[row[j // BLOCK], j % BLOCK] = True
        k[~used] = float("nan")
        v[~used] = float("nan")
        if dtype == torch.int8:  # one scale per row, max|x| / 127
            self.k_scale = (k.abs().amax(-1) / 127).nan_to_num(1.0)
            self.v_scale = (v.abs().amax(-1) / 127).nan_to_num(1.0)
            self.k = torch.round(k / self.k_scale[..., None]).nan_to_num(0).to(torch.int8)
            self.v = torch.round(v / self.v_scale[..., None]).nan_to_num(0).to(torch.int8)
        else:
            self.k, self.v = k.to(dtype), v.to(dtype)
            self.k_scale = self.v_scale = None
        self.q = torch.randn(int(self.cu[-1]), HEADS, D, generator=g)

    def stored(self, keys):
        x, scale = (self.k, self.k_scale) if keys else (self.v, self.v_scale)
        return x.double() * scale.double()[..., None] if scale is not None else x.double()

    def plan(self, shared, **options):
        return qkv.BatchPlan(self.cu, np.array(self.lengths, np.int32), num_heads=HEADS, num_kv_heads=KV_HEADS,
                             head_dim=D, block_table=self.table, block_size=BLOCK, dtype=self.dtype,
                             shared_prefixes=shared, **options)

    def run(self, plan):
        return plan.run(self.q, self.k, self.v, k_scale=self.k_scale, v_scale=self.v_scale, return_lse=True)

    def reference(self, softcap=None, sinks=None):
        """fp64 attention per sequence over its stored keys, causal bottom-right."""
        k, v = self.stored(True), self.stored(False)
        outs, lses = [], []
        group = HEADS // KV_HEADS
        for b, (n, length) in enumerate(zip(self.queries, self.lengths)):
            if n == 0:
                continue
            blocks = self.table[b, :-(-length // BLOCK)]
            kb = k[blocks].reshape(-1, KV_HEADS, D)[:length].repeat_interleave(group, 1)  # [L, Hq, d]
            vb = v[blocks].reshape(-1, KV_HEADS, D)[:length].repeat_interleave(group, 1)
            q = self.q[self.cu[b]:self.cu[b + 1]].double()
            s = torch.einsum("nhd,lhd->hnl", q, kb) / D ** 0.5
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            visible = torch.arange(length)[None, :] <= (length - n + torch.arange(n))[:, None]
            s = s.masked_fill(~visible, float("-inf"))
            if sinks is not None:
                s = torch.cat([s, sinks.double()[:, None, None].expand(HEADS, n, 1)], -1)
            lse = torch.logsumexp(s, -1)
            p = torch.exp(s - lse[..., None])[..., :length]
            outs.append(torch.einsum("hnl,lhd->nhd", p, vb))
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses, 1)


# Parallel sampling (0-3: four samples of one 300-key prompt), beam search (4-7 on a
# 100-key prompt, 4 and 5 sharing 60 more keys, 6 and 7 another 60), a prefill chunk (8,
# 24 new tokens after the beam prompt), a sequence of its own (9), an empty one (10).
RUNS = [19, 7, 4, 4]
SEQS = [(1, [0], 37), (1, [0], 5), (1, [0], 120), (1, [0], 1),
        (1, [1, 2], 9), (3, [1, 2], 20), (1, [1, 3], 2), (2, [1, 3], 33),
        (24, [1], 40), (1, [], 500), (0, [0], 3)]


def expect_within_bound(pool, got, plain, reference):
    for name, x, y, exact in (("out", got[0], plain[0], reference[0]), ("lse", got[1], plain[1], reference[1])):
        bound = 2 * max_error(y, exact) + 8 * EPS * max(1.0, largest(exact))
        assert max_error(x, exact) <= bound, f"{name}: {max_error(x, exact)} > {bound}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_shared_prefixes_match_the_reference_and_the_plain_plan(dtype):
    pool = Pool(RUNS, SEQS, dtype=dtype, seed=1)
    shared, plain = pool.plan(True), pool.plan(False)
    got, base = pool.run(shared), pool.run(plain)
    expect_within_bound(pool, got, base, pool.reference())
    assert not torch.equal(got[0], base[0])  # the grouped rows took the shared path
    alone = slice(int(pool.cu[9]), int(pool.cu[10]))  # sequence 9 is in no group: the plain bits
    assert torch.equal(got[0][alone], base[0][alone]) and torch.equal(got[1][:, alone], base[1][:, alone])
    for threads in (1, 3):  # the same bits for any thread count
        again = pool.run(pool.plan(True, threads=threads))
        assert torch.equal(again[0], got[0]) and torch.equal(again[1], got[1])


def test_softcap_and_sinks():
    pool = Pool(RUNS, SEQS, dtype=torch.bfloat16, seed=2)
    sinks = torch.linspace(-1.0, 2.0, HEADS)
    got = pool.run(pool.plan(True, softcap=3.0, sinks=sinks))
    base = pool.run(pool.plan(False, softcap=3.0, sinks=sinks))
    expect_within_bound(pool, got, base, pool.reference(softcap=3.0, sinks=sinks))


def test_the_groups_found():
    pool = Pool(RUNS, SEQS, seed=3)
    groups = pool.plan(True).prefix_groups
    # The four samples share 19 blocks. The five beam sequences (chunk 8 included) share
    # 7 blocks, 4 · 7 = 28 reads saved, more than the two pairs sharing 11 save (11 + 11).
    assert groups == [([0, 1, 2, 3], 19 * BLOCK), ([4, 5, 6, 7, 8], 7 * BLOCK)]
    # With longer pair runs the pairs win: 2 · 19 = 38 > 4 · 7.
    longer = Pool([19, 7, 12, 12], SEQS, seed=3).plan(True).prefix_groups
    assert longer == [([0, 1, 2, 3], 19 * BLOCK), ([4, 5], 19 * BLOCK), ([6, 7], 19 * BLOCK)]
    assert pool.plan(False).prefix_groups == []


def test_rotary_and_append_in_the_same_call():
    pool = Pool(RUNS, SEQS, dtype=torch.bfloat16, seed=4)
    total = int(pool.cu[-1])
    g = torch.Generator().manual_seed(5)
    k_new, v_new = torch.randn(total, KV_HEADS, D, generator=g), torch.randn(total, KV_HEADS, D, generator=g)
    angles = torch.rand(total, D // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    results = []
    for shared in (True, False):
        k, v = pool.k.clone(), pool.v.clone()
        out, lse = pool.plan(shared).run(pool.q, k, v, k_new=k_new, v_new=v_new, rotary_cos=cos, rotary_sin=sin,
                                         return_lse=True)
        results.append((out, lse, k, v))
    (out, lse, k, v), (plain_out, plain_lse, plain_k, plain_v) = results
    assert torch.equal(k.nan_to_num(), plain_k.nan_to_num()) and torch.equal(v.nan_to_num(), plain_v.nan_to_num())
    # The reference over the caches as written and q rotated as transformers rotates it
    # (NeoX half-split: x·cos + rotate_half(x)·sin, in float32).
    half = D // 2
    pool.k, pool.v = k, v
    pool.q = pool.q * cos[:, None] + torch.cat([-pool.q[..., half:], pool.q[..., :half]], -1) * sin[:, None]
    expect_within_bound(pool, (out, lse), (plain_out, plain_lse), pool.reference())


def test_errors_name_the_argument():
    pool = Pool(RUNS, SEQS, seed=6)
    with pytest.raises(qkv.Error, match="share_prefixes: expected a paged layout"):
        qkv.BatchPlan(pool.cu, np.array(pool.lengths, np.int32), num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D,
                      shared_prefixes=True)
    with pytest.raises(qkv.Error, match="options.window: not with layout.share_prefixes"):
        pool.plan(True, window=(32, 0))
    with pytest.raises(qkv.Error, match="fixed_key_split: not with layout.share_prefixes"):
        pool.plan(True, fixed_key_split=True)
    with pytest.raises(qkv.Error, match="options.causal: expected none or bottom_right"):
        pool.plan(True, causal="top_left")
    indices = torch.zeros(int(pool.cu[-1]), 4, dtype=torch.int32)
    with pytest.raises(qkv.Error, match="indices: not with a plan whose sequences share prefixes"):
        pool.plan(True).run(pool.q, pool.k, pool.v, indices=indices)
