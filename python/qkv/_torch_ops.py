"""qkv's attention inside PyTorch autograd: two roads to the same library calls
(_core.forward and _core.backward).

- The operators torch.ops.qkv.attention_forward and attention_backward
  (torch.library.custom_op), with fake-tensor shape functions and the backward
  registered as the forward's autograd formula. torch.compile and fake-tensor tracing
  see these; torch.library.opcheck checks them.
- For eager calls, _Attention (an autograd.Function), about ten times cheaper per call
  than a Python custom op's autograd wrapper, or no autograd at all when no input
  requires grad.

Every tensor argument is already in its final form: masks 4-D, key_lengths int64. The
log-sum-exp output is not differentiable (qkv's backward takes no gradient for it);
double backward raises.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _core
from ._arrays import Torch, dims
from ._options import Options


# A thread count meaning "torch.get_num_threads() when the call runs", resolved inside
# the operators so that torch.compile, which cannot trace get_num_threads, never sees it.
TORCH_THREADS = -(1 << 30)


def _options(keep, bias, key_lengths, scale, causal, backend, threads, check_finite):
    if threads == TORCH_THREADS:
        threads = torch.get_num_threads()
    return Options(keep, bias, key_lengths, scale, causal, backend, threads, check_finite)


@torch.library.custom_op("qkv::attention_forward", mutates_args=())
def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keep: Optional[Tensor],
    bias: Optional[Tensor],
    key_lengths: Optional[Tensor],
    scale: Optional[float],
    causal: str,
    layout: str,
    backend: str,
    threads: int,
    check_finite: bool,
) -> Tuple[Tensor, Tensor]:
    options = _options(keep, bias, key_lengths, scale, causal, backend, threads, check_finite)
    out, lse, _ = _core.forward(Torch, q, k, v, layout=layout, options=options, want_lse=True)
    return out, lse


@attention_forward.register_fake
def _(q, k, v, keep, bias, key_lengths, scale, causal, layout, backend, threads, check_finite):
    batch, q_len, q_heads, _ = dims(q, layout)
    v_dim = dims(v, layout)[3]
    shape = (batch, q_heads, q_len, v_dim) if layout == "bhsd" else (batch, q_len, q_heads, v_dim)
    lse_dtype = torch.float32 if Torch.is_half(q) else q.dtype
    return q.new_empty(shape), q.new_empty((batch, q_heads, q_len), dtype=lse_dtype)


@torch.library.custom_op("qkv::attention_backward", mutates_args=())
def attention_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    keep: Optional[Tensor],
    bias: Optional[Tensor],
    key_lengths: Optional[Tensor],
    scale: Optional[float],
    causal: str,
    layout: str,
    backend: str,
    threads: int,
    check_finite: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    options = _options(keep, bias, key_lengths, scale, causal, backend, threads, check_finite)
    return _core.backward(Torch, q, k, v, out, lse, dout, layout=layout, options=options)


@attention_backward.register_fake
def _(q, k, v, out, lse, dout, keep, bias, key_lengths, scale, causal, layout, backend,
      threads, check_finite):
    return (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=q.dtype, device=q.device),
        torch.empty(v.shape, dtype=q.dtype, device=q.device),
    )


def _setup_context(ctx, inputs, output):
    (q, k, v, keep, bias, key_lengths, scale, causal, layout, backend, threads,
     check_finite) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, keep, bias, key_lengths)
    ctx.settings = (scale, causal, layout, backend, threads, check_finite)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, keep, bias, key_lengths = ctx.saved_tensors
    scale, causal, layout, backend, threads, check_finite = ctx.settings
    # Autograd may hand us an expanded gradient (stride 0 everywhere, from out.sum()).
    dout = Torch.inner_contiguous(dout)
    dq, dk, dv = attention_backward(q, k, v, out, lse, dout, keep, bias, key_lengths, scale,
                                    causal, layout, backend, threads, check_finite)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


attention_forward.register_autograd(_backward, setup_context=_setup_context)


class _Attention(torch.autograd.Function):
    """The eager path: the same forward and backward as the operators above, through an
    autograd.Function, which costs ~10× less per call than a Python custom op's
    autograd wrapper. (Traced code, under torch.compile or fake tensors, uses the
    operators.)"""

    @staticmethod
    def forward(ctx, q, k, v, keep, bias, key_lengths, scale, causal, layout, backend,
                threads, check_finite, stats=None):
        options = _options(keep, bias, key_lengths, scale, causal, backend, threads,
                           check_finite)
        out, lse, _ = _core.forward(Torch, q, k, v, layout=layout, options=options,
                                    want_lse=True, stats=stats)
        ctx.save_for_backward(q, k, v, out, lse, keep, bias, key_lengths)
        ctx.settings = (scale, causal, layout, backend, threads, check_finite)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, keep, bias, key_lengths = ctx.saved_tensors
        scale, causal, layout, backend, threads, check_finite = ctx.settings
        dout = Torch.inner_contiguous(dout)
        if torch.is_grad_enabled():
            # create_graph=True: through the backward operator, which has no autograd
            # formula, so differentiating these gradients again raises instead of
            # silently treating them as constants.
            grads = attention_backward(q, k, v, out, lse, dout, keep, bias, key_lengths,
                                       scale, causal, layout, backend, threads, check_finite)
        else:
            options = _options(keep, bias, key_lengths, scale, causal, backend, threads,
                               check_finite)
            grads = _core.backward(Torch, q, k, v, out, lse, dout, layout=layout,
                                   options=options)
        return (*grads, None, None, None, None, None, None, None, None, None, None)


def forward_with_autograd(q, k, v, *, layout: str, options: Options, stats=None):
    """(out, lse), recorded by autograd when an input requires grad.

    Eager calls with plain CPU tensors run the library directly, through _Attention when
    a graph is needed; traced calls (torch.compile, fake tensors) go through the
    operator torch.ops.qkv.attention_forward, whose autograd formula is the same.
    `stats`: None or the library's dict of statistics outputs (_stats.for_library),
    filled by the same forward; eager calls only (the operator has no such output)."""
    grad = torch.is_grad_enabled()
    if options.has_variants():  # window, ALiBi, soft-cap, sinks, dropout: eager only
        from . import _variants

        return _variants.forward_with_autograd(q, k, v, layout=layout, options=options,
                                               stats=stats)
    if options.bias is not None and options.bias.requires_grad and grad:
        raise NotImplementedError(
            "qkv: the gradient with respect to a float attention mask is not implemented "
            "yet; pass the mask detached (mask.detach()) if it is not being trained"
        )
    args = (q, k, v, options.keep, options.bias, options.key_lengths, options.scale,
            options.causal, layout, options.backend, options.threads, options.check_finite)
    if torch.compiler.is_compiling() or not all(type(x) is torch.Tensor for x in (q, k, v)):
        if stats is not None:
            raise NotImplementedError(
                "qkv: attention statistics (return_stats) are computed by eager calls on "
                "plain tensors only, not under torch.compile or with tensor subclasses"
            )
        return attention_forward(*args)
    if grad and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Attention.apply(*args, stats)
    if options.threads == TORCH_THREADS:
        options = dataclasses.replace(options, threads=torch.get_num_threads())
    out, lse, _ = _core.forward(Torch, q, k, v, layout=layout, options=options, want_lse=True,
                                stats=stats)
    return out, lse
