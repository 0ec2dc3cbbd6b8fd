"""The operators torch.ops.qkv.varlen_forward and varlen_backward: qkv.varlen_attention
as torch.compile and fake tensors see it, with its autograd formula (the sinks' and
ALiBi slopes' gradients included). The options are _torch_ops.OpArgs (the dense
operators' plain values; keep, bias and key_lengths are always None here, layout
"packed"); the sequences are the cu_seqlens tensors and the max_seqlen bounds (0: not
given)."""

from __future__ import annotations

import torch
from torch import Tensor

from ._arrays import Torch
from ._torch_ops import (BACKWARD_RETURNS, GRAD_FLAGS_SCHEMA, OpArgs, option_grads,
                         options_schema, restore, save_for_backward, split_grad_flags,
                         vector_grads, vector_grads_wanted)

# Where OpArgs begins among varlen_forward's inputs (after q, k, v, cu_q, cu_k, max_q, max_k).
_FIRST_OPTION = 7


def _packed(cu_q, cu_k, max_q, max_k):
    from ._core import Packed

    return Packed(Torch.for_library(cu_q), Torch.for_library(cu_k), max_q, max_k)


@torch.library.custom_op(
    "qkv::varlen_forward", mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_k, int max_q, int max_k, "
           f"{options_schema()}) -> (Tensor, Tensor)")
def varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, *settings):
    args = OpArgs(*settings)
    return _packed(cu_q, cu_k, max_q, max_k).forward(q, k, v, args.options(), None, True)


@varlen_forward.register_fake
def _(q, k, v, *rest):
    lse_dtype = torch.float32 if Torch.is_half(q) else q.dtype
    return (q.new_empty((q.shape[0], q.shape[1], v.shape[2])),
            q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dtype))


@torch.library.custom_op(
    "qkv::varlen_backward", mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout, Tensor cu_q, "
           f"Tensor cu_k, int max_q, int max_k, {options_schema()}, {GRAD_FLAGS_SCHEMA}) "
           f"-> {BACKWARD_RETURNS}")
def varlen_backward(q, k, v, out, lse, dout, cu_q, cu_k, max_q, max_k, *settings):
    """(dq, dk, dv, dsinks, dslopes), the last two empty unless asked for."""
    args, grad_sinks, grad_slopes = split_grad_flags(settings)
    dsinks, dslopes = vector_grads(q, args, grad_sinks, grad_slopes)
    dq, dk, dv = _packed(cu_q, cu_k, max_q, max_k).backward(
        q, k, v, out, lse, dout, args.options(), dsinks if grad_sinks else None,
        dslopes if grad_slopes else None)
    return dq, dk, dv, dsinks, dslopes


@varlen_backward.register_fake
def _(q, k, v, out, lse, dout, cu_q, cu_k, max_q, max_k, *settings):
    args, grad_sinks, grad_slopes = split_grad_flags(settings)
    return (q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(v.shape),
            *vector_grads(q, args, grad_sinks, grad_slopes))


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, *settings = inputs
    save_for_backward(ctx, (q, k, v, cu_q, cu_k), OpArgs(*settings), *output)
    ctx.max_lengths = (max_q, max_k)


def _backward(ctx, dout, _dlse):
    (q, k, v, cu_q, cu_k), out, lse, args = restore(ctx, 5)
    grad_sinks, grad_slopes = vector_grads_wanted(ctx, _FIRST_OPTION)
    dout = Torch.inner_contiguous(dout)
    dq, dk, dv, dsinks, dslopes = varlen_backward(q, k, v, out, lse, dout, cu_q, cu_k,
                                                  *ctx.max_lengths, *args, grad_sinks,
                                                  grad_slopes)
    return (dq, dk, dv, None, None, None, None,
            *option_grads(ctx, _FIRST_OPTION, dsinks, dslopes, grad_sinks, grad_slopes))


varlen_forward.register_autograd(_backward, setup_context=_setup_context)


def traced_varlen(fn, q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, threads, backend,
                  variants):
    """(out, lse) of qkv.varlen_attention on traced torch tensors: the operator."""
    def offsets(values):
        return values if isinstance(values, Tensor) else torch.tensor(values, dtype=torch.int64)

    args = OpArgs.plain(fn, None, None, None, scale, causal, "packed", backend, threads, False,
                        like=q, **variants)
    return varlen_forward(q, k, v, offsets(cu_q), offsets(cu_k), int(max_q or 0),
                          int(max_k or 0), *args)


__all__ = ["traced_varlen", "varlen_backward", "varlen_forward"]
