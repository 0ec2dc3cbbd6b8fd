"""BatchPlan.run with new tokens: rotary embedding + cache append + attention in one call
(qkv/_rotary.py, qkv/batch_plan.hpp's "Appending").

The rule: the same as rotating q and the new keys with transformers' own
apply_rotary_pos_emb (Llama's for NeoX order, Cohere's for interleaved pairs, Phi's split
for partial rotary) on tables from transformers' rotary embeddings, writing the new rows
into the caches by hand (cast, or quantized per row as qkv stores int8) and calling
today's BatchPlan.run — BITWISE: out, lse and every byte of the caches. Bitwise because
the library rounds the rotation as PyTorch's float32 eager does (each product, then the
sum; no fused multiply-add), writes rows with the same rounding, and then runs exactly the
step run() runs. Float32 inputs throughout (transformers' float32 path).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import CohereConfig, LlamaConfig
from transformers.models.cohere.modeling_cohere import CohereRotaryEmbedding
from transformers.models.cohere.modeling_cohere import apply_rotary_pos_emb as cohere_rope
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

import qkv

pytestmark = pytest.mark.skipif("cpu" not in qkv.available_backends(), reason="cpu backend not built")

QUERIES, LENGTHS = [1, 3, 20, 1], [9, 12, 40, 5]  # decode tokens and a 20-query chunk (split-K: test_rotary_append.cpp has a tiled one)
HEADS, KV_HEADS, D, DV, MAX_POSITION = 8, 2, 64, 32, 64


def tables(rotary_dim, interleaved):
    """transformers' cos/sin [MAX_POSITION, rotary_dim] for positions 0.. (float32)."""
    x = torch.zeros(1, MAX_POSITION, rotary_dim)
    positions = torch.arange(MAX_POSITION)[None]
    if interleaved:
        config = CohereConfig(hidden_size=rotary_dim * 8, num_attention_heads=8, max_position_embeddings=MAX_POSITION)
        cos, sin = CohereRotaryEmbedding(config=config)(x, positions)
    else:
        config = LlamaConfig(hidden_size=512, num_attention_heads=8, head_dim=rotary_dim,
                             max_position_embeddings=MAX_POSITION)
        cos, sin = LlamaRotaryEmbedding(config=config)(x, positions)
    assert cos.shape == (1, MAX_POSITION, rotary_dim)
    return cos[0], sin[0]


def rotate(q, k, cos, sin, interleaved):
    """transformers' rotation of q [n, Hq, d] and k [n, Hkv, d] by per-token cos/sin [n, r];
    the first r channels only (Phi's partial rotary split), the rest passed through."""
    r = cos.shape[-1]
    apply = cohere_rope if interleaved else apply_rotary_pos_emb
    q_rot, k_rot = apply(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=1)
    return torch.cat([q_rot, q[..., r:]], -1), torch.cat([k_rot, k[..., r:]], -1)


def quantize(x):
    """int8 per row as qkv stores it: scale max|x| / 127, levels rounded half to even."""
    scale = x.abs().amax(-1) / 127.0
    return torch.round(x / scale[..., None]).clamp(-127, 127).to(torch.int8), scale


