"""The operators of decoding, as torch.compile, torch.export and fake tensors see
qkv.decode, qkv.KVCache and qkv.BatchPlan.run:

    torch.ops.qkv.decode(q, k_cache, v_cache, cache_lengths, ..., indices)   -> (out, lse)
    torch.ops.qkv.kv_cache_append(state!, handle, k, v, seqs)       mutates `state`
    torch.ops.qkv.kv_cache_attend(state, handle, q, layout, v_dim, ...)   -> (out, lse)
    torch.ops.qkv.batch_plan_run(handle, q, k_cache, v_cache, k_scale, v_scale, indices, k_rope_cache)
                                                                     -> (out, lse)
    torch.ops.qkv.batch_plan_run_records(handle, q, records, indices)   -> (out, lse)

Each runs the eager function (qkv/_decode.py, qkv/_batch_plan.py) when it executes, so a
traced call is the eager call. None is differentiable (decoding and serving have no
backward).

A KVCache owns its memory in C++, out of the graph's sight; the operators name it by a
handle (an int64 scalar tensor the cache holds, a graph input: Handles below, so one
compiled function serves any number of caches) and carry its `state`, an int64 [batch]
tensor holding the keys cached per sequence as of the last traced append. append declares
`state` mutated (it writes the new lengths there) and attend reads it, so a compiler
keeps every append before the attends that follow it, as written. attend's fake needs
the cache's layout and v_dim: they are arguments, read from the cache's attributes at
trace time (guarded, as any attribute a traced function reads), never from the cache.
"""

from __future__ import annotations

import weakref
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ._arrays import Error
from ._torch_ops import TORCH_THREADS, _checked_scalars, per_head_vector


class Handles:
    """How a traced operator names a Python object that lives outside the graph (a
    KVCache, a BatchPlan) — an int64 scalar tensor the object holds, mapped back to the object
    when the operator runs. Held weakly: the object lives as long as its caller keeps it.

    Why a tensor and not an int: torch.compile makes an int read from an object a constant
    of the graph, guarded; the next object's other int fails the guard, and the recompiled
    graph takes it as a symbolic int, which no lookup can hash. A tensor is a graph input:
    every object of a kind (a new BatchPlan each serving step) passes through one graph, and
    only the operator's real implementation, which runs outside tracing, reads its value.
    The fake implementations never need the object (their shapes come from their tensor
    arguments and from plain arguments read at trace time), so they never read the handle."""

    def __init__(self, what: str):
        self._what = what
        self._objects: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
        self._next = 0

    def register(self, obj) -> torch.Tensor:
        """A new handle for `obj`: an int64 scalar tensor (call it outside any trace)."""
        self._next += 1
        self._objects[self._next] = obj
        return torch.tensor(self._next, dtype=torch.int64)

    def get(self, handle: torch.Tensor):
        """The object named by `handle` (at run time: a real tensor)."""
        if not isinstance(handle, torch.Tensor) or handle.dtype != torch.int64 or handle.ndim != 0:
            raise TypeError(f"{self._what}: handle: expected an int64 scalar tensor (the object's .handle), "
                            f"got {handle!r}")
        obj = self._objects.get(int(handle))
        if obj is None:
            raise RuntimeError(f"{self._what}: handle {int(handle)}: the object no longer exists")
        return obj


_CACHES = Handles("qkv.KVCache")  # handle -> KVCache, for the operators
register_cache = _CACHES.register
_cache = _CACHES.get
_PLANS = Handles("qkv.BatchPlan")  # handle -> BatchPlan, for the operator
register_plan = _PLANS.register
_plan = _PLANS.get


def _variants(window_left, window_right, softcap, alibi_slopes, sinks, threads):
    window = None if window_left == window_right == -1 else (window_left, window_right)
    threads = torch.get_num_threads() if threads == TORCH_THREADS else threads
    return dict(window=window, softcap=softcap or None, alibi_slopes=alibi_slopes,
                sinks=sinks, threads=threads)


