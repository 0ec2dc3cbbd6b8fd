"""One library call, dense or varlen: allocate the outputs in the caller's array type and
layout, hand the library the arrays as they are with one bound Options (no copies, no conversions:
the binding reads NumPy arrays and torch tensors in place and swaps two strides for the
[batch, heads, seq, dim] layout), return the outputs.

The library validates every argument before it writes anything and raises qkv.Error
(a ValueError) naming the argument; these functions add no checks of their own beyond
what is needed to size the outputs.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import numpy as np

from . import _qkv
from ._arrays import NumPy, Torch, framework_of
from ._options import Error, Options, make_options


def forward(fw, q, k, v, *, layout: str, options: Options, want_lse: bool,
            want_weights: bool = False, stats=None):
    """(out, lse or None, weights or None); out in `layout`, lse [B, Hq, Nq],
    weights [B, Hq, Nq, Nk]. `stats`: None or the library's dict of statistics outputs
    (_stats.for_library), written in place."""
    batch, axis1, axis2, _ = q.shape
    bhsd = layout == "bhsd"
    q_heads, q_len = (axis1, axis2) if bhsd else (axis2, axis1)
    out = fw.empty((batch, axis1, axis2, v.shape[3]), q)  # q's layout: its first three axes
    lse = fw.empty_lse((batch, q_heads, q_len), q) if want_lse else None
    weights = None
    if want_weights:
        weights = fw.empty((batch, q_heads, q_len, k.shape[2 if bhsd else 1]), q)
    bits = fw.bfloat16_bits(q)
    if bits:  # NumPy cannot describe bfloat16: the library reads int16 views of the bits
        _qkv.forward(*fw.bits_views(q, k, v, out), lse, fw.bits_views(weights)[0], stats,
                     options, bhsd, True)
    else:
        _qkv.forward(q, k, v, out, lse, weights, stats, options, bhsd, False)
    return out, lse, weights


def backward(fw, q, k, v, out, lse, dout, *, layout: str, options: Options, dsinks=None,
             dalibi=None):
    """(dq, dk, dv), each a new C-order array in `layout` shaped like q, k, v; with
    `dsinks` (a float32 [Hq] array), also writes the sinks' gradient there, and with
    `dalibi` (float32 [Hq]) the ALiBi slopes' gradient."""
    dq, dk, dv = fw.empty(tuple(q.shape), q), fw.empty(tuple(k.shape), q), fw.empty(tuple(v.shape), q)
    bits = fw.bfloat16_bits(q)
    arrays = fw.bits_views(q, k, v, out) if bits else (q, k, v, out)
    grads = fw.bits_views(dout, dq, dk, dv) if bits else (dout, dq, dk, dv)
    _qkv.backward(*arrays, lse, *grads, dsinks, options, layout == "bhsd", bits, dalibi)
    return dq, dk, dv


# One varlen library call on arrays already checked and converted (qkv.varlen_attention's
# and its operators' common ground): allocate the outputs, run qkv._qkv.varlen_forward or
# varlen_backward. `settings` is (options, max_seqlen_q, max_seqlen_k).
def varlen_forward(fw, q, k, v, cu_q, cu_k, settings, stats=None):
    out = fw.empty((q.shape[0], q.shape[1], v.shape[2]), q)
    lse = fw.empty_lse((q.shape[1], q.shape[0]), q)
    bits = fw.bfloat16_bits(q)
    arrays = fw.bits_views(q, k, v, out) if bits else (q, k, v, out)
    _qkv.varlen_forward(*arrays, cu_q, cu_k, lse, stats, *settings, bits)
    return out, lse


def varlen_backward(fw, q, k, v, out, lse, dout, cu_q, cu_k, settings, dsinks=None, dalibi=None):
    dq, dk, dv = fw.empty(tuple(q.shape), q), fw.empty(tuple(k.shape), q), fw.empty(tuple(v.shape), q)
    bits = fw.bfloat16_bits(q)
    arrays = fw.bits_views(q, k, v, out) if bits else (q, k, v, out)
    grads = fw.bits_views(dout, dq, dk, dv) if bits else (dout, dq, dk, dv)
    _qkv.varlen_backward(*arrays, lse, *grads, cu_q, cu_k, dsinks, *settings, bits, dalibi)
    return dq, dk, dv


class Packed(NamedTuple):
    """A varlen call, for _autograd's one Function: the sequences' offsets and the
    max_seqlen bounds (0: not given)."""

    cu_q: object
    cu_k: object
    max_q: int
    max_k: int

    def forward(self, q, k, v, options, stats, want_lse):
        return varlen_forward(Torch, q, k, v, self.cu_q, self.cu_k,
                        (options, self.max_q, self.max_k), stats)

    def backward(self, q, k, v, out, lse, dout, options, dsinks, dslopes):
        return varlen_backward(Torch, q, k, v, out, lse, dout, self.cu_q, self.cu_k,
                         (options, self.max_q, self.max_k), dsinks, dslopes)

    def backward_operator(self, options):
        return None  # no traceable varlen operator (yet): gradients are computed once


# -- sparse attention over listed keys (qkv.sparse_attention) ------------------------


def _sparse_dims(q, layout):
    batch, axis1, axis2, _ = q.shape
    return (batch, axis1, axis2) if layout == "bhsd" else (batch, axis2, axis1)


