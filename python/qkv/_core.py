"""One library call: allocate the outputs in the caller's array type, hand the library
[batch, seq, heads, dim] views of everything (no copies), return the outputs.

The library validates every argument before it writes anything and raises qkv.Error
(a ValueError) naming the argument; these functions add no checks of their own beyond
what is needed to size the outputs.
"""

from __future__ import annotations

from . import _qkv
from ._arrays import dims, empty_in_layout, to_logical
from ._options import Options


def forward(fw, q, k, v, *, layout: str, options: Options, want_lse: bool,
            want_weights: bool = False, stats=None):
    """(out, lse or None, weights or None); out in `layout`, lse [B, Hq, Nq],
    weights [B, Hq, Nq, Nk]. `stats`: None or the library's dict of statistics outputs
    (_stats.for_library), written in place."""
    batch, q_len, q_heads, _ = dims(q, layout)
    k_len = dims(k, layout)[1]
    v_dim = dims(v, layout)[3]
    out, out_view = empty_in_layout(fw, q, batch, q_len, q_heads, v_dim, layout)
    lse = fw.empty_lse((batch, q_heads, q_len), q) if want_lse else None
    weights = fw.empty((batch, q_heads, q_len, k_len), q) if want_weights else None
    _qkv.forward(
        to_logical(fw, q, layout),
        to_logical(fw, k, layout),
        to_logical(fw, v, layout),
        fw.for_library(out_view),
        lse=None if lse is None else fw.for_library(lse),
        weights=None if weights is None else fw.for_library(weights),
        stats=stats,
        storage=fw.storage(q),
        **options.for_library(fw),
    )
    return out, lse, weights


def backward(fw, q, k, v, out, lse, dout, *, layout: str, options: Options, dsinks=None):
    """(dq, dk, dv), each a new C-order array in `layout` shaped like q, k, v; with
    `dsinks` (a float32 [Hq] array), also writes the sinks' gradient there."""
    dq, dq_view = empty_in_layout(fw, q, *dims(q, layout), layout)
    dk, dk_view = empty_in_layout(fw, q, *dims(k, layout), layout)
    dv, dv_view = empty_in_layout(fw, q, *dims(v, layout), layout)
    _qkv.backward(
        to_logical(fw, q, layout),
        to_logical(fw, k, layout),
        to_logical(fw, v, layout),
        to_logical(fw, out, layout),
        fw.for_library(lse),
        to_logical(fw, dout, layout),
        fw.for_library(dq_view),
        fw.for_library(dk_view),
        fw.for_library(dv_view),
        storage=fw.storage(q),
        dsinks=None if dsinks is None else fw.for_library(dsinks),
        **options.for_library(fw),
    )
    return dq, dk, dv
