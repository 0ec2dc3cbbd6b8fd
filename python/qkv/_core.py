"""One library call: allocate the outputs in the caller's array type and layout, hand
the library the arrays as they are with one bound Options (no copies, no conversions:
the binding reads NumPy arrays and torch tensors in place and swaps two strides for the
[batch, heads, seq, dim] layout), return the outputs.

The library validates every argument before it writes anything and raises qkv.Error
(a ValueError) naming the argument; these functions add no checks of their own beyond
what is needed to size the outputs.
"""

from __future__ import annotations

from . import _qkv
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
