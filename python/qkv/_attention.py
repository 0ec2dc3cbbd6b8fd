"""qkv.attention, qkv.attention_backward, qkv.attention_weights: the library's forward
and backward on NumPy arrays or PyTorch tensors, without copies."""

from __future__ import annotations

import functools

from . import _core, _qkv, _stats
from ._arrays import Torch, check_layout, check_rank4, dims, framework_of
from ._options import make_options

_COMMON_DOC = """
    Layout: with ``layout="bhsd"`` (the default, PyTorch's) q, k, v are
    ``[batch, heads, seq, dim]``; with ``layout="bshd"`` they are
    ``[batch, seq, heads, dim]``. Any strides are read in place as long as the last
    dimension is contiguous (PyTorch's q/k/v slices of a packed projection included);
    nothing is copied. Shapes: q ``Nq×d`` with Hq heads, k ``Nk×d`` and v ``Nk×dv``
    with Hkv heads, Hq a multiple of Hkv (grouped-query attention; Hkv = 1 is MQA).

    causal: None, ``"top_left"`` (key j visible to query i iff j <= i, PyTorch's
        ``is_causal``) or ``"bottom_right"`` (j <= i + Nk - Nq, FlashAttention's, for
        decoding with a KV cache; with key_lengths, Nk is that batch entry's length).
    mask: ``[B|1, Hq|1, Nq|1, Nk]`` (fewer dimensions broadcast from the left), bool or
        uint8 (True = the key takes part) or float (added to the scaled logits; -inf
        removes the key; computed in float32, a float64 mask is rounded once).
    scale: multiplies q·kᵀ; default 1/sqrt(d). Must be finite and > 0.
    key_lengths: one int per batch entry; only keys [0, key_lengths[b]) take part.
    backend: ``"auto"`` (fastest available), ``"reference"`` (exact: fp64 accumulation,
        explicit softmax Jacobian in the backward; float64 inputs always run here) or
        ``"cpu"`` (fused float32 kernels, where built: see qkv.available_backends()).
    threads: None = every hardware thread. Results never depend on it.
    check_finite: scan inputs first and raise naming the first NaN/Inf element.

    A query row whose keys are all removed gives output 0, log-sum-exp -inf and zero
    gradients, never NaN.

    Raises TypeError for a wrong array type, dtype (float32 or float64 only) or device
    (CPU only), and ValueError (qkv.Error) for anything else, with the library's message
    naming the argument, the expected and the actual value. The GIL is released while
    the library computes.
"""


def attention(q, k, v, *, causal=None, mask=None, scale=None, key_lengths=None,
              return_lse=False, return_stats=False, return_row_stats=False,
              saturation_threshold=_stats.DEFAULT_THRESHOLD, layout="bhsd", backend="auto",
              threads=None, check_finite=False):
    fn = "qkv.attention"
    fw = framework_of(fn, q=q, k=k, v=v, mask=mask)
    check_layout(fn, layout)
    check_rank4(fn, layout, q=q, k=k, v=v)
    options = make_options(fn, fw, mask=mask, key_lengths=key_lengths, scale=scale,
                           causal=causal, backend=backend, threads=threads,
                           check_finite=check_finite)
    stats = library_stats = None
    if return_stats or return_row_stats:
        threshold = _stats.check_threshold(fn, saturation_threshold)
        batch, q_len, q_heads, _ = dims(q, layout)
        stats = _stats.allocate(fw, q, (batch, q_heads),
                                (batch, q_heads, q_len) if return_row_stats else None)
        library_stats = _stats.for_library(fw, stats, threshold)
    if fw is Torch:
        from . import _torch_ops

        out, lse = _torch_ops.forward_with_autograd(q, k, v, layout=layout, options=options,
                                                    stats=library_stats)
    else:
        out, lse, _ = _core.forward(fw, q, k, v, layout=layout, options=options,
                                    want_lse=return_lse, stats=library_stats)
    result = (out, lse) if return_lse else (out,)
    if stats is not None:
        result += (stats,)
    return result if len(result) > 1 else out


