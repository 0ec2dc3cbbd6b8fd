"""qkv.index_topk: DeepSeek Sparse Attention's "lightning indexer" (qkv/index_topk.hpp)."""

from __future__ import annotations

import operator

import numpy as np

from . import _qkv
from ._arrays import NumPy, Torch, framework_of
from ._options import Error, make_options


_MAX_TOPK = 2**31 - 1


def _topk_count(fn: str, topk) -> int:
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


def index_topk(q, k, weights, topk, *, scale=None, causal="bottom_right", key_lengths=None,
               threads=None):
    fn = "qkv.index_topk"
    fw = framework_of(fn, q=q, k=k, weights=weights)
    if fw is Torch:
        from . import _torch_ops

        if _torch_ops.traced(q, k, weights):  # torch.compile, fake tensors: the operator
            from . import _torch_ops_index  # noqa: F401  (registers torch.ops.qkv.index_topk)
            from ._options import key_lengths_array

            lengths = None if key_lengths is None else key_lengths_array(fn, Torch, key_lengths)
            import torch

            return torch.ops.qkv.index_topk(q, k, weights, _topk_count(fn, topk),
                                            None if scale is None else float(scale), causal, lengths,
                                            threads)
    return eager_index_topk(q, k, weights, topk, scale=scale, causal=causal,
                            key_lengths=key_lengths, threads=threads, fw=fw)


def eager_index_topk(q, k, weights, topk, *, scale, causal, key_lengths, threads, fw=None):
    """The library call on arrays of one framework (also the operator's implementation)."""
    fn = "qkv.index_topk"
    fw = fw or framework_of(fn, q=q, k=k, weights=weights)
    count = _topk_count(fn, topk)
    for name, x, rank, axes in (("q", q, 4, "[batch, seq, heads, dim]"), ("k", k, 3, "[batch, seq, dim]"),
                                ("weights", weights, 3, "[batch, seq, heads]")):
        if x.ndim != rank:
            raise Error(f"{fn}: {name}: expected {rank} dimensions {axes}, got shape {tuple(x.shape)}")
    options = make_options(fn, fw, key_lengths=key_lengths, scale=scale, causal=causal,
                           threads=threads)
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


index_topk.__doc__ = """The top-k keys of every query by DeepSeek-V3.2's indexer score,

        score[b, i, j] = Σ_h weights[b, i, h] · relu(scale · q[b, i, h, :] · k[b, j, :])

    as transformers' ``DeepseekV32Indexer`` computes it (pass its weights, which already
    carry its ``n_heads**-0.5``). Returns int32 ``[B, Nq, topk]``: each row's allowed keys by
    descending score, ties to the lower index, then -1 where a row is allowed fewer than
    topk keys (transformers' ``torch.topk`` would list masked positions there instead).

    q ``[B, Nq, Hi, di]``, k ``[B, Nk, di]``, weights ``[B, Nq, Hi]``: NumPy arrays or CPU
    torch tensors (never copied; last dimension contiguous), q and k float32, float16,
    bfloat16 or float64 (one dtype), weights any float (used as float32; float64 with
    float64 q). scale: default ``1/sqrt(di)``, finite and > 0. causal: ``"bottom_right"``
    (the default: query i sees keys j <= i + Nk - Nq, Nk being key_lengths[b] when given),
    ``"top_left"`` (j <= i) or None. key_lengths: one int per batch entry; only keys
    [0, key_lengths[b]) may be picked. threads: None = every hardware thread; the result
    is the same for any count.

    Computed in float32 (float64 for float64 inputs) over blocks of keys with a running
    top-k per row: memory O(threads·topk) beside the output, never the Nq×Nk scores. A NaN
    score ranks above every number (torch.topk's order). Raises TypeError for a wrong array
    type or dtype and qkv.Error (a ValueError) naming the argument otherwise.
"""

__all__ = ["index_topk"]