def _causal(name: str):
    return None if name == "none" else name


def _outputs(q, layout, v_dim):
    """(out, lse) fakes: out like q with v's head dim (q's dtype), lse float32 [B, Hq, Nq]."""
    if layout == "bhsd":
        batch, heads, q_len, _ = q.shape
        shape = (batch, heads, q_len, v_dim)
    else:
        batch, q_len, heads, _ = q.shape
        shape = (batch, q_len, heads, v_dim)
    dtype = q.dtype if q.is_floating_point() else torch.float32
    return q.new_empty(shape, dtype=dtype), q.new_empty((batch, heads, q_len), dtype=torch.float32)


@torch.library.custom_op("qkv::decode", mutates_args=())
def decode(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_lengths: Tensor,
    block_table: Optional[Tensor], k_scale: Optional[Tensor], v_scale: Optional[Tensor],
    scale: Optional[float], causal: str, layout: str, threads: int, window_left: int = -1,
    window_right: int = -1, alibi_slopes: Optional[Tensor] = None, softcap: float = 0.0,
    sinks: Optional[Tensor] = None, indices: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    from . import _decode_eager

    return _decode_eager.decode(q, k_cache, v_cache, cache_lengths, block_table=block_table,
                          scale=scale, causal=_causal(causal), layout=layout, return_lse=True,
                          k_scale=k_scale, v_scale=v_scale, indices=indices,
                          **_variants(window_left, window_right, softcap, alibi_slopes,
                                      sinks, threads))


@decode.register_fake
def _(q, k_cache, v_cache, cache_lengths, block_table, k_scale, v_scale, scale, causal,
      layout, *rest):
    return _outputs(q, layout, v_cache.shape[-1])


@torch.library.custom_op("qkv::mla_decode", mutates_args=())
def mla_decode(
    q_nope: Tensor, q_pe: Tensor, ckv_cache: Tensor, kpe_cache: Tensor, cache_lengths: Tensor,
    block_table: Optional[Tensor], scale: float, causal: str, threads: int, softcap: float = 0.0,
    sinks: Optional[Tensor] = None, indices: Optional[Tensor] = None, ckv_scale: Optional[Tensor] = None,
    kpe_scale: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    from . import _decode_eager

    threads = torch.get_num_threads() if threads == TORCH_THREADS else threads
    return _decode_eager.mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, cache_lengths, block_table=block_table,
                                    scale=scale, causal=_causal(causal), indices=indices, return_lse=True,
                                    threads=threads, softcap=softcap or None, sinks=sinks, ckv_scale=ckv_scale,
                                    kpe_scale=kpe_scale)


@mla_decode.register_fake
def _(q_nope, q_pe, ckv_cache, kpe_cache, cache_lengths, block_table, scale, causal, *rest):
    return _outputs(q_nope, "bshd", ckv_cache.shape[-1])


@torch.library.custom_op("qkv::mla_decode_records", mutates_args=())
def mla_decode_records(
    q_nope: Tensor, q_pe: Tensor, ckv_cache: Tensor, cache_lengths: Tensor, block_table: Optional[Tensor],
    scale: float, causal: str, threads: int, softcap: float = 0.0, sinks: Optional[Tensor] = None,
    indices: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    from . import _decode_eager

    threads = torch.get_num_threads() if threads == TORCH_THREADS else threads
    return _decode_eager.mla_decode_records(q_nope, q_pe, ckv_cache, cache_lengths, block_table=block_table,
                                            scale=scale, causal=_causal(causal), indices=indices, return_lse=True,
                                            threads=threads, softcap=softcap or None, sinks=sinks)


@mla_decode_records.register_fake
def _(q_nope, q_pe, ckv_cache, cache_lengths, block_table, scale, causal, *rest):
    return _outputs(q_nope, "bshd", q_nope.shape[-1])


@torch.library.custom_op("qkv::kv_cache_append", mutates_args=("state",))
def kv_cache_append(state: Tensor, handle: Tensor, k: Tensor, v: Tensor,
                    seqs: Optional[List[int]]) -> None:
    cache = _cache(handle)
    cache.append(k, v, seqs)
    state.copy_(torch.tensor(cache.lengths, dtype=torch.int64))


@kv_cache_append.register_fake
def _(state, handle, k, v, seqs):
    return None


@torch.library.custom_op("qkv::kv_cache_attend", mutates_args=())
def kv_cache_attend(
    state: Tensor, handle: Tensor, q: Tensor, layout: str, v_dim: int, scale: Optional[float],
    causal: str, threads: int, window_left: int = -1, window_right: int = -1,
    alibi_slopes: Optional[Tensor] = None, softcap: float = 0.0, sinks: Optional[Tensor] = None,
    indices: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    cache = _cache(handle)
    if (layout, v_dim) != (cache.layout, cache.v_dim):  # what the fake's shapes were made from
        raise Error(f"qkv.KVCache.attend: layout, v_dim: expected the cache's ({cache.layout!r}, "
                    f"{cache.v_dim}), got ({layout!r}, {v_dim})")
    return cache.attend(q, scale=scale, causal=_causal(causal), return_lse=True, indices=indices,
                        **_variants(window_left, window_right, softcap, alibi_slopes, sinks, threads))


@kv_cache_attend.register_fake
def _(state, handle, q, layout, v_dim, *rest):
    return _outputs(q, layout, v_dim)


# A plan is made once per step, outside the graph (its layout is data the engine has, not
# tensors of the model): batch_plan_run names it by its handle, so one compiled function
# serves every step's new plan without recompiling. The fake needs no plan: out's head dim
# is v_cache's last (the plan checks that it is its v_dim).
@torch.library.custom_op("qkv::batch_plan_run", mutates_args=())
def batch_plan_run(handle: Tensor, q: Tensor, k_cache: Tensor, v_cache: Tensor, k_scale: Optional[Tensor],
                   v_scale: Optional[Tensor], indices: Optional[Tensor] = None,
                   k_rope_cache: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    return _plan(handle).eager_run(q, k_cache, v_cache, k_scale=k_scale, v_scale=v_scale, return_lse=True,
                                   indices=indices, k_rope_cache=k_rope_cache)


@batch_plan_run.register_fake
def _(handle, q, k_cache, v_cache, k_scale, v_scale, indices=None, k_rope_cache=None):
    total, heads = q.shape[0], q.shape[1]
    dtype = q.dtype if q.is_floating_point() else torch.float32
    return (q.new_empty((total, heads, v_cache.shape[-1]), dtype=dtype),
            q.new_empty((heads, total), dtype=torch.float32))


# FlashMLA's FP8 records (BatchPlan.run with cache_format="fp8_ds_mla"). The fake reads dc
# from the shapes: a record is dc + dc/32 + 2·dr bytes and q's rows dc + dr wide, so
# dc = 32·(2·(dc + dr) − record) / 31.
@torch.library.custom_op("qkv::batch_plan_run_records", mutates_args=())
def batch_plan_run_records(handle: Tensor, q: Tensor, records: Tensor,
                           indices: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    return _plan(handle).eager_run_records(q, records, return_lse=True, indices=indices)


@batch_plan_run_records.register_fake
def _(handle, q, records, indices=None):
    total, heads, width = q.shape
    dc = 32 * (2 * width - records.shape[-1]) // 31
    dtype = q.dtype if q.is_floating_point() else torch.float32
    return (q.new_empty((total, heads, dc), dtype=dtype), q.new_empty((heads, total), dtype=torch.float32))


def traced(x) -> bool:
    """Whether a call on torch tensors is traced (torch.compile, fake tensors)."""
    return torch.compiler.is_compiling() or type(x) is not Tensor


def _scalars(fn, q, scale, causal, threads, window, softcap, alibi_slopes, sinks):
    """The operators' option arguments, checked by the same C++ setter as eagerly."""
    scale, causal, _, threads, _, left, right, softcap, _ = _checked_scalars(
        fn, scale, causal, "auto", threads, False, window, softcap)
    return (scale, causal, threads, left, right,
            per_head_vector(fn, _torch_fw(), "alibi_slopes", alibi_slopes), softcap,
            per_head_vector(fn, _torch_fw(), "sinks", sinks))


def _torch_fw():
    from ._arrays import Torch

    return Torch


def _tensor(values, dtype=torch.int64):
    return values if values is None or isinstance(values, Tensor) else torch.tensor(values, dtype=dtype)


def traced_decode(fn, q, k_cache, v_cache, cache_lengths, *, block_table, scale, causal,
                  layout, return_lse, threads, window, softcap, alibi_slopes, sinks,
                  k_scale, v_scale, indices=None):
    scale, causal, threads, left, right, slopes, softcap, sinks = _scalars(
        fn, q, scale, causal, threads, window, softcap, alibi_slopes, sinks)
    out, lse = decode(q, k_cache, v_cache, _tensor(cache_lengths), _tensor(block_table),
                      _tensor(k_scale, torch.float32), _tensor(v_scale, torch.float32),
                      scale, causal, layout, threads, left, right, slopes, softcap, sinks, _tensor(indices))
    return (out, lse) if return_lse else out


def traced_mla_decode(fn, q_nope, q_pe, ckv_cache, kpe_cache, cache_lengths, *, block_table, scale, causal,
                      indices, return_lse, threads, softcap, sinks, ckv_scale=None, kpe_scale=None):
    if scale is None:
        raise Error(f"{fn}: scale: required (the model's softmax scale)")
    scale, causal, threads, _, _, _, softcap, sinks = _scalars(
        fn, q_nope, scale, causal, threads, None, softcap, None, sinks)
    out, lse = mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, _tensor(cache_lengths), _tensor(block_table),
                          scale, causal, threads, softcap, sinks, _tensor(indices),
                          _tensor(ckv_scale, torch.float32), _tensor(kpe_scale, torch.float32))
    return (out, lse) if return_lse else out


def traced_mla_decode_records(fn, q_nope, q_pe, ckv_cache, cache_lengths, *, block_table, scale, causal, indices,
                              return_lse, threads, softcap, sinks):
    if scale is None:
        raise Error(f"{fn}: scale: required (the model's softmax scale)")
    scale, causal, threads, _, _, _, softcap, sinks = _scalars(
        fn, q_nope, scale, causal, threads, None, softcap, None, sinks)
    out, lse = mla_decode_records(q_nope, q_pe, ckv_cache, _tensor(cache_lengths), _tensor(block_table), scale,
                                  causal, threads, softcap, sinks, _tensor(indices))
    return (out, lse) if return_lse else out


def traced_append(cache, k, v, seq):
    seqs = None if seq is None else ([int(seq)] if isinstance(seq, int) else [int(s) for s in seq])
    kv_cache_append(cache.torch_state(), cache.handle, k, v, seqs)


def traced_attend(cache, q, *, scale, causal, return_lse, threads, window, softcap,
                  alibi_slopes, sinks, indices=None):
    scale, causal, threads, left, right, slopes, softcap, sinks = _scalars(
        "qkv.KVCache.attend", q, scale, causal, threads, window, softcap, alibi_slopes, sinks)
    out, lse = kv_cache_attend(cache.torch_state(), cache.handle, q, cache.layout, cache.v_dim, scale, causal,
                               threads, left, right, slopes, softcap, sinks, _tensor(indices))
    return (out, lse) if return_lse else out


__all__ = ["batch_plan_run", "batch_plan_run_records", "decode", "kv_cache_append", "kv_cache_attend", "mla_decode", "mla_decode_records", "register_cache",
           "register_plan", "traced", "traced_append", "traced_attend", "traced_decode", "traced_mla_decode",
           "traced_mla_decode_records"]
