"""qkv.BatchPlan with draft trees (tree_mask, tree_mask_offsets) from Python, against a
NumPy fp64 dense-mask reference: random parent-pointer trees (≤ 64 nodes, depth ≤ 6) as
ancestor masks, shuffled out of topological order, arbitrary masks, next to sequences
without a tree, over contiguous and shuffled paged caches (float32, bfloat16, int8),
NumPy and torch inputs; the errors.

Bound (test_batch_plan.py's, docs/numerics.md's float32 contract): max error ≤ 2 × plain
float32's (property_math.plain_attention in float32 with the same dense mask, on the same
stored values) + 8 float32 ulps of max(1, max|exact|), per sequence.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv
from property_math import largest, max_error, plain_attention

pytestmark = pytest.mark.skipif("cpu" not in qkv.available_backends(), reason="cpu backend not built")

EPS = float(np.finfo(np.float32).eps)
HEADS, KV_HEADS, D = 8, 2, 64


def ancestor_mask(n, rng, shuffled=False):
    """A random tree of n nodes (node 0 the root, depth ≤ 6): row i marks i and its ancestors."""
    parent, depth = [-1], [1]
    for i in range(1, n):
        p = int(rng.choice([p for p in range(i) if depth[p] < 6]))
        parent.append(p)
        depth.append(depth[p] + 1)
    place = rng.permutation(n) if shuffled else np.arange(n)
    mask = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[place[i], place[j]] = True
            j = parent[j]
    return mask


def arbitrary_mask(n, rng):
    mask = rng.random((n, n)) < 0.5
    np.fill_diagonal(mask, True)
    return mask


class TreeStep:
    """Per sequence (new tokens n, cached prefix, kind): kind None (no tree: bottom-right
    causal), "tree", "shuffled" or "arbitrary". Caches stored in `dtype`, contiguous or a
    shuffled paged pool; masks flattened with junk entries between them."""

    def __init__(self, seqs, *, dtype=torch.float32, block_size=None, seed=0):
        rng = np.random.default_rng(seed)
        g = torch.Generator().manual_seed(seed)
        self.queries = [n for n, _, _ in seqs]
        self.lengths = [n + prefix for n, prefix, _ in seqs]
        self.cu = np.concatenate([[0], np.cumsum(self.queries)]).astype(np.int64)
        self.masks, flat, self.offsets = [], [], []
        for n, _, kind in seqs:
            mask = None if kind is None else (arbitrary_mask(n, rng) if kind == "arbitrary"
                                              else ancestor_mask(n, rng, shuffled=kind == "shuffled"))
            self.masks.append(mask)
            if mask is None:
                self.offsets.append(-1)
                continue
            flat.append(np.ones(2, dtype=bool))  # junk between masks
            self.offsets.append(sum(x.size for x in flat))
            flat.append(mask.ravel())
        self.tree_mask = np.concatenate(flat) if flat else np.zeros(0, dtype=bool)
        capacity = max(max(self.lengths), 1)
        self.q = torch.randn(int(self.cu[-1]), HEADS, D, generator=g)
        k = torch.randn(len(seqs), capacity, KV_HEADS, D, generator=g)
        v = torch.randn(len(seqs), capacity, KV_HEADS, D, generator=g)
        self.k, self.k_scale, self.k_exact = self._stored(k, dtype)
        self.v, self.v_scale, self.v_exact = self._stored(v, dtype)
        self.table, self.block_size = None, block_size
        if block_size:
            per = -(-capacity // block_size)
            order = torch.randperm(len(seqs) * per + 3, generator=g)
            self.table = order[: len(seqs) * per].view(len(seqs), per)
            self.k, self.v = self._pool(self.k, order.numel()), self._pool(self.v, order.numel())
            if self.k_scale is not None:
                self.k_scale, self.v_scale = self._pool(self.k_scale, order.numel()), self._pool(self.v_scale, order.numel())

    @staticmethod
    def _stored(x, dtype):
        if dtype == torch.int8:
            scale = x.abs().amax(-1) / 127.0
            levels = torch.round(x / scale[..., None]).clamp(-127, 127)
            return levels.to(torch.int8), scale.float(), (levels.double() * scale[..., None].double()).numpy()
        s = x.to(dtype)
        return s, None, s.double().numpy()

    def _pool(self, x, blocks):
        out = torch.zeros((blocks, self.block_size) + tuple(x.shape[2:]), dtype=x.dtype)
        for b in range(x.shape[0]):
            for n in range(self.table.shape[1]):
                rows = x[b, n * self.block_size:(n + 1) * self.block_size]
                out[int(self.table[b, n]), : rows.shape[0]] = rows
        return out

    def plan(self, **options):
        return qkv.BatchPlan(self.cu, self.lengths, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D,
                             block_table=self.table, block_size=self.block_size, tree_mask=self.tree_mask,
                             tree_mask_offsets=self.offsets, **options)

    def run(self, plan=None, **options):
        plan = plan or self.plan(**options)
        return plan.run(self.q, self.k, self.v, k_scale=self.k_scale, v_scale=self.v_scale, return_lse=True)

    def visible(self, b):
        """Sequence b's dense mask [n, L]: the prefix, then its tree (or bottom-right causality)."""
        n, length = self.queries[b], self.lengths[b]
        prefix = length - n
        seen = np.ones((n, length), dtype=bool)
        seen[:, prefix:] = self.masks[b] if self.masks[b] is not None else np.tril(np.ones((n, n), dtype=bool))
        return seen


