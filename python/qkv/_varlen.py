"""qkv.varlen_attention and qkv.varlen_attention_backward: a batch of sequences of
different lengths packed back to back (FlashAttention's ``flash_attn_varlen_func``
layout), with no padding and so no work spent on padding."""

from __future__ import annotations

from . import _stats
from ._arrays import Torch, framework_of
from ._core import Packed, varlen_backward, varlen_forward
from ._options import Error, make_options

_DOC = """
    q ``[total_q, Hq, d]``, k ``[total_k, Hkv, d]``, v ``[total_k, Hkv, dv]``: the
    sequences back to back. Sequence s owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``
    and key rows ``cu_seqlens_k[s]:cu_seqlens_k[s+1]`` and attends only within itself.
    cu_seqlens_q/k: int32 or int64 prefix sums (number of sequences + 1 entries, first 0,
    never decreasing, last = total), as arrays of q's type or lists of ints.
    max_seqlen_q/k: optional; when given, must be >= every sequence's length.
    causal: None, ``"top_left"`` or ``"bottom_right"``, applied per sequence.
    scale: default 1/sqrt(d). Hq a multiple of Hkv (GQA). threads: None = all.
    Errors name the argument (qkv.Error), e.g. a cu_seqlens entry that decreases.
    dtypes: float32, float64, float16 or bfloat16 (one for q, k, v; lse is float32 for
    the 16-bit ones, which are computed in float32 and rounded once on output).
    precision as in qkv.attention. Variants as in qkv.attention: window, alibi_slopes and sinks (both differentiable for
    torch; varlen_attention_backward also returns dsinks), softcap, dropout_p, seed.
"""


def _offsets(fw, name, values):
    if fw.owns(values):
        return fw.for_library(values)
    vector = fw.integer_vector(values)
    if vector is None:
        raise TypeError(f"{name}: expected int32 or int64 prefix sums, got {values!r}")
    return fw.for_library(vector)


def _settings(fn, fw, causal, scale, threads, backend, max_seqlen_q, max_seqlen_k, variants):
    """(the binding's trailing arguments: options, max_seqlen_q, max_seqlen_k; the sinks
    array or None)."""
    options = make_options(fn, fw, scale=scale, causal=causal, backend=backend, threads=threads,
                           **variants)
    return (options, int(max_seqlen_q or 0), int(max_seqlen_k or 0)), options.sinks


def _check_rank3(fn, **arrays):
    for name, x in arrays.items():
        if x.ndim != 3:
            raise Error(f"{fn}: {name}: expected 3 dimensions [total, heads, dim], "
                        f"got shape {tuple(x.shape)}")


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                     max_seqlen_k=None, causal=None, scale=None, return_lse=False,
                     return_stats=False, return_row_stats=False,
                     saturation_threshold=_stats.DEFAULT_THRESHOLD, threads=None,
                     backend="auto", **variants):
    fn = "qkv.varlen_attention"
    fw = framework_of(fn, q=q, k=k, v=v)
    _check_rank3(fn, q=q, k=k, v=v)
    if fw is Torch:
        from . import _torch_ops, _torch_ops_varlen

        if _torch_ops.traced(q, k, v):  # torch.compile, fake tensors: the operator
            _torch_ops.refuse_stats_when_traced(True if return_stats or return_row_stats else None)
            out, lse = _torch_ops_varlen.traced_varlen(
                fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                causal=causal, scale=scale, threads=threads, backend=backend,
                variants=variants)
            return (out, lse) if return_lse else out
    settings, sinks = _settings(fn, fw, causal, scale, threads, backend, max_seqlen_q,
                                max_seqlen_k, variants)
    cu_q, cu_k = _offsets(fw, "cu_seqlens_q", cu_seqlens_q), _offsets(fw, "cu_seqlens_k", cu_seqlens_k)
    stats = library_stats = None
    if return_stats or return_row_stats:
        threshold = _stats.check_threshold(fn, saturation_threshold)
        sequences = max(len(cu_q) - 1, 0)
        stats = _stats.allocate(fw, q, (sequences, q.shape[1]),
                                (q.shape[1], q.shape[0]) if return_row_stats else None)
        library_stats = _stats.for_library(fw, stats, threshold)
    if fw is Torch:
        from . import _autograd

        out, lse = _autograd.run(Packed(cu_q, cu_k, *settings[1:]), q, k, v, settings[0],
                                 library_stats)
    else:
        out, lse = varlen_forward(fw, q, k, v, cu_q, cu_k, settings, library_stats)
    result = (out, lse) if return_lse else (out,)
    if stats is not None:
        result += (stats,)
    return result if len(result) > 1 else out


varlen_attention.__doc__ = """Attention over packed sequences of different lengths.

    Returns ``out [total_q, Hq, dv]`` (a new array of q's type), or ``(out, lse)`` with
    ``return_lse=True``, ``lse [Hq, total_q]`` (what varlen_attention_backward needs);
    with ``return_stats=True`` the statistics dict comes last, its per-head arrays
    ``[sequences, Hq]`` and its per-row arrays ``[Hq, total_q]``. Differentiable for
    torch tensors (autograd runs qkv's backward); traced by torch.compile and
    torch.export as the operator ``torch.ops.qkv.varlen_forward`` (no statistics there).
""" + _stats.STATS_DOC + _DOC


def varlen_attention_backward(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, *,
                              max_seqlen_q=None, max_seqlen_k=None, causal=None, scale=None,
                              threads=None, backend="auto", **variants):
    fn = "qkv.varlen_attention_backward"
    fw = framework_of(fn, q=q, k=k, v=v, out=out, lse=lse, dout=dout)
    _check_rank3(fn, q=q, k=k, v=v, out=out, dout=dout)
    if variants.get("dropout_p") and variants.get("seed") is None:
        raise Error(f"{fn}: seed: required with dropout_p > 0 (pass the forward's seed)")
    settings, sinks = _settings(fn, fw, causal, scale, threads, backend, max_seqlen_q,
                                max_seqlen_k, variants)
    cu_q, cu_k = _offsets(fw, "cu_seqlens_q", cu_seqlens_q), _offsets(fw, "cu_seqlens_k", cu_seqlens_k)
    dsinks = None if sinks is None else fw.empty(tuple(sinks.shape), sinks)
    grads = varlen_backward(fw, q, k, v, out, lse, Torch.inner_contiguous(dout) if fw is Torch else dout,
                      cu_q, cu_k, settings, dsinks)
    return grads if dsinks is None else (*grads, dsinks)


varlen_attention_backward.__doc__ = """Gradients ``(dq, dk, dv)`` of varlen_attention
    given its ``out``, ``lse`` and ``dout = ∂L/∂out``, with the same arguments.
""" + _DOC

__all__ = ["varlen_attention", "varlen_attention_backward"]