class Step:
    """Caches with random old rows and zeroed new rows, new tokens, the plan."""

    def __init__(self, dtype, block_size, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.dtype, self.block_size = dtype, block_size
        self.cu = np.concatenate([[0], np.cumsum(QUERIES)]).astype(np.int64)
        total = int(self.cu[-1])
        self.q = torch.randn(total, HEADS, D, generator=g)
        self.k_new = torch.randn(total, KV_HEADS, D, generator=g)
        self.v_new = torch.randn(total, KV_HEADS, DV, generator=g)
        # Each new token's position: its key's row in its sequence.
        self.positions = torch.cat([torch.arange(n) + (length - n) for n, length in zip(QUERIES, LENGTHS)])
        capacity, batch = max(LENGTHS), len(QUERIES)
        self.table = None
        rows0, rows1 = batch, capacity
        if block_size:
            per = -(-capacity // block_size)
            order = torch.randperm(batch * per + 3, generator=g)
            self.table = order[: batch * per].view(batch, per).to(torch.int32)
            rows0, rows1 = order.numel(), block_size
        k = torch.randn(rows0, rows1, KV_HEADS, D, generator=g) * 2
        v = torch.randn(rows0, rows1, KV_HEADS, DV, generator=g) * 2
        self.k_scale = self.v_scale = None
        if dtype == torch.int8:
            (self.k, self.k_scale), (self.v, self.v_scale) = quantize(k), quantize(v)
        else:
            self.k, self.v = k.to(dtype), v.to(dtype)
        for b, (n, length) in enumerate(zip(QUERIES, LENGTHS)):  # the new rows: zero
            for j in range(length - n, length):
                self.k[self.at(b, j)] = 0
                self.v[self.at(b, j)] = 0

    def at(self, b, j):
        return (b, j) if self.table is None else (int(self.table[b, j // self.block_size]), j % self.block_size)

    def plan(self):
        return qkv.BatchPlan(self.cu, LENGTHS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D, v_dim=DV,
                             block_table=self.table, block_size=self.block_size)

    def clone(self):
        other = Step.__new__(Step)
        other.__dict__.update(self.__dict__)
        for name in ("k", "v", "k_scale", "v_scale"):
            if getattr(self, name) is not None:
                setattr(other, name, getattr(self, name).clone())
        return other

    def write_by_hand(self, k_rows):
        """k_rows (rotated) and v_new into each sequence's last rows, as the library writes."""
        for b, (n, length) in enumerate(zip(QUERIES, LENGTHS)):
            for t in range(n):
                row, at = int(self.cu[b]) + t, self.at(b, length - n + t)
                if self.dtype == torch.int8:
                    (self.k[at], self.k_scale[at]), (self.v[at], self.v_scale[at]) = (
                        quantize(k_rows[row]), quantize(self.v_new[row]))
                else:
                    self.k[at], self.v[at] = k_rows[row].to(self.dtype), self.v_new[row].to(self.dtype)


CASES = [(interleaved, rotary_dim, by_positions) for interleaved in (False, True) for rotary_dim in (64, 32)
         for by_positions in (False, True)] + [(False, None, False)]  # None: appending without rotary


@pytest.mark.parametrize("block_size", [None, 4], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8], ids=str)
def test_equals_transformers_rotation_then_append_then_run(dtype, block_size):
    for interleaved, rotary_dim, by_positions in CASES:
        step = Step(dtype, block_size, seed=3)
        hand = step.clone()
        keywords, q_rot, k_rot = {}, step.q, step.k_new
        if rotary_dim:
            cos_table, sin_table = tables(rotary_dim, interleaved)
            cos, sin = cos_table[step.positions], sin_table[step.positions]
            q_rot, k_rot = rotate(step.q, step.k_new, cos, sin, interleaved)
            keywords = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
            if by_positions:
                keywords.update(rotary_cos=cos_table, rotary_sin=sin_table, positions=step.positions)
        hand.write_by_hand(k_rot)
        plan = step.plan()
        expect, expect_lse = plan.run(q_rot, hand.k, hand.v, k_scale=hand.k_scale, v_scale=hand.v_scale,
                                      return_lse=True)
        assert torch.isfinite(expect).all()
        q_before = step.q.clone()
        out, lse = plan.run(step.q, step.k, step.v, k_scale=step.k_scale, v_scale=step.v_scale, return_lse=True,
                            k_new=step.k_new, v_new=step.v_new, **keywords)
        case = f"interleaved={interleaved} rotary_dim={rotary_dim} positions={by_positions}"
        assert torch.equal(step.q, q_before), case  # the caller's q is not rotated in place
        for name in ("k", "v", "k_scale", "v_scale"):
            if getattr(step, name) is not None:
                assert torch.equal(getattr(step, name), getattr(hand, name)), (case, name)
        assert torch.equal(out, expect), case
        assert torch.equal(lse, expect_lse), case


def test_rotation_really_happens_and_tables_of_other_dtypes_widen():
    """The rotated run differs from the unrotated one (the test can fail), and bf16 tables
    (widened exactly) give what their float32 copies give."""
    cos_table, sin_table = tables(64, False)
    runs = []
    for cos, sin in ((None, None), (cos_table, sin_table), (cos_table.bfloat16(), sin_table.bfloat16()),
                     (cos_table.bfloat16().float(), sin_table.bfloat16().float())):
        step = Step(torch.float32, None)
        keywords = {} if cos is None else dict(rotary_cos=cos, rotary_sin=sin, positions=step.positions)
        runs.append(step.plan().run(step.q, step.k, step.v, k_new=step.k_new, v_new=step.v_new, **keywords))
    assert (runs[0] - runs[1]).abs().max() > 0.1
    assert torch.equal(runs[2], runs[3])


def test_numpy_caches_are_written_in_place_and_read_only_ones_refused():
    step = Step(torch.float32, 4)
    k, v = step.k.numpy().copy(), step.v.numpy().copy()
    cos, sin = tables(32, True)
    out = step.plan().run(step.q.numpy(), k, v, k_new=step.k_new.numpy(), v_new=step.v_new.numpy(),
                          rotary_cos=cos.numpy(), rotary_sin=sin.numpy(), positions=step.positions.numpy(),
                          rotary_interleaved=True)
    torch_out = step.plan().run(step.q, step.k, step.v, k_new=step.k_new, v_new=step.v_new, rotary_cos=cos,
                                rotary_sin=sin, positions=step.positions, rotary_interleaved=True)
    assert isinstance(out, np.ndarray) and np.array_equal(out, torch_out.numpy())
    assert np.array_equal(k, step.k.numpy()) and np.array_equal(v, step.v.numpy())
    k.flags.writeable = False
    with pytest.raises((qkv.Error, TypeError, ValueError), match="k_cache"):
        step.plan().run(step.q.numpy(), k, v, k_new=step.k_new.numpy(), v_new=step.v_new.numpy())


def error_cases(step, cos, sin):
    """(keywords, what the error says): each a bad call of run(q, k, v, **keywords)."""
    new = dict(k_new=step.k_new, v_new=step.v_new)
    odd_cos, odd_sin = cos[:, :31].contiguous(), sin[:, :31].contiguous()
    return [
        (dict(k_new=step.k_new), "v_new: expected with k_new"),
        (dict(v_new=step.v_new), "k_new: expected with v_new"),
        (dict(rotary_cos=cos[step.positions], rotary_sin=sin[step.positions]), "rotary.cos: only with k_new"),
        (dict(new, rotary_cos=cos[step.positions]), "rotary.sin: expected with rotary.cos"),
        (dict(new, rotary_cos=odd_cos[step.positions], rotary_sin=odd_sin[step.positions]),
         r"rotary.cos.shape\[1\] \(rotary_dim\): expected an even number 2..64"),
        (dict(new, rotary_cos=cos, rotary_sin=sin), r"rotary.cos.shape\[0\] \(new tokens\): expected 25"),
        (dict(new, rotary_cos=cos, rotary_sin=sin, positions=step.positions + 40),
         r"rotary.positions\[\d+\]: expected a row of the tables, 0..63"),
        (dict(new, rotary_cos=cos, rotary_sin=sin, positions=step.positions[:3]),
         "rotary.positions: expected one position per new token"),
        (dict(new, rotary_cos=cos, rotary_sin=sin, positions=step.positions, rotary_dim=16),
         r"rotary.rotary_dim: expected rotary.cos.shape\[1\] \(64"),
        (dict(k_new=step.k_new[..., :16], v_new=step.v_new), r"k_new.shape\[2\] \(head_dim\): expected 64"),
    ]


@pytest.mark.parametrize("block_size", [None, 4], ids=["contiguous", "paged"])
def test_bad_calls_raise_naming_the_argument_and_write_nothing(block_size):
    step = Step(torch.float32, block_size)
    cos, sin = tables(64, False)
    k_before, v_before = step.k.clone(), step.v.clone()
    plan = step.plan()
    for keywords, message in error_cases(step, cos, sin):
        with pytest.raises(qkv.Error, match=message):
            plan.run(step.q, step.k, step.v, **keywords)
        assert torch.equal(step.k, k_before) and torch.equal(step.v, v_before), message
    with pytest.raises(TypeError, match="rotary_cos: expected dtype float32, bfloat16 or float16, got torch.float64"):
        plan.run(step.q, step.k, step.v, k_new=step.k_new, v_new=step.v_new, rotary_cos=cos.double(),
                 rotary_sin=sin, positions=step.positions)
    with pytest.raises(qkv.Error, match="v_cache: None"):
        plan.run(step.q, step.k, None, k_new=step.k_new, v_new=step.v_new)
    cache = qkv.KVCache(4, 40, KV_HEADS, D, v_dim=DV)
    with pytest.raises(qkv.Error, match="k_new: not with a qkv.KVCache"):
        plan.run(step.q, cache, None, k_new=step.k_new, v_new=step.v_new)
    assert torch.equal(step.k, k_before) and torch.equal(step.v, v_before)


def test_a_cache_too_short_for_the_new_tokens():
    step = Step(torch.float32, None)
    with pytest.raises(qkv.Error, match=r"k_cache.shape\[1\] \(capacity\): expected at least cache_lengths\[2\] = 40"):
        step.plan().run(step.q, step.k[:, :30], step.v[:, :30], k_new=step.k_new, v_new=step.v_new)


def test_operator_passes_opcheck_and_compiles_fullgraph_with_the_cache_writes():
    """plan.run(..., k_new=...) traced is torch.ops.qkv.batch_plan_run_appending, which
    declares the caches mutated: opcheck agrees with its schema and fake, and a fullgraph
    compile gives eager's output and eager's caches."""
    import qkv.torch  # noqa: F401  (registers the operators)

    cos, sin = tables(32, False)
    eager_step, compiled_step = Step(torch.bfloat16, 4), Step(torch.bfloat16, 4)
    plan = eager_step.plan()
    eager = plan.run(eager_step.q, eager_step.k, eager_step.v, k_new=eager_step.k_new, v_new=eager_step.v_new,
                     rotary_cos=cos, rotary_sin=sin, positions=eager_step.positions)

    def layer(q, k, v, k_new, v_new, positions):
        return plan.run(q * 1.0, k, v, k_new=k_new, v_new=v_new, rotary_cos=cos, rotary_sin=sin, positions=positions)

    s = compiled_step
    out = torch.compile(layer, fullgraph=True, backend="aot_eager")(s.q, s.k, s.v, s.k_new, s.v_new, s.positions)
    assert torch.equal(out, eager)
    assert torch.equal(s.k, eager_step.k) and torch.equal(s.v, eager_step.v)
    int8 = Step(torch.int8, None)
    for step in (compiled_step, int8):
        step_plan = step.plan()  # alive while its handle is used
        torch.library.opcheck(torch.ops.qkv.batch_plan_run_appending.default,
                              (step_plan._handle, step.q, step.k, step.v, step.k_scale, step.v_scale, step.k_new,
                               step.v_new, cos, sin, step.positions, False, None))


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_kv_cache_append_and_attend_rotate_like_transformers(dtype):
    """KVCache.append(k, v, rotary_cos=...) stores what appending transformers-rotated keys
    stores, and KVCache.attend(q, k_new=, v_new=, rotary...) gives what that append plus
    attend(rotated q) gives — bitwise; the caller's q and k are not modified."""
    g = torch.Generator().manual_seed(5)
    batch, tokens = 2, 3
    q = torch.randn(batch, HEADS, tokens, D, generator=g)
    k = torch.randn(batch, KV_HEADS, tokens, D, generator=g)
    v = torch.randn(batch, KV_HEADS, tokens, DV, generator=g)
    cos_table, sin_table = tables(32, True)
    positions = torch.arange(tokens)[None].expand(batch, tokens) + 4  # [B, T], after 4 cached tokens
    cos, sin = cos_table[positions], sin_table[positions]  # transformers' [B, T, r]
    flat_q = q.transpose(1, 2).flatten(0, 1)
    flat_k = k.transpose(1, 2).flatten(0, 1)
    q_rot, k_rot = rotate(flat_q, flat_k, cos.flatten(0, 1), sin.flatten(0, 1), True)
    q_rot = q_rot.view(batch, tokens, HEADS, D).transpose(1, 2)
    k_rot = k_rot.view(batch, tokens, KV_HEADS, D).transpose(1, 2)
    old = torch.randn(batch, KV_HEADS, 4, D, generator=g), torch.randn(batch, KV_HEADS, 4, DV, generator=g)
    caches = [qkv.KVCache(batch, 16, KV_HEADS, D, v_dim=DV, dtype=dtype, paged=True, block_size=4) for _ in range(3)]
    for cache in caches:
        cache.append(*old)
    q_before, k_before = q.clone(), k.clone()
    caches[0].append(k, v, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=True)
    caches[1].append(k_rot, v)
    for b in range(batch):
        for x, y in zip(caches[0].stored(b), caches[1].stored(b)):
            assert np.array_equal(x, y)
    expect = caches[1].attend(q_rot)
    out = caches[2].attend(q, k_new=k, v_new=v, rotary_cos=cos_table, rotary_sin=sin_table, positions=positions,
                           rotary_interleaved=True)
    assert torch.equal(out, expect)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)
    # Bad calls change nothing.
    lengths = caches[2].lengths
    with pytest.raises(qkv.Error, match="v_new: expected with k_new"):
        caches[2].attend(q, k_new=k)
    with pytest.raises(qkv.Error, match="q: expected the batch, tokens and head_dim of k_new"):
        caches[2].attend(q[:, :, :2], k_new=k, v_new=v)
    with pytest.raises(qkv.Error, match=r"rotary.cos.shape\[1\] \(rotary_dim\): expected an even number"):
        caches[2].append(k, v, rotary_cos=cos[..., :31], rotary_sin=sin[..., :31])
    with pytest.raises(TypeError, match="unexpected keyword argument 'rotary_cosine'"):
        caches[2].append(k, v, rotary_cosine=cos)
    assert caches[2].lengths == lengths


def test_float8_pools_with_new_tokens_are_refused_by_name():
    """Writing new tokens into caller-owned float8 pools is C++ only so far: refused, by name,
    nothing written."""
    plan = qkv.BatchPlan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([4]), num_heads=2, num_kv_heads=1,
                         head_dim=8, dtype=torch.float8_e4m3fn)
    k = torch.zeros(1, 8, 1, 8).to(torch.float8_e4m3fn)
    v = k.clone()
    new = torch.randn(1, 1, 8)
    with pytest.raises(qkv.Error, match=r"qkv.BatchPlan.run: k_new: float8 caches are not yet written from Python"):
        plan.run(torch.randn(1, 2, 8), k, v, k_scale=1.0, v_scale=1.0, k_new=new, v_new=new)
    assert k.view(torch.uint8).eq(0).all() and v.view(torch.uint8).eq(0).all()