def dense_reference(q, k, v, seen):
    """fp64 NumPy attention of q [n, Hq, d] over k, v [L, Hkv, d] with seen [n, L]: (out [n, Hq, dv], lse [Hq, n])."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("ihc,jhc->hij", q, k) / np.sqrt(q.shape[-1])
    s = np.where(seen[None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    lse = (m[..., 0] + np.log(p.sum(-1)))
    out = np.einsum("hij,jhc->ihc", p / p.sum(-1, keepdims=True), v)
    return out, lse


def check_against_reference(step, out, lse):
    out, lse = torch.as_tensor(out), torch.as_tensor(lse)
    for b, n in enumerate(step.queries):
        if n == 0:
            continue
        rows = slice(int(step.cu[b]), int(step.cu[b + 1]))
        length, seen = step.lengths[b], step.visible(b)
        k, v = step.k_exact[b, :length], step.v_exact[b, :length]
        exact, exact_lse = dense_reference(step.q[rows].double().numpy(), k, v, seen)
        bhsd = lambda x: torch.from_numpy(np.ascontiguousarray(x)).transpose(0, 1)[None]  # noqa: E731
        plain = plain_attention(step.q[rows].transpose(0, 1)[None].float(), bhsd(k).float(), bhsd(v).float(),
                                keep=torch.from_numpy(seen)[None, None])
        exact_t = bhsd(exact)
        ours = out[rows].double().transpose(0, 1)[None]
        bound = 2 * max_error(plain, exact_t) + 8 * EPS * max(1.0, largest(exact_t))
        assert max_error(ours, exact_t) <= bound, f"sequence {b} ({n} tokens): {max_error(ours, exact_t):.3e} > {bound:.3e}"
        # lse: a gross check (errors of a few ulps of |lse| are expected, not 64).
        lse_error = np.abs(lse[:, rows].double().numpy() - exact_lse).max()
        assert lse_error <= 64 * EPS * max(1.0, np.abs(exact_lse).max()), f"sequence {b}: lse error {lse_error:.3e}"


# Trees of 64 (two query tiles on a long prefix), 7 (no prefix), 17 (shuffled), 40
# (arbitrary), 16 and 1 nodes, beside a decode token, a 20-query prefill chunk and an
# empty sequence.
MIXED = [(1, 40, None), (64, 1100, "tree"), (7, 0, "tree"), (20, 30, None), (17, 75, "shuffled"), (0, 9, None),
         (40, 3, "arbitrary"), (16, 130, "tree"), (1, 600, "tree")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("block_size", [None, 16, 5])
def test_random_trees_match_the_dense_mask_reference(dtype, block_size):
    step = TreeStep(MIXED, dtype=dtype, block_size=block_size, seed=1)
    out, lse = step.run(threads=2)
    check_against_reference(step, out, lse)
    again, again_lse = step.run(threads=1)
    assert torch.equal(out, again) and torch.equal(lse, again_lse)


def test_many_random_trees():
    rng = np.random.default_rng(11)
    for seed in range(4):
        seqs = [(int(rng.integers(1, 65)), int(rng.integers(0, 300)), str(rng.choice(["tree", "shuffled", "arbitrary"])))
                for _ in range(3)] + [(1, 50, None)]
        step = TreeStep(seqs, block_size=16, seed=seed)
        check_against_reference(step, *step.run())


def test_numpy_inputs_and_mask_dtypes_give_the_same_bits():
    """NumPy queries, caches and masks (bool or uint8, flat or each sequence's [n, n]), offsets
    as a list or an int32 array: the bits of the torch call."""
    step = TreeStep([(12, 20, "tree"), (1, 7, None)], seed=3)
    out = step.run()[0]
    common = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D)
    for mask, offsets in ((step.tree_mask.astype(np.uint8), np.asarray(step.offsets, dtype=np.int32)),
                          (torch.from_numpy(step.tree_mask), torch.tensor(step.offsets)),
                          (step.masks[0], [0, -1])):  # one sequence's [n, n] mask, read flattened
        plan = qkv.BatchPlan(step.cu, step.lengths, tree_mask=mask, tree_mask_offsets=offsets, **common)
        got = plan.run(step.q.numpy(), step.k.numpy(), step.v.numpy())
        assert isinstance(got, np.ndarray) and np.array_equal(got, out.numpy())


def test_the_tree_replaces_causality_and_the_plan_copies_the_masks():
    step = TreeStep([(30, 50, "shuffled"), (9, 0, "tree")], block_size=16, seed=4)
    plan = step.plan()
    out = step.run(plan)[0]
    step.tree_mask[:] = True  # the plan kept its own copy
    assert torch.equal(step.run(plan)[0], out)
    assert torch.equal(step.run(causal=None)[0], step.run(causal="bottom_right")[0])


def test_a_sequence_alone_has_its_bits_in_the_batch():
    step = TreeStep(MIXED, dtype=torch.bfloat16, block_size=16, seed=5)
    out, lse = step.run(threads=2)
    for b in (1, 4, 6):
        rows = slice(int(step.cu[b]), int(step.cu[b + 1]))
        n = step.queries[b]
        plan = qkv.BatchPlan([0, n], [step.lengths[b]], num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D,
                             block_table=step.table[b:b + 1], block_size=16,
                             tree_mask=step.tree_mask, tree_mask_offsets=[step.offsets[b]], threads=3)
        alone, alone_lse = plan.run(step.q[rows], step.k, step.v, return_lse=True)
        assert torch.equal(alone, out[rows]) and torch.equal(alone_lse, lse[:, rows]), f"sequence {b}"


def test_bad_trees_name_the_argument():
    step = TreeStep([(4, 10, "tree"), (3, 5, "tree")], seed=6)
    common = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D)
    make = lambda mask=step.tree_mask, offsets=step.offsets, **options: qkv.BatchPlan(  # noqa: E731
        step.cu, step.lengths, tree_mask=mask, tree_mask_offsets=offsets, **common, **options)
    with pytest.raises(qkv.Error, match=r"tree_mask_offsets\[1\]: expected -1 \(no tree\) or 0\.\."):
        make(offsets=[step.offsets[0], step.tree_mask.size - 8])
    with pytest.raises(qkv.Error, match=r"tree_mask_offsets\[0\]"):
        make(offsets=[-3, step.offsets[1]])
    with pytest.raises(qkv.Error, match=r"tree_mask_offsets: expected one offset per sequence \(2"):
        make(offsets=[step.offsets[0]])
    with pytest.raises(qkv.Error, match=r"tree_mask_offsets: expected one offset per sequence"):
        make(offsets=None)
    with pytest.raises(qkv.Error, match=r"tree_mask: expected the flattened masks"):
        make(mask=None)
    broken = step.tree_mask.copy()
    broken[step.offsets[1] + 2 * 3 + 2] = False
    with pytest.raises(qkv.Error, match=r"\(sequence 1, token 2 sees itself\): expected true"):
        make(mask=broken)
    with pytest.raises(TypeError, match=r"tree_mask: expected dtype bool or uint8, got float32"):
        make(mask=step.tree_mask.astype(np.float32))
    with pytest.raises(qkv.Error, match=r"options.causal: expected none or bottom_right with a tree_mask"):
        make(causal="top_left")
    with pytest.raises(qkv.Error, match=r"options.window: not with a tree_mask"):
        make(window=(16, 0))
    with pytest.raises(qkv.Error, match=r"options.alibi_slopes: not with a tree_mask"):
        make(alibi_slopes=[0.5] * HEADS)
    plan = make()
    with pytest.raises(qkv.Error, match=r"indices: not with a plan that has a tree_mask"):
        plan.run(step.q, step.k, step.v, indices=torch.zeros(int(step.cu[-1]), 2, dtype=torch.int32))
