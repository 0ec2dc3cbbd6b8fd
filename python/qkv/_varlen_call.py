"""One varlen library call on arrays already checked and converted (qkv.varlen_attention's
and its operators' common ground): allocate the outputs, run qkv._qkv.varlen_forward or
varlen_backward. `settings` is (options, max_seqlen_q, max_seqlen_k)."""

from __future__ import annotations

from typing import NamedTuple

from . import _qkv
from ._arrays import Torch


def _forward(fw, q, k, v, cu_q, cu_k, settings, stats=None):
    out = fw.empty((q.shape[0], q.shape[1], v.shape[2]), q)
    lse = fw.empty_lse((q.shape[1], q.shape[0]), q)
    bits = fw.bfloat16_bits(q)
    arrays = fw.bits_views(q, k, v, out) if bits else (q, k, v, out)
    _qkv.varlen_forward(*arrays, cu_q, cu_k, lse, stats, *settings, bits)
    return out, lse


def _backward(fw, q, k, v, out, lse, dout, cu_q, cu_k, settings, dsinks=None, dalibi=None):
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
        return _forward(Torch, q, k, v, self.cu_q, self.cu_k,
                        (options, self.max_q, self.max_k), stats)

    def backward(self, q, k, v, out, lse, dout, options, dsinks, dslopes):
        return _backward(Torch, q, k, v, out, lse, dout, self.cu_q, self.cu_k,
                         (options, self.max_q, self.max_k), dsinks, dslopes)

    def backward_operator(self, options):
        return None  # no traceable varlen operator (yet): gradients are computed once
