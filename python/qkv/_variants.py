"""Autograd for calls with variants (window, ALiBi, soft-cap, sinks, dropout): an
autograd.Function whose backward is qkv's, with the sinks' and the ALiBi slopes' gradients. Eager only for now:
the torch.library operators (torch.compile) take the plain options, so a traced call
with variants raises NotImplementedError instead of silently dropping them."""

from __future__ import annotations

import torch

from . import _core
from ._arrays import Torch


def _resolved(options):
    from ._torch_ops import TORCH_THREADS

    if options.threads == TORCH_THREADS:
        return options.replace(threads=torch.get_num_threads())
    return options


class _VariantAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, slopes, options, layout, stats=None):
        options = _resolved(options.replace(sinks=None if sinks is None else sinks.detach(),
                                            alibi_slopes=None if slopes is None else slopes.detach()))
        out, lse, _ = _core.forward(Torch, q, k, v, layout=layout, options=options, want_lse=True,
                                    stats=stats)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options, ctx.layout = options, layout
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        options = ctx.options
        dsinks = dslopes = None
        if options.sinks is not None and ctx.needs_input_grad[3]:
            dsinks = torch.empty(options.sinks.shape, dtype=torch.float32)
        if options.alibi_slopes is not None and ctx.needs_input_grad[4]:
            dslopes = torch.empty(options.alibi_slopes.shape, dtype=torch.float32)
        dq, dk, dv = _core.backward(Torch, q, k, v, out, lse, Torch.inner_contiguous(dout),
                                    layout=ctx.layout, options=options, dsinks=dsinks,
                                    dalibi=dslopes)
        return dq, dk, dv, dsinks, dslopes, None, None, None


def forward_with_autograd(q, k, v, *, layout: str, options, stats=None):
    """(out, lse) for a call with variants; sinks (a float tensor) get a gradient.
    `stats`: None or the library's statistics outputs, filled by the same forward."""
    if torch.compiler.is_compiling() or not all(type(x) is torch.Tensor for x in (q, k, v)):
        raise NotImplementedError(
            "qkv: window, alibi_slopes, softcap, sinks and dropout are not traced by "
            "torch.compile or fake tensors yet; call qkv eagerly for them")
    sinks, slopes = options.sinks, options.alibi_slopes
    if not isinstance(slopes, torch.Tensor):
        slopes = None  # a NumPy/list value has no gradient to track
    needs_graph = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad
        or (sinks is not None and sinks.requires_grad)
        or (slopes is not None and slopes.requires_grad))
    if needs_graph:
        return _VariantAttention.apply(q, k, v, sinks, slopes, options, layout, stats)
    out, lse, _ = _core.forward(Torch, q, k, v, layout=layout, options=_resolved(options),
                                want_lse=True, stats=stats)
    return out, lse
