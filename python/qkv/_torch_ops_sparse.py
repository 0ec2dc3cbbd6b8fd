"""The operators torch.ops.qkv.sparse_attention and sparse_attention_backward
(torch.library.custom_op): sparse attention as torch.compile, torch.export and fake
tensors see it, with fake-tensor shape functions and the backward registered as the
forward's autograd formula (gradients for q, k, v and sinks; indices are integers).
The options are plain schema values that the operator binds into one Options when it
runs, checked by the same C++ setters as every other call."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._core import sparse_backward, sparse_forward
from ._arrays import Torch, dims
from ._options import Options, per_head_vector
from ._torch_ops import TORCH_THREADS, _checked_scalars

_SETTINGS = ("float? scale, str causal, str layout, str backend, int threads, "
             "float softcap=0.0, Tensor? sinks=None, str precision=\"fast\"")
# Where sinks sits among the forward's inputs (q, k, v, indices, then _SETTINGS).
_SINKS_AT = 10


def _options(scale, causal, backend, threads, softcap, sinks, precision) -> Options:
    threads = torch.get_num_threads() if threads == TORCH_THREADS else threads
    options = Options("torch.ops.qkv.sparse_attention", causal, scale, backend, threads, False,
                      precision=precision)
    if softcap or sinks is not None:
        options = options.replace(softcap=softcap, sinks=sinks)
    return options


@torch.library.custom_op("qkv::sparse_attention", mutates_args=(),
                         schema=f"(Tensor q, Tensor k, Tensor v, Tensor indices, {_SETTINGS}) "
                                "-> (Tensor, Tensor)")
def sparse_attention(q, k, v, indices, scale, causal, layout, backend, threads, softcap=0.0,
                     sinks=None, precision="fast"):
    options = _options(scale, causal, backend, threads, softcap, sinks, precision)
    return sparse_forward(Torch, q, k, v, indices, layout=layout, options=options,
                           want_lse=True)


@sparse_attention.register_fake
def _(q, k, v, indices, scale, causal, layout, backend, threads, softcap=0.0, sinks=None,
      precision="fast"):
    batch, q_len, q_heads, _ = dims(q, layout)
    out = q.new_empty((*q.shape[:3], v.shape[3]))
    lse_dtype = torch.float32 if Torch.is_half(q) else q.dtype
    return out, q.new_empty((batch, q_heads, q_len), dtype=lse_dtype)


@torch.library.custom_op(
    "qkv::sparse_attention_backward", mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, Tensor indices, Tensor out, Tensor lse, Tensor dout, "
           f"{_SETTINGS}, bool grad_sinks=False) -> (Tensor, Tensor, Tensor, Tensor)")
def sparse_attention_backward(q, k, v, indices, out, lse, dout, scale, causal, layout, backend,
                              threads, softcap=0.0, sinks=None, precision="fast", grad_sinks=False):
    """(dq, dk, dv, dsinks); dsinks float32 [Hq] when grad_sinks, else empty. (The
    backward's arithmetic is float32 in either precision; it is checked the same way.)"""
    options = _options(scale, causal, backend, threads, softcap, sinks, precision)
    dsinks = _dsinks(q, sinks, grad_sinks)
    dq, dk, dv = sparse_backward(Torch, q, k, v, indices, out, lse, dout, layout=layout,
                                  options=options, dsinks=dsinks if grad_sinks else None)
    return dq, dk, dv, dsinks


def _dsinks(q, sinks: Optional[Tensor], wanted: bool) -> Tensor:
    size = tuple(sinks.shape) if wanted and sinks is not None else (0,)
    return torch.empty(size, dtype=torch.float32, device=q.device)


@sparse_attention_backward.register_fake
def _(q, k, v, indices, out, lse, dout, scale, causal, layout, backend, threads, softcap=0.0,
      sinks=None, precision="fast", grad_sinks=False):
    return q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(v.shape), _dsinks(q, sinks, grad_sinks)


def _setup_context(ctx, inputs, output):
    q, k, v, indices, *settings = inputs
    out, lse = output
    softcap = settings[5] if len(settings) > 5 else 0.0  # trailing defaults may be absent
    sinks = settings[6] if len(settings) > 6 else None
    ctx.precision = settings[7] if len(settings) > 7 else "fast"
    ctx.save_for_backward(q, k, v, indices, out, lse, sinks)
    ctx.settings = (*settings[:5], softcap)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, indices, out, lse, sinks = ctx.saved_tensors
    needs = ctx.needs_input_grad  # the dispatcher may drop trailing default inputs
    grad_sinks = sinks is not None and len(needs) > _SINKS_AT and bool(needs[_SINKS_AT])
    # Autograd may hand over an expanded gradient (stride 0 everywhere, from out.sum()).
    dout = Torch.inner_contiguous(dout)
    dq, dk, dv, dsinks = sparse_attention_backward(q, k, v, indices, out, lse, dout,
                                                   *ctx.settings, sinks, ctx.precision, grad_sinks)
    grads = [dq, dk, dv] + [None] * (_SINKS_AT - 3) + [dsinks if grad_sinks else None, None]
    return tuple(grads[:len(needs)])


sparse_attention.register_autograd(_backward, setup_context=_setup_context)


def call(fn, q, k, v, indices, *, scale, causal, sinks, softcap, layout, threads, backend,
         precision=None):
    """(out, lse) of qkv.sparse_attention on torch tensors: the operator, the scalars
    checked first by the same C++ setter as every call (so a bad value gets the same
    error, eagerly or while tracing)."""
    (scale, causal, backend, threads, _, _, _, softcap, _) = _checked_scalars(
        fn, scale, causal, backend, threads, False, None, softcap, 0.0)
    sinks = per_head_vector(fn, Torch, "sinks", sinks)
    if precision is None:
        return sparse_attention(q, k, v, indices, scale, causal, layout, backend, threads, softcap,
                                sinks)
    Options(fn, None, None, "auto", 1, False, precision=precision)  # the C++ setter's check and error
    return sparse_attention(q, k, v, indices, scale, causal, layout, backend, threads, softcap,
                            sinks, precision)