def sparse_forward(fw, q, k, v, indices, *, layout, options, want_lse):
    """qkv.sparse_attention's library call: (out, lse or None), outputs allocated in q's layout."""
    batch, q_heads, q_len = _sparse_dims(q, layout)
    out = fw.empty((*q.shape[:3], v.shape[3]), q)
    lse = fw.empty_lse((batch, q_heads, q_len), q) if want_lse else None
    bits = fw.bfloat16_bits(q)
    arrays = fw.bits_views(q, k, v, out) if bits else (q, k, v, out)
    _qkv.sparse_forward(*arrays[:3], indices, arrays[3], lse, options, layout == "bhsd", bits)
    return out, lse


def sparse_backward(fw, q, k, v, indices, out, lse, dout, *, layout, options, dsinks=None):
    """qkv.sparse_attention_backward's library call: (dq, dk, dv), new arrays shaped like q, k,
    v; dsinks (float32 [Hq]) written in place."""
    dq, dk, dv = fw.empty(tuple(q.shape), q), fw.empty(tuple(k.shape), q), fw.empty(tuple(v.shape), q)
    bits = fw.bfloat16_bits(q)
    arrays = fw.bits_views(q, k, v, out) if bits else (q, k, v, out)
    grads = fw.bits_views(dout, dq, dk, dv) if bits else (dout, dq, dk, dv)
    _qkv.sparse_backward(*arrays[:3], indices, arrays[3], lse, *grads, dsinks, options,
                         layout == "bhsd", bits)
    return dq, dk, dv


# -- the indexer (qkv.index_topk) -------------------------------------------------------


_MAX_TOPK = 2**31 - 1


def topk_count(fn: str, topk) -> int:
    if isinstance(topk, bool):
        raise TypeError(f"{fn}: topk: expected an int >= 0, got {topk!r}")
    try:
        count = operator.index(topk)
    except TypeError:
        raise TypeError(f"{fn}: topk: expected an int >= 0, got {topk!r}") from None
    if not 0 <= count <= _MAX_TOPK:
        raise Error(f"{fn}: topk: expected an int in [0, {_MAX_TOPK}] (indices are int32), got {count}")
    return count


def _weights_for(fw, weights, q):
    """weights in the library's dtype: float64 for float64 q, else float32 (a 16-bit or
    float64 array is converted once, exactly or rounded once)."""
    if fw is Torch:
        import torch

        wanted = torch.float64 if q.dtype == torch.float64 else torch.float32
        return weights if weights.dtype == wanted else weights.to(wanted)
    wanted = np.float64 if q.dtype == np.float64 else np.float32
    return weights if weights.dtype == wanted else weights.astype(wanted)


def eager_index_topk(q, k, weights, topk, *, scale, causal, key_lengths, threads, fw=None, precision=None):
    """qkv.index_topk's library call on arrays of one framework (also the operator's
    implementation, torch.ops.qkv.index_topk)."""
    fn = "qkv.index_topk"
    fw = fw or framework_of(fn, q=q, k=k, weights=weights)
    count = topk_count(fn, topk)
    for name, x, rank, axes in (("q", q, 4, "[batch, seq, heads, dim]"), ("k", k, 3, "[batch, seq, dim]"),
                                ("weights", weights, 3, "[batch, seq, heads]")):
        if x.ndim != rank:
            raise Error(f"{fn}: {name}: expected {rank} dimensions {axes}, got shape {tuple(x.shape)}")
    options = make_options(fn, fw, key_lengths=key_lengths, scale=scale, causal=causal,
                           threads=threads, precision=precision)
    weights = _weights_for(fw, weights, q)
    shape = (q.shape[0], q.shape[1], count)
    if fw is Torch:
        import torch

        indices = torch.empty(shape, dtype=torch.int32)
        q, k, weights = q.detach(), k.detach(), weights.detach()
    else:
        indices = np.empty(shape, dtype=np.int32)
    bits = fw.bfloat16_bits(q)
    if bits:  # NumPy cannot describe bfloat16: the library reads int16 views of the bits
        q, k = NumPy.bits_views(q, k)
    _qkv.index_topk(q, k, weights, indices, options, bits)
    return indices


def eager_cache_index_topk(cache, q, weights, topk, *, scale, causal, threads, precision=None):
    """qkv.KVCache.index_topk's library call: the indexer against the keys of `cache` (the
    extension's KVCache), q ``[B, Nq, Hi, di]`` and weights ``[B, Nq, Hi]`` of one framework."""
    fn = "qkv.KVCache.index_topk"
    fw = framework_of(fn, q=q, weights=weights)
    count = topk_count(fn, topk)
    for name, x, rank, axes in (("q", q, 4, "[batch, seq, heads, dim]"), ("weights", weights, 3, "[batch, seq, heads]")):
        if x.ndim != rank:
            raise Error(f"{fn}: {name}: expected {rank} dimensions {axes}, got shape {tuple(x.shape)}")
    options = make_options(fn, fw, scale=scale, causal=causal, threads=threads, precision=precision)
    if fw is Torch:
        import torch

        weights = weights if weights.dtype == torch.float32 else weights.to(torch.float32)
        indices = torch.empty((q.shape[0], q.shape[1], count), dtype=torch.int32)
        q, weights = q.detach(), weights.detach()
    else:
        weights = weights if weights.dtype == np.float32 else weights.astype(np.float32)
        indices = np.empty((q.shape[0], q.shape[1], count), dtype=np.int32)
    bits = fw.bfloat16_bits(q)
    if bits:  # NumPy cannot describe bfloat16: the library reads an int16 view of the bits
        (q,) = NumPy.bits_views(q)
    _qkv.cache_index_topk(cache, q, weights, indices, options, bits)
    return indices
