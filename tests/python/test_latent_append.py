"""BatchPlan.run with new tokens over latent attention's caches (qkv/batch_plan.hpp's "Keys in
two parts" and "FlashMLA's FP8 records"): the step's c_kv and k_pe rows rotated, written and
attended in one call, as an engine does with FlashInfer's append_paged_mla_kv_cache followed
by its MLA run.

The rule, BITWISE: rotating q_pe and k_pe with transformers' own functions (Llama's for NeoX
order, Cohere's for pairs), writing the rows into the pools by hand (cast to the pools'
dtype, or packed with qkv.pack_mla_records) and calling BatchPlan.run over them — out, lse
and every byte of the pools. Plus: the float32 step against an fp64 formula over what was
written (TOL, test_mla_decode's float32 bound); DeepSeek-V3's own rotation
(apply_rotary_pos_emb_interleave) is what ``rotary_interleaved=True`` with
``repeat_interleave`` tables gives, element for element; the operators under opcheck and a
fullgraph torch.compile; bad calls refused by name with nothing written.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import CohereConfig, DeepseekV3Config, LlamaConfig
from transformers.models.cohere.modeling_cohere import CohereRotaryEmbedding
from transformers.models.cohere.modeling_cohere import apply_rotary_pos_emb as cohere_rope
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3RotaryEmbedding,
                                                                  apply_rotary_pos_emb_interleave)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

import qkv

pytestmark = pytest.mark.skipif("cpu" not in qkv.available_backends(), reason="cpu backend not built")

QUERIES, LENGTHS = [1, 3, 20, 1], [9, 12, 40, 5]  # decode tokens, a speculative step, a 20-query chunk
HEADS, DC, DR, BLOCK, MAX_POSITION, SCALE = 8, 32, 16, 4, 64, 0.2
RECORD_DC = 128  # records: a scale per 128 latent values
TOL = 2e-5  # test_mla_decode's float32 bound at 8 heads


def tables(kind):
    """Per-position cos/sin [MAX_POSITION, DR] from transformers' embeddings: "neox" (Llama),
    "pairs" (Cohere's repeat_interleave), or None."""
    if kind is None:
        return None, None
    x, positions = torch.zeros(1, MAX_POSITION, DR), torch.arange(MAX_POSITION)[None]
    if kind == "pairs":
        config = CohereConfig(hidden_size=DR * 8, num_attention_heads=8, max_position_embeddings=MAX_POSITION)
        cos, sin = CohereRotaryEmbedding(config=config)(x, positions)
    else:
        config = LlamaConfig(hidden_size=512, num_attention_heads=8, head_dim=DR, max_position_embeddings=MAX_POSITION)
        cos, sin = LlamaRotaryEmbedding(config=config)(x, positions)
    return cos[0], sin[0]


def rotate(x, cos, sin, kind):
    """transformers' rotation of x [n, heads, DR] by per-token cos/sin [n, DR]."""
    if kind is None:
        return x
    apply = cohere_rope if kind == "pairs" else apply_rotary_pos_emb
    return apply(x, x, cos, sin, unsqueeze_dim=1)[0]


class Step:
    """The step's sequences, queries and new rows, and pools whose new tokens' slots hold NaN."""

    def __init__(self, dtype, block_size, dc=DC, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.cu = np.concatenate([[0], np.cumsum(QUERIES)]).astype(np.int64)
        total, self.dc, self.block_size = int(self.cu[-1]), dc, block_size
        self.q = torch.randn(total, HEADS, dc + DR, generator=g)
        self.c_kv = torch.randn(total, dc, generator=g)
        self.k_pe = torch.randn(total, DR, generator=g)
        self.positions = torch.cat([torch.arange(n) + (length - n) for n, length in zip(QUERIES, LENGTHS)])
        capacity, batch = max(LENGTHS), len(QUERIES)
        self.table, shape = None, (batch, capacity)
        if block_size:
            per = -(-capacity // block_size)
            order = torch.randperm(batch * per + 3, generator=g)
            self.table = order[: batch * per].view(batch, per).to(torch.int32)
            shape = (order.numel(), block_size)
        self.ckv_pool = torch.randn(*shape, dc, generator=g).to(dtype)
        self.kpe_pool = torch.randn(*shape, DR, generator=g).to(dtype)
        for slot in self.slots():
            self.ckv_pool[slot] = float("nan")
            self.kpe_pool[slot] = float("nan")

    def slots(self):
        """Each new token's (block, row) or (sequence, key), in packed order."""
        out = []
        for b, (n, length) in enumerate(zip(QUERIES, LENGTHS)):
            for j in range(length - n, length):
                out.append((b, j) if self.table is None else (int(self.table[b, j // self.block_size]),
                                                              j % self.block_size))
        return out

    def plan(self, v_dim):
        return qkv.BatchPlan(self.cu, LENGTHS, num_heads=HEADS, num_kv_heads=1, head_dim=self.dc + DR, v_dim=v_dim,
                             block_table=self.table, block_size=self.block_size or None, scale=SCALE)

    def rotated(self, kind):
        """(q with q_pe rotated, k_pe rotated) by transformers' functions at each token's position."""
        cos, sin = tables(kind)
        if kind is None:
            return self.q, self.k_pe
        c, s = cos[self.positions], sin[self.positions]
        q_pe = rotate(self.q[..., self.dc:], c, s, kind)
        return torch.cat([self.q[..., :self.dc], q_pe], -1), rotate(self.k_pe[:, None], c, s, kind)[:, 0]

    def rotary(self, kind):
        cos, sin = tables(kind)
        return dict(rotary_cos=cos, rotary_sin=sin, positions=self.positions if cos is not None else None,
                    rotary_interleaved=kind == "pairs")


def formula(step, q, ckv_pool, kpe_pool):
    """fp64 absorbed MLA over the pools' rows: softmax(SCALE·q·[c_kv|k_pe]ᵀ)·c_kv, bottom-right causal."""
    out = np.zeros((q.shape[0], HEADS, step.dc))
    for b, (n, length) in enumerate(zip(QUERIES, LENGTHS)):
        rows = [((b, j) if step.table is None else (int(step.table[b, j // step.block_size]), j % step.block_size))
                for j in range(length)]
        keys = np.stack([np.concatenate([ckv_pool[r].double().numpy(), kpe_pool[r].double().numpy()]) for r in rows])
        for i in range(n):
            row = int(step.cu[b]) + i
            s = SCALE * (q[row].double().numpy() @ keys[: length - n + i + 1].T)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[row] = (p / p.sum(axis=1, keepdims=True)) @ keys[: length - n + i + 1, : step.dc]
    return out


@pytest.mark.parametrize("kind", [None, "neox", "pairs"])
@pytest.mark.parametrize("latent", [True, False], ids=["latent_values", "value_pool"])
@pytest.mark.parametrize("block_size", [None, BLOCK], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_two_pools_equal_rotate_write_run(dtype, block_size, latent, kind):
    step, hand = Step(dtype, block_size), Step(dtype, block_size)
    v_dim = DC if latent else 24
    v_new = torch.randn(step.q.shape[0], v_dim)
    v_pool = None if latent else torch.randn(*step.ckv_pool.shape[:2], v_dim).to(dtype)
    hand_v = None if latent else v_pool.clone()
    q_rot, k_pe_rot = step.rotated(kind)
    for n, slot in enumerate(step.slots()):
        hand.ckv_pool[slot] = step.c_kv[n].to(dtype)
        hand.kpe_pool[slot] = k_pe_rot[n].to(dtype)
        if not latent:
            hand_v[slot] = v_new[n].to(dtype)
    plan = step.plan(v_dim)
    want, want_lse = plan.run(q_rot, hand.ckv_pool, hand_v, k_rope_cache=hand.kpe_pool, return_lse=True)
    assert torch.isfinite(want).all()  # every new slot was written by hand
    q_before = step.q.clone()
    out, lse = plan.run(step.q, step.ckv_pool, v_pool, k_rope_cache=step.kpe_pool, k_new=step.c_kv,
                        k_rope_new=step.k_pe, v_new=None if latent else v_new, return_lse=True, **step.rotary(kind))
    assert torch.equal(step.q, q_before), "the caller's q was written"
    assert torch.equal(step.ckv_pool, hand.ckv_pool) and torch.equal(step.kpe_pool, hand.kpe_pool)
    if not latent:
        assert torch.equal(v_pool, hand_v)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    if dtype == torch.float32 and latent:
        np.testing.assert_allclose(out.double().numpy(), formula(step, q_rot, step.ckv_pool, step.kpe_pool),
                                   atol=TOL, rtol=0)
    if kind is not None:
        assert (q_rot - step.q).abs().max() > 0.1  # the rotation did something


def test_deepseek_rotation_is_pairs_with_repeated_tables():
    """DeepSeek-V3's apply_rotary_pos_emb_interleave (its rope_interleave) rotates pairs (2i,
    2i+1) by angle i and lays the results out de-interleaved; qkv's pairs with tables
    repeat_interleave(freqs, 2) (vLLM's is_neox_style=False) store the same values in pair
    order. So the cached k_pe is DeepSeek's permuted, element for element bitwise, and the
    attention (q_pe permuted alike) is the same within float32 summation order."""
    config = DeepseekV3Config(hidden_size=64, num_attention_heads=HEADS, qk_rope_head_dim=DR, kv_lora_rank=DC,
                              qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=MAX_POSITION,
                              rope_interleave=True)
    cos, sin = DeepseekV3RotaryEmbedding(config=config)(torch.zeros(1, MAX_POSITION, DR),
                                                       torch.arange(MAX_POSITION)[None])
    cos, sin = cos[0], sin[0]
    pairs_cos = cos[:, : DR // 2].repeat_interleave(2, -1)
    pairs_sin = sin[:, : DR // 2].repeat_interleave(2, -1)
    step = Step(torch.float32, BLOCK)
    c, s = cos[step.positions], sin[step.positions]
    q_pe, k_pe = apply_rotary_pos_emb_interleave(step.q[..., DC:], step.k_pe[:, None], c, s, unsqueeze_dim=1)
    order = torch.cat([torch.arange(0, DR, 2), torch.arange(1, DR, 2)])  # DeepSeek's layout of pair order
    plan = step.plan(DC)
    out = plan.run(step.q, step.ckv_pool, None, k_rope_cache=step.kpe_pool, k_new=step.c_kv, k_rope_new=step.k_pe,
                   rotary_cos=pairs_cos, rotary_sin=pairs_sin, positions=step.positions, rotary_interleaved=True)
    written = torch.stack([step.kpe_pool[slot] for slot in step.slots()])
    assert torch.equal(written[:, order], k_pe[:, 0])
    q_deepseek = torch.cat([step.q[..., :DC], q_pe], -1)
    kpe_deepseek = step.kpe_pool[..., order]  # every row permuted alike: the same dot products
    np.testing.assert_allclose(out.double().numpy(), formula(step, q_deepseek, step.ckv_pool, kpe_deepseek),
                               atol=TOL, rtol=0)


@pytest.mark.parametrize("power_of_two", [True, False])
@pytest.mark.parametrize("topk", [0, 6])
@pytest.mark.parametrize("kind", [None, "pairs"])
def test_records_equal_rotate_pack_write_run(kind, topk, power_of_two):
    step = Step(torch.float32, 16, dc=RECORD_DC)
    g = torch.Generator().manual_seed(5)
    shape = step.ckv_pool.shape[:2]
    records = qkv.pack_mla_records(torch.randn(*shape, RECORD_DC, generator=g), torch.randn(*shape, DR, generator=g),
                                   power_of_two_scales=power_of_two)
    for slot in step.slots():
        records[slot] = 0xFF  # NaN values and scales: a slot not written shows
    hand = records.clone()
    q_rot, k_pe_rot = step.rotated(kind)
    packed = qkv.pack_mla_records(step.c_kv, k_pe_rot, power_of_two_scales=power_of_two)
    for n, slot in enumerate(step.slots()):
        hand[slot] = packed[n]
    indices = None
    if topk:
        rng = np.random.default_rng(3)
        indices = torch.from_numpy(np.concatenate([rng.integers(-1, LENGTHS[b], size=(QUERIES[b], topk))
                                                   for b in range(len(QUERIES))]))
    plan = step.plan(RECORD_DC)
    want, want_lse = plan.run(q_rot, hand, None, cache_format="fp8_ds_mla", return_lse=True, indices=indices)
    assert torch.isfinite(want).all()
    out, lse = plan.run(step.q, records, None, cache_format="fp8_ds_mla", return_lse=True, indices=indices,
                        k_new=step.c_kv, k_rope_new=step.k_pe, power_of_two_scales=power_of_two, **step.rotary(kind))
    assert torch.equal(records, hand)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_operators_pass_opcheck_and_compile_fullgraph_with_the_pool_writes():
    """Traced, the two-pool append is torch.ops.qkv.batch_plan_run_appending (k_rope_cache
    declared mutated; v_cache None: the latent values) and the records append
    torch.ops.qkv.batch_plan_run_records_appending (records mutated): opcheck agrees with
    their schemas and fakes, and a fullgraph compile gives eager's outputs and pools."""
    import qkv.torch  # noqa: F401  (registers the operators)

    cos, sin = tables("pairs")
    eager, compiled = Step(torch.bfloat16, BLOCK), Step(torch.bfloat16, BLOCK)
    plan = eager.plan(DC)
    want = plan.run(eager.q, eager.ckv_pool, None, k_rope_cache=eager.kpe_pool, k_new=eager.c_kv,
                    k_rope_new=eager.k_pe, rotary_cos=cos, rotary_sin=sin, positions=eager.positions,
                    rotary_interleaved=True)

    def layer(q, ckv, kpe, c_kv, k_pe, positions):
        return plan.run(q * 1.0, ckv, None, k_rope_cache=kpe, k_new=c_kv, k_rope_new=k_pe, rotary_cos=cos,
                        rotary_sin=sin, positions=positions, rotary_interleaved=True)

    s = compiled
    out = torch.compile(layer, fullgraph=True, backend="aot_eager")(s.q, s.ckv_pool, s.kpe_pool, s.c_kv, s.k_pe,
                                                                   s.positions)
    assert torch.equal(out, want)
    assert torch.equal(s.ckv_pool, eager.ckv_pool) and torch.equal(s.kpe_pool, eager.kpe_pool)
    fresh = Step(torch.bfloat16, BLOCK)
    torch.library.opcheck(torch.ops.qkv.batch_plan_run_appending.default,
                          (plan._handle, fresh.q, fresh.ckv_pool[:, :, None], None, None, None, fresh.c_kv[:, None],
                           None, cos, sin, fresh.positions, True, None, None, fresh.k_pe[:, None],
                           fresh.kpe_pool[:, :, None], DC))

    rec = Step(torch.float32, 16, dc=RECORD_DC)
    shape = rec.ckv_pool.shape[:2]
    records = qkv.pack_mla_records(torch.randn(*shape, RECORD_DC), torch.randn(*shape, DR))
    eager_records = records.clone()
    rec_plan = rec.plan(RECORD_DC)
    want = rec_plan.run(rec.q, eager_records, None, cache_format="fp8_ds_mla", k_new=rec.c_kv, k_rope_new=rec.k_pe)

    def records_layer(q, pool, c_kv, k_pe):
        return rec_plan.run(q * 1.0, pool, None, cache_format="fp8_ds_mla", k_new=c_kv, k_rope_new=k_pe)

    out = torch.compile(records_layer, fullgraph=True, backend="aot_eager")(rec.q, records, rec.c_kv, rec.k_pe)
    assert torch.equal(out, want) and torch.equal(records, eager_records)
    torch.library.opcheck(torch.ops.qkv.batch_plan_run_records_appending.default,
                          (rec_plan._handle, rec.q, records.clone(), rec.c_kv, rec.k_pe, None, None, None, False,
                           None, True, None))


def test_bad_calls_are_refused_by_name_and_write_nothing():
    step = Step(torch.float32, BLOCK)
    plan = step.plan(DC)
    before = (step.ckv_pool.clone(), step.kpe_pool.clone())
    cos, sin = tables("neox")
    calls = [
        (dict(v_new=torch.randn(step.q.shape[0], DC)), "v_new: not with v_cache the view of k_cache"),
        (dict(k_rope_new=None), "k_rope_new: expected with k_rope_cache"),
        (dict(k_rope_new=torch.randn(step.q.shape[0], DR + 2)), "k_rope_new.shape[2] (dr): expected 16"),
        (dict(rotary_cos=torch.cat([cos, cos], -1), rotary_sin=torch.cat([sin, sin], -1), positions=step.positions),
         "expected an even number 2..16 (dr, the keys' rotary part"),
        (dict(power_of_two_scales=False), "power_of_two_scales: only with cache_format='fp8_ds_mla'"),
    ]
    for extra, needle in calls:
        arguments = dict(k_rope_cache=step.kpe_pool, k_new=step.c_kv, k_rope_new=step.k_pe) | extra
        with pytest.raises(qkv.Error, match=None) as error:
            plan.run(step.q, step.ckv_pool, None, **arguments)
        assert needle in str(error.value), (needle, str(error.value))
        assert all(np.array_equal(a.numpy(), b.numpy(), equal_nan=True)  # the new slots' NaN as they were
                   for a, b in zip((step.ckv_pool, step.kpe_pool), before))
    with pytest.raises(qkv.Error, match="k_rope_new: only with k_rope_cache"):
        plan.run(step.q, step.ckv_pool[:, :, None], step.ckv_pool[:, :, None], k_new=step.c_kv[:, None],
                 v_new=step.c_kv[:, None], k_rope_new=step.k_pe)

    rec = Step(torch.float32, 16, dc=RECORD_DC)
    records = qkv.pack_mla_records(torch.randn(*rec.ckv_pool.shape[:2], RECORD_DC),
                                   torch.randn(*rec.ckv_pool.shape[:2], DR))
    kept = records.clone()
    rec_plan = rec.plan(RECORD_DC)
    bad_c_kv = rec.c_kv.clone()
    bad_c_kv[3, 5] = float("inf")
    record_calls = [
        (dict(k_new=rec.c_kv), "k_rope_new: expected with k_new"),
        (dict(k_new=rec.c_kv[:, None].expand(-1, 2, -1), k_rope_new=rec.k_pe), "records' one latent head"),
        (dict(k_new=bad_c_kv, k_rope_new=rec.k_pe), "k_new[3, 5]: expected a finite value"),
        (dict(k_new=rec.c_kv[:, :64], k_rope_new=rec.k_pe), "k_new.shape[1] (dc): expected 128"),
        (dict(k_new=rec.c_kv, k_rope_new=rec.k_pe, v_new=rec.c_kv), "v_new: expected None with cache_format"),
        (dict(power_of_two_scales=False), "power_of_two_scales: only with k_new"),
    ]
    for extra, needle in record_calls:
        with pytest.raises(qkv.Error) as error:
            rec_plan.run(rec.q, records, None, cache_format="fp8_ds_mla", **extra)
        assert needle in str(error.value), (needle, str(error.value))
        assert torch.equal(records, kept)
