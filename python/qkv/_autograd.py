"""qkv's attention inside PyTorch autograd for eager calls: one autograd.Function for
every call, dense or packed (varlen), with or without variants and statistics.

The Function does not know the call's shape of arguments: it runs a *call* object (Dense
here, _core.Packed) that says how to run the library's forward and backward:

    call.forward(q, k, v, options, stats, want_lse) -> (out, lse)
    call.backward(q, k, v, out, lse, dout, options, dsinks, dslopes) -> (dq, dk, dv)
    call.backward_operator(options) -> OpArgs or None

The sinks and ALiBi slopes are Function inputs (when torch tensors) so that they get
their gradients. Between forward and backward the options are kept as their plain
fields (Options.fields()), never as the bound object: a graph still alive when the
interpreter exits then holds no qkv._qkv instance for nanobind to report as leaked.

Traced calls (torch.compile, fake tensors) go through the operators of _torch_ops
instead, which have the same forward and backward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _core
from ._arrays import Torch
from ._options import Options
from ._torch_ops import (TORCH_THREADS, OpArgs, attention_backward, attention_forward,
                         refuse_stats_when_traced, traced)


def _resolved(options: Options) -> Options:
    """TORCH_THREADS (torch's thread count when the call runs) made a count."""
    if options.threads == TORCH_THREADS:
        return options.replace(threads=torch.get_num_threads())
    return options


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, slopes, call, options, stats):
        changes = {}
        if sinks is not None:
            changes["sinks"] = sinks.detach()
        if slopes is not None:
            changes["alibi_slopes"] = slopes.detach()
        if changes:
            options = options.replace(**changes)
        out, lse = call.forward(q, k, v, options, stats, True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call, ctx.fields = call, options.fields()
        ctx.grad_sinks = sinks is not None and ctx.needs_input_grad[3]
        ctx.grad_slopes = slopes is not None and ctx.needs_input_grad[4]
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        options = Options("qkv", **ctx.fields)
        dout = Torch.inner_contiguous(dout)
        if torch.is_grad_enabled():
            # create_graph=True: through the backward operator where there is one (dense,
            # no variants), which has no autograd formula, so differentiating these
            # gradients again raises instead of silently treating them as constants.
            args = ctx.call.backward_operator(options)
            if args is not None:
                q, k, v, out, lse = ctx.saved_tensors
                return (*attention_backward(q, k, v, out, lse, dout, *args)[:3],
                        None, None, None, None, None)
        return _backward(ctx, options, dout)


@torch.autograd.function.once_differentiable
def _backward(ctx, options, dout):
    q, k, v, out, lse = ctx.saved_tensors
    dsinks = dslopes = None
    if ctx.grad_sinks:
        dsinks = torch.empty(tuple(options.sinks.shape), dtype=torch.float32)
    if ctx.grad_slopes:
        dslopes = torch.empty(tuple(options.alibi_slopes.shape), dtype=torch.float32)
    dq, dk, dv = ctx.call.backward(q, k, v, out, lse, dout, options, dsinks, dslopes)
    return dq, dk, dv, dsinks, dslopes, None, None, None


class Dense(NamedTuple):
    """A call of qkv.attention: [batch, ...] arrays in `layout`."""

    layout: str

    def forward(self, q, k, v, options, stats, want_lse):
        out, lse, _ = _core.forward(Torch, q, k, v, layout=self.layout, options=options,
                                    want_lse=want_lse, stats=stats)
        return out, lse

    def backward(self, q, k, v, out, lse, dout, options, dsinks, dslopes):
        return _core.backward(Torch, q, k, v, out, lse, dout, layout=self.layout,
                              options=options, dsinks=dsinks, dalibi=dslopes)

    def backward_operator(self, options):
        return None if options.has_variants() else OpArgs.of(options, self.layout)


def refuse_bias_gradient(options: Options) -> None:
    bias = options.bias
    if bias is not None and bias.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            "qkv: the gradient with respect to a float attention mask is not implemented "
            "yet; pass the mask detached (mask.detach()) if it is not being trained")


def run(call, q, k, v, options: Options, stats=None, want_lse: bool = True):
    """(out, lse) of an eager call, through _Attention when autograd needs a graph (an
    input, the sinks or the ALiBi slopes require grad); lse may be None when not wanted
    and no graph is recorded."""
    refuse_bias_gradient(options)
    options = _resolved(options)
    sinks, slopes = options.sinks, options.alibi_slopes
    sinks = sinks if isinstance(sinks, torch.Tensor) else None
    slopes = slopes if isinstance(slopes, torch.Tensor) else None  # a NumPy value has no gradient
    if torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad
            or (sinks is not None and sinks.requires_grad)
            or (slopes is not None and slopes.requires_grad)):
        return _Attention.apply(q, k, v, sinks, slopes, call, options, stats)
    return call.forward(q, k, v, options, stats, want_lse)


def forward_with_autograd(q, k, v, *, layout: str, options: Options, stats=None,
                          want_lse: bool = True):
    """(out, lse) of qkv.attention on torch tensors, recorded by autograd when needed.

    Eager calls with plain CPU tensors run the library directly (run above); traced
    calls (torch.compile, fake tensors) go through the operator
    torch.ops.qkv.attention_forward, whose autograd formula is the same (variants
    included; the seed is the one `options` holds). `stats`: None
    or the library's dict of statistics outputs (_stats.for_library), filled by the same
    forward; eager calls only (the operator has no such output)."""
    if traced(q, k, v):
        refuse_stats_when_traced(stats)
        refuse_bias_gradient(options)
        return attention_forward(q, k, v, *OpArgs.of(options, layout))
    return run(Dense(layout), q, k, v, options, stats, want_lse)


__all__ = ["Dense", "forward_with_autograd", "run"]
