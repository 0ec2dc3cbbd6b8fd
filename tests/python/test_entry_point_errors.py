"""Every Python entry point × a bad rank, a bad dtype, an integer past int64: the error is
qkv.Error (TypeError for a wrong dtype or array type) and its message names the function
and the argument, so that `except qkv.Error` catches every bad value and the message says
where it went (issue 45 item 4: the bindings' own checks used to raise a plain ValueError
naming no function, and nanobind's "incompatible function arguments" for a huge int).

The table's entry points are enumerated from qkv.__all__ (and the methods of KVCache and
BatchPlan); a new entry point without rows fails test_every_entry_point_has_rows."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

import qkv

f32, HUGE = np.float32, 2**64

Q = np.zeros((1, 2, 4, 8), f32)
OUT, LSE = qkv.attention(Q, Q, Q, return_lse=True)
PACKED = np.zeros((6, 2, 8), f32)
CU = np.array([0, 6], np.int32)
VOUT, VLSE = qkv.varlen_attention(PACKED, PACKED, PACKED, CU, CU, return_lse=True)
DQ = np.zeros((2, 2, 1, 8), f32)  # decode: 2 sequences, 1 query each
KC = np.zeros((2, 1, 8, 8), f32)
POOL = np.zeros((4, 4, 1, 8), f32)
TABLE_IDS = np.array([[0], [1]], np.int32)
PLAN_CU, PLAN_LENGTHS = np.array([0, 1, 2]), np.array([3, 4])
PLAN_Q = np.zeros((2, 2, 8), f32)
PLAN_CACHE = np.zeros((2, 8, 1, 8), f32)
TQ = torch.zeros(1, 2, 8, 4)
QN, QP = np.zeros((2, 1, 2, 8), f32), np.zeros((2, 1, 2, 4), f32)  # mla_decode: [B, Nq, H, dc | dr]
CKV, KPE = np.zeros((2, 8, 8), f32), np.zeros((2, 8, 4), f32)
RQN, RECORDS = np.zeros((2, 1, 2, 128), f32), np.zeros((2, 8, 128 + 4 + 8), np.uint8)  # FlashMLA's FP8 records
IDX = np.zeros((1, 4, 2), np.int32)  # sparse_attention's key lists [B, Nq, topk]
SOUT, SLSE = qkv.sparse_attention(Q, Q, Q, IDX, return_lse=True)


def _cache():
    cache = qkv.KVCache(2, 8, 1, 8)
    cache.append(np.ones((2, 1, 2, 8), f32), np.ones((2, 1, 2, 8), f32))
    return cache


def _records_plan():  # over RECORDS: dc 128, dr 4
    return _plan(head_dim=132, v_dim=128)


RPLAN_Q = np.zeros((2, 2, 132), f32)


def _plan(**changes):
    return qkv.BatchPlan(*changes.pop("args", (PLAN_CU, PLAN_LENGTHS)),
                         **dict(dict(num_heads=2, num_kv_heads=1, head_dim=8), **changes))


class _NoWeakref:  # a mask_mod that cannot be weakly referenced (qkv holds mask_mods weakly)
    __slots__ = ()

    def __call__(self, b, h, q_idx, kv_idx):
        return q_idx >= kv_idx


def _flex_no_weakref():
    block_mask = create_block_mask(_NoWeakref(), None, None, 8, 8, device="cpu", BLOCK_SIZE=4)
    qkv.flex_attention(TQ, TQ, TQ, block_mask=block_mask)


Error, Type = qkv.Error, TypeError

# (entry point, what is wrong, call, exception, argument the message names)
CASES = [
    ("attention", "rank", lambda: qkv.attention(Q[0], Q, Q), Error, "q"),
    ("attention", "dtype", lambda: qkv.attention(Q.astype(np.int32), Q, Q), Type, "q"),
    ("attention", "huge int", lambda: qkv.attention(Q, Q, Q, threads=HUGE), Error, "threads"),
    ("attention_backward", "rank", lambda: qkv.attention_backward(Q, Q, Q, OUT, LSE[..., None], OUT), Error, "lse"),
    ("attention_backward", "dtype", lambda: qkv.attention_backward(Q, Q, Q, OUT, LSE, OUT.astype(np.int32)), Type,
     "dout"),
    ("attention_backward", "huge int", lambda: qkv.attention_backward(Q, Q, Q, OUT, LSE, OUT, threads=HUGE), Error,
     "threads"),
    ("attention_weights", "rank", lambda: qkv.attention_weights(Q, Q[0], Q), Error, "k"),
    ("attention_weights", "dtype", lambda: qkv.attention_weights(Q, Q, Q.astype(np.int64)), Type, "v"),
    ("attention_weights", "huge int", lambda: qkv.attention_weights(Q, Q, Q, threads=HUGE), Error, "threads"),
    ("varlen_attention", "rank", lambda: qkv.varlen_attention(PACKED, PACKED, PACKED, CU[None], CU), Error,
     "cu_seqlens_q"),
    ("varlen_attention", "dtype", lambda: qkv.varlen_attention(PACKED, PACKED, PACKED, CU.astype(np.int8), CU), Type,
     "cu_seqlens_q"),
    ("varlen_attention", "huge int",
     lambda: qkv.varlen_attention(PACKED, PACKED, PACKED, CU, CU, max_seqlen_q=HUGE), Error, "max_seqlen_q"),
    ("varlen_attention_backward", "rank",
     lambda: qkv.varlen_attention_backward(PACKED, PACKED, PACKED, VOUT, VLSE, VOUT, CU, CU[None]), Error,
     "cu_seqlens_k"),
    ("varlen_attention_backward", "dtype",
     lambda: qkv.varlen_attention_backward(PACKED, PACKED, PACKED, VOUT, VLSE, VOUT.astype(np.int32), CU, CU), Type,
     "dout"),
    ("varlen_attention_backward", "huge int",
     lambda: qkv.varlen_attention_backward(PACKED, PACKED, PACKED, VOUT, VLSE, VOUT, CU, CU, max_seqlen_k=HUGE),
     Error, "max_seqlen_k"),
    ("decode", "rank", lambda: qkv.decode(DQ, POOL[0], POOL[0], [3, 3], block_table=TABLE_IDS), Error, "k_cache"),
    ("decode", "rank", lambda: qkv.decode(DQ, KC, KC, [3, 3], indices=np.zeros((2,), np.int32)), Error, "indices"),
    ("decode", "dtype", lambda: qkv.decode(DQ, KC, KC, [3, 3], indices=np.zeros((2, 1, 1), f32)), Type, "indices"),
    ("decode", "dtype", lambda: qkv.decode(DQ, KC.astype(np.int32), KC.astype(np.int32), [3, 3]), Type, "k_cache"),
    ("decode", "huge int", lambda: qkv.decode(DQ, KC, KC, [3, 3], threads=HUGE), Error, "threads"),
    ("decode", "huge int", lambda: qkv.decode(DQ, KC, KC, [3, HUGE]), Error, "cache_lengths"),
    ("KVCache", "dtype", lambda: qkv.KVCache(2, 8, 1, 8, dtype="float64"), Error, "dtype"),
    ("KVCache", "huge int", lambda: qkv.KVCache(2, HUGE, 1, 8), Error, "capacity"),
    ("KVCache.append", "rank", lambda: _cache().append(Q[0], Q[0]), Error, "k"),
    ("KVCache.append", "dtype", lambda: _cache().append(KC.astype(np.complex64), KC), Type, "k"),
    ("KVCache.append", "huge int", lambda: _cache().append(KC[:1, :, :1], KC[:1, :, :1], seq=HUGE), Error, "seq"),
    ("KVCache.append_varlen", "rank", lambda: _cache().append_varlen(KC, KC, [0, 1, 1]), Error, "k"),
    ("KVCache.append_varlen", "huge int", lambda: _cache().append_varlen(KC[0], KC[0], [0, 1, HUGE]), Error,
     "cu_seqlens"),
    ("KVCache.attend", "rank", lambda: _cache().attend(DQ[0]), Error, "q"),
    ("KVCache.attend", "rank", lambda: _cache().attend(DQ, indices=np.zeros((2, 1), np.int32)), Error, "indices"),
    ("KVCache.attend", "dtype", lambda: _cache().attend(DQ, indices=np.zeros((2, 1, 1), f32)), Type, "indices"),
    ("KVCache.attend", "dtype", lambda: _cache().attend(DQ.astype(np.complex64)), Type, "q"),
    ("KVCache.attend", "huge int", lambda: _cache().attend(DQ, threads=HUGE), Error, "threads"),
    ("KVCache.index_topk", "rank", lambda: _cache().index_topk(DQ[0], DQ[..., 0, 0], 2), Error, "q"),
    ("KVCache.index_topk", "dtype", lambda: _cache().index_topk(DQ.astype(np.complex64), DQ[..., 0], 2), Type, "q"),
    ("KVCache.index_topk", "huge int", lambda: _cache().index_topk(DQ, DQ[..., 0], HUGE), Error, "topk"),
    ("KVCache.index_topk", "huge int", lambda: _cache().index_topk(DQ, DQ[..., 0], 2, threads=HUGE), Error, "threads"),
    ("KVCache.reset", "huge int", lambda: _cache().reset(2**63), Error, "seq"),
    ("KVCache.stored", "huge int", lambda: _cache().stored(2**63), Error, "seq"),
    ("BatchPlan", "rank", lambda: _plan(args=(np.array([[0, 1]]), np.array([4]))), Error, "cu_seqlens_q"),
    ("BatchPlan", "dtype", lambda: _plan(args=(PLAN_CU.astype(np.int8), PLAN_LENGTHS)), Type, "cu_seqlens_q"),
    ("BatchPlan", "huge int", lambda: _plan(num_heads=HUGE), Error, "num_heads"),
    ("BatchPlan", "huge int", lambda: _plan(block_table=TABLE_IDS, block_size=HUGE), Error, "block_size"),
    ("BatchPlan.run", "rank", lambda: _plan().run(PLAN_Q, PLAN_CACHE[0], PLAN_CACHE[0]), Error, "k_cache"),
    ("BatchPlan.run", "rank", lambda: _plan().run(PLAN_Q, PLAN_CACHE, PLAN_CACHE, indices=np.zeros((2, 1, 1), np.int32)),
     Error, "indices"),
    ("BatchPlan.run", "dtype", lambda: _plan().run(PLAN_Q, PLAN_CACHE, PLAN_CACHE, indices=np.zeros((2, 1), f32)),
     Type, "indices"),
    ("BatchPlan.run", "rank", lambda: _plan().run(PLAN_Q[0], PLAN_CACHE, PLAN_CACHE), Error, "q"),
    ("BatchPlan.run", "rank", lambda: _records_plan().run(RPLAN_Q, RECORDS[0], None, cache_format="fp8_ds_mla"),
     Error, "records"),
    ("BatchPlan.run", "dtype", lambda: _records_plan().run(RPLAN_Q, RECORDS.astype(np.int16), None,
                                                          cache_format="fp8_ds_mla"), Type, "records"),
    ("BatchPlan.run", "rank", lambda: _records_plan().run(RPLAN_Q[0], RECORDS, None, cache_format="fp8_ds_mla"),
     Error, "q"),
    ("BatchPlan.run", "rank", lambda: _plan(head_dim=12, v_dim=8).run(
        np.zeros((2, 2, 12), f32), PLAN_CACHE, None, k_rope_cache=PLAN_CACHE[..., 0]), Error, "k_rope_cache"),
    ("BatchPlan.run", "dtype", lambda: _plan(head_dim=12, v_dim=8).run(
        np.zeros((2, 2, 12), f32), PLAN_CACHE, None, k_rope_cache=PLAN_CACHE[..., :4].astype(np.int32)), Type,
     "k_rope_cache"),
    ("BatchPlan.run", "dtype", lambda: _plan().run(PLAN_Q, PLAN_CACHE.astype(np.int32), PLAN_CACHE), Type,
     "k_cache"),
    ("flex_attention", "rank", lambda: qkv.flex_attention(TQ[0], TQ, TQ), Error, "query"),
    ("flex_attention", "dtype", lambda: qkv.flex_attention(TQ.int(), TQ.int(), TQ.int()), Type, "q"),
    ("flex_attention", "shape",
     lambda: qkv.flex_attention(TQ, TQ, TQ, score_mod=qkv.mods.bias(torch.zeros(3, 8, 8))), Error, "bias"),
    ("flex_attention", "type", lambda: qkv.flex_attention(TQ, TQ, TQ, block_mask="x"), Type, "block_mask"),
    ("flex_attention", "type", _flex_no_weakref, Type, "mask_mod"),
    ("softmax", "rank", lambda: qkv.softmax(np.float32(1.0)), Error, "x"),
    ("softmax", "dtype", lambda: qkv.softmax(np.array(["a"])), Type, "x"),
    ("softmax", "dtype", lambda: qkv.softmax(torch.zeros(3, dtype=torch.int32)), Type, "x"),
    ("log_softmax", "rank", lambda: qkv.log_softmax(np.float64(1.0)), Error, "x"),
    ("log_softmax", "dtype", lambda: qkv.log_softmax(torch.zeros(3, dtype=torch.int64)), Type, "x"),
    ("softmax_jacobian", "rank", lambda: qkv.softmax_jacobian(np.float64(1.0)), Error, "s"),
    ("softmax_jacobian", "dtype", lambda: qkv.softmax_jacobian(np.array([b"x"])), Type, "s"),
    ("softmax_backward", "rank", lambda: qkv.softmax_backward(np.float64(1.0), np.float64(1.0)), Error, "s"),
    ("softmax_backward", "dtype", lambda: qkv.softmax_backward(np.zeros(3), np.array(["a", "b", "c"])), Type, "g"),
    ("sparse_attention", "rank", lambda: qkv.sparse_attention(Q[0], Q, Q, IDX), Error, "q"),
    ("sparse_attention", "rank", lambda: qkv.sparse_attention(Q, Q, Q, IDX[0]), Error, "indices"),
    ("sparse_attention", "dtype", lambda: qkv.sparse_attention(Q.astype(np.int32), Q, Q, IDX), Type, "q"),
    ("sparse_attention", "dtype", lambda: qkv.sparse_attention(Q, Q, Q, IDX.astype(f32)), Type, "indices"),
    ("sparse_attention", "huge int", lambda: qkv.sparse_attention(Q, Q, Q, IDX, threads=HUGE), Error, "threads"),
    ("sparse_attention_backward", "rank",
     lambda: qkv.sparse_attention_backward(Q, Q, Q, IDX, SOUT[0], SLSE, SOUT), Error, "out"),
    ("sparse_attention_backward", "dtype",
     lambda: qkv.sparse_attention_backward(Q, Q, Q, IDX, SOUT, SLSE, SOUT.astype(np.int32)), Type, "dout"),
    ("sparse_attention_backward", "huge int",
     lambda: qkv.sparse_attention_backward(Q, Q, Q, IDX, SOUT, SLSE, SOUT, threads=HUGE), Error, "threads"),
    ("index_topk", "rank", lambda: qkv.index_topk(Q, Q, Q[0], 2), Error, "k"),
    ("index_topk", "dtype", lambda: qkv.index_topk(Q.astype(np.int32), Q[:, 0], Q[..., 0], 2), Type, "q"),
    ("index_topk", "huge int", lambda: qkv.index_topk(Q, Q[:, 0], Q[..., 0], HUGE), Error, "topk"),
    ("index_topk", "huge int", lambda: qkv.index_topk(Q, Q[:, 0], Q[..., 0], 2, threads=HUGE), Error, "threads"),
    ("mla_decode", "rank", lambda: qkv.mla_decode(QN, QP, CKV[0], KPE, [3, 3], scale=0.5), Error, "ckv_cache"),
    ("mla_decode", "rank", lambda: qkv.mla_decode(QN, QP, CKV, KPE, [3, 3], scale=0.5,
                                                  indices=np.zeros((2,), np.int32)), Error, "indices"),
    ("mla_decode", "dtype", lambda: qkv.mla_decode(QN.astype(np.complex64), QP, CKV, KPE, [3, 3], scale=0.5), Type,
     "q_nope"),
    ("mla_decode", "dtype", lambda: qkv.mla_decode(QN, QP, CKV.astype(np.int32), KPE, [3, 3], scale=0.5), Type,
     "ckv_cache"),
    ("mla_decode", "rank", lambda: qkv.mla_decode(RQN, QP, RECORDS[0], None, [3, 3], scale=0.5,
                                                  cache_format="fp8_ds_mla"), Error, "ckv_cache"),
    ("mla_decode", "dtype", lambda: qkv.mla_decode(RQN, QP, RECORDS.astype(np.int8), None, [3, 3], scale=0.5,
                                                   cache_format="fp8_ds_mla"), Type, "ckv_cache"),
    ("mla_decode", "huge int", lambda: qkv.mla_decode(RQN, QP, RECORDS, None, [3, HUGE], scale=0.5,
                                                      cache_format="fp8_ds_mla"), Error, "cache_lengths"),
    ("pack_mla_records", "rank", lambda: qkv.pack_mla_records(torch.zeros(()), torch.zeros(4)), Error, "c_kv"),
    ("pack_mla_records", "dtype", lambda: qkv.pack_mla_records(torch.zeros(2, 128, dtype=torch.int32),
                                                               torch.zeros(2, 4)), Type, "c_kv"),
    ("mla_decode", "huge int", lambda: qkv.mla_decode(QN, QP, CKV, KPE, [3, 3], scale=0.5, threads=HUGE), Error,
     "threads"),
    ("mla_decode", "huge int", lambda: qkv.mla_decode(QN, QP, CKV, KPE, [3, HUGE], scale=0.5), Error,
     "cache_lengths"),
    ("dropout_mask", "huge int", lambda: qkv.dropout_mask(HUGE, 1, 2, 2, 0.5, 0), Error, "batch"),
    ("dropout_mask", "huge int", lambda: qkv.dropout_mask(1, 1, 2, 2, 0.5, 0, offset=HUGE), Error, "offset"),
    ("dropout_mask", "type", lambda: qkv.dropout_mask(1, 1.5, 2, 2, 0.5, 0), Type, "heads"),
]


def _names_function(entry: str, message: str) -> bool:
    """Whether `message` names `entry` as qkv.<entry> (Python) or qkv::<entry> (C++)."""
    pattern = r"qkv(\.|::)" + r"(\.|::)".join(map(re.escape, entry.split(".")))
    return re.search(pattern + r"\b", message) is not None


@pytest.mark.parametrize("entry, wrong, call, error, argument", CASES,
                         ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_bad_call_raises_naming_the_function_and_argument(entry, wrong, call, error, argument):
    with pytest.raises(Exception) as info:
        call()
    assert type(info.value) is error or (error is Error and isinstance(info.value, Error)), \
        f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert _names_function(entry, message), message
    assert re.search(r"\b" + re.escape(argument) + r"\b", message), message


def _entry_points():
    names = {name for name in qkv.__all__ if callable(getattr(qkv, name)) and name != "Error"}
    names -= {"available_backends"}  # takes nothing
    names |= {"flex_attention"}
    for cls in ("KVCache", "BatchPlan"):
        names |= {f"{cls}.{m}" for m, f in vars(getattr(qkv, cls)).items()
                  if callable(f) and not m.startswith("_") and m not in _NO_ARRAYS_OR_INTS}
    return names


# Methods that take no array and no integer: nothing to get wrong but the object itself;
# and eager_run / eager_run_records, run()'s own bodies (what the operators call), whose
# bad values are run()'s rows above.
_NO_ARRAYS_OR_INTS = {"task_costs", "eager_run", "eager_run_records", "storage", "scales", "channel_scales", "value_group_scales",
                      "torch_storage", "block_table", "torch_state"}


def test_every_entry_point_has_rows():
    covered = {entry for entry, *_ in CASES}
    assert _entry_points() <= covered, sorted(_entry_points() - covered)


# -- issue 45 item 5: decoding is forward-only -----------------------------------------


def test_decoding_refuses_an_input_that_requires_grad():
    """BatchPlan.run, KVCache.attend and qkv.decode have no backward: an input that
    requires grad used to come back as an output without grad, silently. Now it is an
    error naming the function and the argument; under torch.no_grad it runs."""
    q = torch.zeros(2, 2, 8, requires_grad=True)
    cache = torch.zeros(2, 8, 1, 8)
    plan = _plan()
    with pytest.raises(qkv.Error, match=r"qkv\.BatchPlan\.run: q: requires grad.*forward-only"):
        plan.run(q, cache, cache)
    with pytest.raises(qkv.Error, match=r"qkv\.BatchPlan\.run: v_cache: requires grad"):
        plan.run(q.detach(), cache, cache.clone().requires_grad_())
    kv = qkv.KVCache(2, 8, 1, 8)
    kv.append(torch.ones(2, 1, 2, 8), torch.ones(2, 1, 2, 8))
    dq = torch.zeros(2, 2, 1, 8, requires_grad=True)
    with pytest.raises(qkv.Error, match=r"qkv\.KVCache\.attend: q: requires grad"):
        kv.attend(dq)
    k_cache = torch.zeros(2, 1, 8, 8)
    with pytest.raises(qkv.Error, match=r"qkv\.decode: q: requires grad"):
        qkv.decode(dq, k_cache, k_cache, [3, 3])
    with pytest.raises(qkv.Error, match=r"qkv\.decode: sinks: requires grad"):
        qkv.decode(dq.detach(), k_cache, k_cache, [3, 3], sinks=torch.zeros(2, requires_grad=True))
    # Appending stores values, not a graph: a k or v that requires grad is refused too
    # (it used to be detached silently), and nothing is appended.
    dk = torch.ones(2, 1, 2, 8, requires_grad=True)
    with pytest.raises(qkv.Error, match=r"qkv\.KVCache\.append: k: requires grad"):
        kv.append(dk, dk.detach())
    with pytest.raises(qkv.Error, match=r"qkv\.KVCache\.append_varlen: v: requires grad"):
        kv.append_varlen(torch.ones(2, 1, 8), torch.ones(2, 1, 8, requires_grad=True), [0, 1, 2])
    assert list(kv.lengths) == [2, 2]
    with torch.no_grad():
        assert torch.equal(plan.run(q, cache, cache), plan.run(q.detach(), cache, cache))
        assert torch.equal(kv.attend(dq), kv.attend(dq.detach()))
        assert torch.equal(qkv.decode(dq, k_cache, k_cache, [3, 3]), qkv.decode(dq.detach(), k_cache, k_cache, [3, 3]))


def test_offsets_of_another_integer_dtype_name_the_dtypes_taken():
    """The message used to read "expected dtype int64 (int32 or int64)" and name no function."""
    with pytest.raises(TypeError) as info:
        _plan(args=(PLAN_CU.astype(np.int8), PLAN_LENGTHS))
    assert str(info.value) == "qkv.BatchPlan: cu_seqlens_q: expected dtype int32 or int64, got int8"
    with pytest.raises(TypeError, match=r"^qkv\.varlen_attention: cu_seqlens_k: expected dtype int32 or int64, "
                                        r"got int16$"):
        qkv.varlen_attention(PACKED, PACKED, PACKED, CU, CU.astype(np.int16))
