"""One library call, dense or varlen: allocate the outputs in the caller's array type and
layout, hand the library the arrays as they are with one bound Options (no copies, no conversions:
the binding reads NumPy arrays and torch tensors in place and swaps two strides for the
[batch, heads, seq, dim] layout), return the outputs.

The library validates every argument before it writes anything and raises qkv.Error
(a ValueError) naming the argument; these functions add no checks of their own beyond
what is needed to size the outputs.
"""

from __future__ import annotations

from typing import NamedTuple

from . import _qkv
from ._arrays import Torch
from ._options import Options


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