attention.__doc__ = """Scaled dot-product attention: ``softmax(scale·q·kᵀ + mask)·v``.

    Returns ``out`` (a new array of the caller's type, dtype and layout, shaped like q
    with v's last dimension), or ``(out, lse)`` with ``return_lse=True``, where
    ``lse [B, Hq, Nq]`` is each row's log-sum-exp (what attention_backward needs);
    with ``return_stats=True`` the statistics dict comes last: ``(out, stats)`` or
    ``(out, lse, stats)``.

    With torch tensors the call is the operator ``torch.ops.qkv.attention_forward`` and
    autograd differentiates it through qkv's backward (lse itself is not
    differentiable; a float mask that requires grad raises NotImplementedError).
""" + _stats.STATS_DOC + _COMMON_DOC


def attention_backward(q, k, v, out, lse, dout, *, causal=None, mask=None, scale=None,
                       key_lengths=None, layout="bhsd", backend="auto", threads=None,
                       check_finite=False):
    fn = "qkv.attention_backward"
    fw = framework_of(fn, q=q, k=k, v=v, out=out, lse=lse, dout=dout, mask=mask)
    check_layout(fn, layout)
    check_rank4(fn, layout, q=q, k=k, v=v, out=out, dout=dout)
    options = make_options(fn, fw, mask=mask, key_lengths=key_lengths, scale=scale,
                           causal=causal, backend=backend, threads=threads,
                           check_finite=check_finite)
    return _core.backward(fw, q, k, v, out, lse, dout, layout=layout, options=options)


attention_backward.__doc__ = """Gradients of attention: ``(dq, dk, dv)`` given the
    forward's ``out`` and ``lse`` (from ``attention(..., return_lse=True)``) and
    ``dout = ∂L/∂out``, with the same options as the forward. Each gradient is a new
    array shaped like q, k, v in the same layout. Never records an autograd graph.

        dv = Pᵀ·dout,  dP = dout·vᵀ,  dS_i = P_i ⊙ (dP_i − ⟨dout_i, out_i⟩),
        dq = scale·dS·k,  dk = scale·dSᵀ·q       (with GQA, dk and dv sum over the
                                                  query heads sharing a kv head)
""" + _COMMON_DOC


def attention_weights(q, k, v, *, causal=None, mask=None, scale=None, key_lengths=None,
                      layout="bhsd", threads=None, check_finite=False):
    fn = "qkv.attention_weights"
    fw = framework_of(fn, q=q, k=k, v=v, mask=mask)
    check_layout(fn, layout)
    check_rank4(fn, layout, q=q, k=k, v=v)
    options = make_options(fn, fw, mask=mask, key_lengths=key_lengths, scale=scale,
                           causal=causal, backend="reference", threads=threads,
                           check_finite=check_finite)
    _, _, weights = _core.forward(fw, q, k, v, layout=layout, options=options,
                                  want_lse=False, want_weights=True)
    return weights


attention_weights.__doc__ = """The attention weights ``P = softmax(scale·q·kᵀ + mask)``,
    ``[B, Hq, Nq, Nk]``, as the exact reference backend computes them (fp64, rounded to
    the input dtype once), for inspection: each row sums to 1, or is all 0 when every
    key is removed. Not differentiable. Takes attention's arguments (no backend).
""" + _COMMON_DOC


@functools.cache
def available_backends():
    """The backends this build runs, e.g. ``("auto", "reference")`` or
    ``("auto", "reference", "cpu")``: each is tried once on a 1×1×1×1 problem."""
    return tuple(name for name in ("auto", "reference", "cpu")
                 if _qkv.backend_available(name))


__all__ = ["attention", "attention_backward", "attention_weights", "available_backends"]
