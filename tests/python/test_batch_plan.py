"""qkv.BatchPlan (and KVCache.append_varlen) from Python, against an fp64 per-sequence
reference: random serving steps (query counts 0, 1, 3, 17, 200+; cache lengths ≥ query
counts; shuffled block tables; float32/bfloat16/int8 caches; GQA; the variants).

Bound: the float32 contract of docs/numerics.md against attention over the values the cache stores
— max error ≤ 2 × plain float32's (property_math.plain_attention in float32 on the same
stored values) + 8 float32 ulps of max(1, max|exact|) — per sequence.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv
from property_math import max_error, largest, plain_attention

pytestmark = pytest.mark.skipif("cpu" not in qkv.available_backends(), reason="cpu backend not built")

EPS = float(torch.finfo(torch.float32).eps)


def stored(x, dtype):
    """(the cache's storage of x [..., d] in dtype, scales or None, the stored values in float64)."""
    if dtype == torch.int8:
        scale = x.abs().amax(-1) / 127.0
        q = torch.where(scale[..., None] > 0, torch.round(x / scale[..., None].clamp_min(1e-30)), 0).clamp(-127, 127)
        return q.to(torch.int8), scale.float(), (q * scale[..., None].float()).double()
    s = x.to(dtype)
    return s, None, s.double()


class Step:
    """A random step: per sequence n_b new queries and L_b cached keys, stored in a
    contiguous [B, capacity, Hkv, d] cache or a shuffled paged pool."""

    def __init__(self, queries, lengths, *, heads=8, kv_heads=2, d=64, dtype=torch.float32, block_size=None, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.queries, self.lengths = list(queries), list(lengths)
        self.heads, self.kv_heads, self.d = heads, kv_heads, d
        self.cu = np.concatenate([[0], np.cumsum(self.queries)]).astype(np.int64)
        capacity = max(max(self.lengths), 1)
        self.q = torch.randn(int(self.cu[-1]), heads, d, generator=g)
        k = torch.randn(len(self.queries), capacity, kv_heads, d, generator=g)
        v = torch.randn(len(self.queries), capacity, kv_heads, d, generator=g)
        (self.k, self.k_scale, self.k_exact), (self.v, self.v_scale, self.v_exact) = stored(k, dtype), stored(v, dtype)
        self.table = None
        if block_size:
            per = -(-capacity // block_size)
            order = torch.randperm(len(self.queries) * per + 3, generator=g)
            self.table = order[: len(self.queries) * per].view(len(self.queries), per)  # int64
            pool = lambda x: self._pool(x, order.numel(), block_size)  # noqa: E731
            self.k, self.v = pool(self.k), pool(self.v)
            if self.k_scale is not None:
                self.k_scale, self.v_scale = pool(self.k_scale), pool(self.v_scale)
        self.block_size = block_size

    def _pool(self, x, blocks, block_size):
        shape = (blocks, block_size) + tuple(x.shape[2:])
        out = torch.zeros(shape, dtype=x.dtype)
        for b in range(x.shape[0]):
            for n in range(self.table.shape[1]):
                rows = x[b, n * block_size:(n + 1) * block_size]
                out[int(self.table[b, n]), : rows.shape[0]] = rows
        return out

    def plan(self, **options):
        return qkv.BatchPlan(self.cu, self.lengths, num_heads=self.heads, num_kv_heads=self.kv_heads,
                             head_dim=self.d, block_table=self.table, block_size=self.block_size, **options)

    def run(self, **options):
        return self.plan(**options).run(self.q, self.k, self.v, k_scale=self.k_scale, v_scale=self.v_scale,
                                        return_lse=True)

    def sequence(self, b):
        """(q [1, Hq, n, d], k, v [1, Hkv, L, d]) of sequence b in float64, the stored values."""
        rows = slice(int(self.cu[b]), int(self.cu[b + 1]))
        length = self.lengths[b]
        as_bhsd = lambda x: x[b:b + 1, :length].transpose(1, 2)  # noqa: E731
        return self.q[rows].double().transpose(0, 1)[None], as_bhsd(self.k_exact), as_bhsd(self.v_exact)


def check_step(step, variants=None, **options):
    variants = variants or {}
    out, lse = step.run(**options, **variants)
    assert out.shape == (step.cu[-1], step.heads, step.d) and lse.shape == (step.heads, step.cu[-1])
    per_head = {name: torch.as_tensor(variants[key]).double()
                for key, name in (("alibi_slopes", "alibi"), ("sinks", "sinks")) if key in variants}
    rules = dict(causal=options.get("causal", "bottom_right"), scale=variants.get("scale"),
                 window=variants.get("window"), softcap=variants.get("softcap"), **per_head)
    for b, n in enumerate(step.queries):
        if n == 0:
            continue
        q, k, v = step.sequence(b)
        exact = plain_attention(q, k, v, **rules)
        plain = plain_attention(q.float(), k.float(), v.float(),
                                **{key: (x.float() if torch.is_tensor(x) else x) for key, x in rules.items()})
        ours = out[int(step.cu[b]):int(step.cu[b + 1])].double().transpose(0, 1)[None]
        bound = 2 * max_error(plain, exact) + 8 * EPS * max(1.0, largest(exact))
        assert max_error(ours, exact) <= bound, f"sequence {b} ({n} queries): {max_error(ours, exact):.3e} > {bound:.3e}"


MIXED = dict(queries=[0, 1, 3, 17, 200, 1, 40], lengths=[0, 301, 5, 17, 230, 650, 700])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("block_size", [None, 16, 5])
def test_a_mixed_step_matches_the_fp64_reference_per_sequence(dtype, block_size):
    check_step(Step(**MIXED, dtype=dtype, block_size=block_size, seed=1))


def test_variants_over_a_paged_cache():
    slopes = [2.0 ** -(h + 1) for h in range(8)]
    sinks = [0.3 * h - 1.0 for h in range(8)]
    step = Step(**MIXED, dtype=torch.bfloat16, block_size=16, seed=2)
    check_step(step, dict(window=(100, 0), softcap=20.0, alibi_slopes=slopes, sinks=sinks, scale=0.2))
    check_step(step, causal=None)


def test_batch_invariance_against_each_sequence_alone_and_threads():
    """Each sequence's rows are it computed alone, bit for bit — qkv.decode for ≤ 32
    queries, qkv.attention over its keys as float32 for a prefill chunk (the tiled
    schedule the plan runs chunks on); any thread count."""
    step = Step(**MIXED, dtype=torch.bfloat16, seed=3)
    out, lse = step.run(threads=2)
    again, _ = step.run(threads=1)
    assert torch.equal(out, again)
    for b, n in enumerate(step.queries):
        if n == 0:
            continue
        rows = slice(int(step.cu[b]), int(step.cu[b + 1]))
        length = step.lengths[b]
        if n > 32:
            alone, alone_lse = qkv.attention(step.q[rows][None], step.k[b:b + 1, :length].float(),
                                             step.v[b:b + 1, :length].float(), causal="bottom_right", layout="bshd",
                                             return_lse=True, threads=2)
        else:
            alone, alone_lse = qkv.decode(step.q[rows][None], step.k[b:b + 1], step.v[b:b + 1], [length],
                                          layout="bshd", return_lse=True, threads=2)
        assert torch.equal(alone[0], out[rows]), f"sequence {b}"
        assert torch.equal(alone_lse[0], lse[:, rows]), f"sequence {b}"


def test_fixed_key_split_reproduces_prefill_rows_in_decode_steps():
    n, length = 40, 1300
    chunk = Step([n], [length], kv_heads=1, heads=8, dtype=torch.float32, block_size=16, seed=4)  # GQA 8:1
    prefill, _ = chunk.run(fixed_key_split=True)
    for i in (0, 17, 39):
        plan = qkv.BatchPlan([0, 1], [length - n + i + 1], num_heads=8, num_kv_heads=1, head_dim=64,
                             block_table=chunk.table, block_size=16, fixed_key_split=True)
        token = plan.run(chunk.q[i:i + 1], chunk.k, chunk.v)
        assert torch.equal(token[0], prefill[i]), f"query {i}"


def test_kv_cache_append_varlen_feeds_a_batch_plan():
    torch.manual_seed(5)
    cache = qkv.KVCache(3, 256, 2, 64, dtype="bfloat16", paged=True, block_size=16, layout="bshd")
    prompt = [30, 0, 7]
    cu = np.concatenate([[0], np.cumsum(prompt)])
    k, v = torch.randn(int(cu[-1]), 2, 64), torch.randn(int(cu[-1]), 2, 64)
    cache.append_varlen(k, v, cu)
    assert cache.lengths == prompt
    q = torch.randn(int(cu[-1]), 8, 64)
    table = torch.from_numpy(cache.block_table().copy())
    keys, values = cache.torch_storage()
    plan = qkv.BatchPlan(cu, cache.lengths, num_heads=8, num_kv_heads=2, head_dim=64, block_table=table,
                         block_size=16)
    out = plan.run(q, keys, values)
    for b, n in enumerate(prompt):
        if n == 0:
            continue
        rows = slice(int(cu[b]), int(cu[b + 1]))
        kb = k[rows].to(torch.bfloat16).double().transpose(0, 1)[None]
        vb = v[rows].to(torch.bfloat16).double().transpose(0, 1)[None]
        exact = plain_attention(q[rows].double().transpose(0, 1)[None], kb, vb, causal="bottom_right")
        torch.testing.assert_close(out[rows].double().transpose(0, 1)[None], exact, rtol=0, atol=2e-5)
    with pytest.raises(qkv.Error, match=r"cu_seqlens\[2\]"):
        cache.append_varlen(k, v, [0, 10, 5, int(cu[-1])])
    assert cache.lengths == prompt  # nothing appended by the failed call


def test_bad_layouts_and_views_name_the_argument():
    step = Step(**MIXED, block_size=16, seed=6)
    layout = dict(num_heads=8, num_kv_heads=2, head_dim=64, block_table=step.table, block_size=16)
    with pytest.raises(qkv.Error, match=r"cu_seqlens_q\[2\]: expected >= cu_seqlens_q\[1\]"):
        qkv.BatchPlan([0, 1, 0, 4, 21, 221, 222, 262], step.lengths, **layout)
    with pytest.raises(qkv.Error, match=r"cache_lengths\[4\]"):
        qkv.BatchPlan(step.cu, [0, 301, 5, 17, 199, 650, 700], **layout)
    with pytest.raises(qkv.Error, match=r"cache_lengths\[6\]: expected at most"):
        qkv.BatchPlan(step.cu, [0, 301, 5, 17, 230, 650, 5000], **layout)
    with pytest.raises(qkv.Error, match=r"layout.num_heads"):
        qkv.BatchPlan(step.cu, step.lengths, **dict(layout, num_heads=7))
    with pytest.raises(qkv.Error, match=r"block_table\[0, 0\]: expected a block id that fits int32"):
        qkv.BatchPlan(step.cu, step.lengths, **dict(layout, block_table=step.table + 2**32))
    with pytest.raises(qkv.Error, match=r"window"):
        qkv.BatchPlan(step.cu, step.lengths, window=(-5, 0), **layout)
    plan = step.plan()
    with pytest.raises(qkv.Error, match=r"block_table\[\d+, \d+\]: expected a pool block 0\.\.2"):
        plan.run(step.q, step.k[:3], step.v[:3])
    with pytest.raises(qkv.Error, match=r"q.shape\[1\]"):
        plan.run(step.q[:, :4], step.k, step.v)


def test_int32_offsets_and_an_empty_step():
    step = Step([2, 0, 5], [9, 3, 5], seed=7)
    as_int32 = qkv.BatchPlan(step.cu.astype(np.int32), np.asarray(step.lengths, dtype=np.int32), num_heads=8,
                             num_kv_heads=2, head_dim=64).run(step.q, step.k, step.v)
    assert torch.equal(as_int32, step.plan().run(step.q, step.k, step.v))
    empty = qkv.BatchPlan([0, 0, 0], [0, 4], num_heads=8, num_kv_heads=2, head_dim=64)
    assert empty.run(torch.zeros(0, 8, 64), step.k[:2], step.v[:2]).shape == (0, 8, 64)


def test_the_plan_runs_under_torch_compile_fullgraph_and_passes_opcheck():
    """plan.run is the operator torch.ops.qkv.batch_plan_run when traced: opcheck agrees
    with its schema and fake, and a fullgraph compile (aot_eager) gives eager's bits."""
    import qkv.torch  # noqa: F401  (registers the operators)

    step = Step(**MIXED, dtype=torch.bfloat16, block_size=16, seed=8)
    plan = step.plan()
    eager = plan.run(step.q, step.k, step.v)

    def layer(q, k, v):
        return plan.run(q * 1.0, k, v)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(step.q, step.k, step.v), eager)
    torch.library.opcheck(torch.ops.qkv.batch_plan_run.default,
                          (plan._handle, step.q, step.k, step.v, None, None))
