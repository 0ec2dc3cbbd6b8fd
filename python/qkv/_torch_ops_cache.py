"""The operators of decoding, as torch.compile, torch.export and fake tensors see
qkv.decode and qkv.KVCache:

    torch.ops.qkv.decode(q, k_cache, v_cache, cache_lengths, ...)   -> (out, lse)
    torch.ops.qkv.kv_cache_append(state!, handle, k, v, seqs)       mutates `state`
    torch.ops.qkv.kv_cache_attend(state, handle, q, layout, v_dim, ...)   -> (out, lse)

Each runs the eager function (qkv/_decode.py) when it executes, so a traced call is
the eager call. None is differentiable (decoding has no backward).

A KVCache owns its memory in C++, out of the graph's sight; the operators name it by a
handle (an int64 scalar tensor the cache holds, a graph input: qkv/_handles.py, so one
compiled function serves any number of caches) and carry its `state`, an int64 [batch]
tensor holding the keys cached per sequence as of the last traced append. append declares
`state` mutated (it writes the new lengths there) and attend reads it, so a compiler
keeps every append before the attends that follow it, as written. attend's fake needs
the cache's layout and v_dim: they are arguments, read from the cache's attributes at
trace time (guarded, as any attribute a traced function reads), never from the cache.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ._arrays import Error
from ._handles import Handles
from ._torch_ops import TORCH_THREADS, _checked_scalars, per_head_vector

_CACHES = Handles("qkv.KVCache")  # handle -> KVCache, for the operators
register = _CACHES.register
_cache = _CACHES.get


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
    sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    from . import _decode_eager

    return _decode_eager.decode(q, k_cache, v_cache, cache_lengths, block_table=block_table,
                          scale=scale, causal=_causal(causal), layout=layout, return_lse=True,
                          k_scale=k_scale, v_scale=v_scale,
                          **_variants(window_left, window_right, softcap, alibi_slopes,
                                      sinks, threads))


@decode.register_fake
def _(q, k_cache, v_cache, cache_lengths, block_table, k_scale, v_scale, scale, causal,
      layout, *rest):
    return _outputs(q, layout, v_cache.shape[-1])


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
) -> Tuple[Tensor, Tensor]:
    cache = _cache(handle)
    if (layout, v_dim) != (cache.layout, cache.v_dim):  # what the fake's shapes were made from
        raise Error(f"qkv.KVCache.attend: layout, v_dim: expected the cache's ({cache.layout!r}, "
                    f"{cache.v_dim}), got ({layout!r}, {v_dim})")
    return cache.attend(q, scale=scale, causal=_causal(causal), return_lse=True,
                        **_variants(window_left, window_right, softcap, alibi_slopes, sinks, threads))


@kv_cache_attend.register_fake
def _(state, handle, q, layout, v_dim, *rest):
    return _outputs(q, layout, v_dim)


def traced(x) -> bool:
    """Whether a decoding call on torch tensors is traced (torch.compile, fake tensors)."""
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
                  k_scale, v_scale):
    scale, causal, threads, left, right, slopes, softcap, sinks = _scalars(
        fn, q, scale, causal, threads, window, softcap, alibi_slopes, sinks)
    out, lse = decode(q, k_cache, v_cache, _tensor(cache_lengths), _tensor(block_table),
                      _tensor(k_scale, torch.float32), _tensor(v_scale, torch.float32),
                      scale, causal, layout, threads, left, right, slopes, softcap, sinks)
    return (out, lse) if return_lse else out


def traced_append(cache, k, v, seq):
    seqs = None if seq is None else ([int(seq)] if isinstance(seq, int) else [int(s) for s in seq])
    kv_cache_append(cache.torch_state(), cache.handle, k, v, seqs)


def traced_attend(cache, q, *, scale, causal, return_lse, threads, window, softcap,
                  alibi_slopes, sinks):
    scale, causal, threads, left, right, slopes, softcap, sinks = _scalars(
        "qkv.KVCache.attend", q, scale, causal, threads, window, softcap, alibi_slopes, sinks)
    out, lse = kv_cache_attend(cache.torch_state(), cache.handle, q, cache.layout, cache.v_dim, scale, causal,
                               threads, left, right, slopes, softcap, sinks)
    return (out, lse) if return_lse else out


__all__ = ["decode", "kv_cache_append", "kv_cache_attend", "register", "traced",
           "traced_append", "traced_attend", "traced_decode"]
