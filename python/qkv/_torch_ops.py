"""The operators torch.ops.qkv.attention_forward and attention_backward
(torch.library.custom_op): what torch.compile and fake-tensor tracing see of qkv, with
fake-tensor shape functions and the backward registered as the forward's autograd
formula; torch.library.opcheck checks them. Their schema takes the options as plain
values (OpArgs: tensors, floats, strings, ints), which the operator binds into one
Options when it runs, so a traced call's values are checked by the same C++ setter as an
eager call's.

Eager calls take the cheaper road of _autograd (one autograd.Function, about ten times
cheaper per call than a Python custom op's autograd wrapper) to the same library calls
(_core.forward and _core.backward); it uses attention_backward here for create_graph.

Every tensor argument is already in its final form: masks 4-D, key_lengths int64. The
log-sum-exp output is not differentiable (qkv's backward takes no gradient for it);
double backward raises.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from . import _core
from ._arrays import Torch, dims
from ._options import Options

# A thread count meaning "torch.get_num_threads() when the call runs", resolved inside
# the operators so that torch.compile, which cannot trace get_num_threads, never sees it.
TORCH_THREADS = -(1 << 30)


@torch.compiler.assume_constant_result
def _checked_scalars(function, scale, causal, backend, threads, check_finite) -> tuple:
    """(scale, causal name, backend name, threads, check_finite) as Options binds them,
    its setter checking each. Under torch.compile dynamo runs this while tracing (its
    arguments are constants) and keeps the result instead of tracing into nanobind."""
    o = Options(function, causal, scale, backend, threads, check_finite)
    return o.scale, o.causal_name, o.backend_name, o.threads, o.check_finite


class OpArgs(NamedTuple):
    """The operators' arguments after the tensors (q, k, v; the backward's out, lse,
    dout): the call's options as plain values, in the operators' order."""

    keep: Optional[Tensor]
    bias: Optional[Tensor]
    key_lengths: Optional[Tensor]
    scale: Optional[float]
    causal: str
    layout: str
    backend: str
    threads: int
    check_finite: bool

    @staticmethod
    def of(options: Options, layout: str) -> "OpArgs":
        return OpArgs(options.keep, options.bias, options.key_lengths, options.scale,
                      options.causal_name, layout, options.backend_name, options.threads,
                      options.check_finite)

    @staticmethod
    def plain(function, keep, bias, key_lengths, scale, causal, layout, backend, threads,
              check_finite) -> "OpArgs":
        """From a traced call's keywords: the scalars checked and converted by the same
        C++ setter as an eager call's (so a bad value gets the same error), as the plain
        values the schema takes."""
        scale, causal, backend, threads, check_finite = _checked_scalars(
            function, scale, causal, backend, threads, check_finite)
        return OpArgs(keep, bias, key_lengths, scale, causal, layout, backend, threads,
                      check_finite)

    def options(self) -> Options:
        """The bound Options of one operator call (TORCH_THREADS resolved now)."""
        threads = torch.get_num_threads() if self.threads == TORCH_THREADS else self.threads
        return Options("torch.ops.qkv", self.causal, self.scale, self.backend, threads,
                       self.check_finite, self.keep, self.bias, self.key_lengths)

    def without_tensors(self) -> "OpArgs":
        """For ctx: the tensors travel through save_for_backward instead."""
        return self._replace(keep=None, bias=None, key_lengths=None)


_NO_GRADS = (None,) * len(OpArgs._fields)


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
    args = OpArgs(keep, bias, key_lengths, scale, causal, layout, backend, threads, check_finite)
    out, lse, _ = _core.forward(Torch, q, k, v, layout=layout, options=args.options(),
                                want_lse=True)
    return out, lse


@attention_forward.register_fake
def _(q, k, v, *settings):
    layout = OpArgs(*settings).layout
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
    args = OpArgs(keep, bias, key_lengths, scale, causal, layout, backend, threads, check_finite)
    return _core.backward(Torch, q, k, v, out, lse, dout, layout=layout, options=args.options())


@attention_backward.register_fake
def _(q, k, v, out, lse, dout, *settings):
    return (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=q.dtype, device=q.device),
        torch.empty(v.shape, dtype=q.dtype, device=q.device),
    )


def _setup_context(ctx, inputs, output):
    q, k, v, *settings = inputs
    args = OpArgs(*settings)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, args.keep, args.bias, args.key_lengths)
    ctx.args = args.without_tensors()
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, keep, bias, key_lengths = ctx.saved_tensors
    args = ctx.args._replace(keep=keep, bias=bias, key_lengths=key_lengths)
    # Autograd may hand us an expanded gradient (stride 0 everywhere, from out.sum()).
    dout = Torch.inner_contiguous(dout)
    dq, dk, dv = attention_backward(q, k, v, out, lse, dout, *args)
    return (dq, dk, dv, *_NO_GRADS)


attention_forward.register_autograd(_backward, setup_context=_setup_context)


def traced(q, k, v) -> bool:
    """Whether this call is being traced (torch.compile) or gets tensor subclasses
    (fake tensors): then it must go through the operators, with plain arguments."""
    return (torch.compiler.is_compiling()
            or not (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor))


def refuse_variants_when_traced() -> None:
    raise NotImplementedError(
        "qkv: window, alibi_slopes, softcap, sinks and dropout are not traced by "
        "torch.compile or fake tensors yet; call qkv eagerly for them")


def refuse_stats_when_traced(stats) -> None:
    if stats is not None:
        raise NotImplementedError(
            "qkv: attention statistics (return_stats) are computed by eager calls on "
            "plain tensors only, not under torch.compile or with tensor subclasses")


def traced_forward(q, k, v, args: OpArgs, stats=None):
    """(out, lse) of a traced call: the operator, with the options as plain values (a
    bound Options is not traceable; the operator binds one when it runs)."""
    refuse_stats_when_traced(stats)
    bias = args.bias
    if bias is not None and bias.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            "qkv: the gradient with respect to a float attention mask is not implemented "
            "yet; pass the mask detached (mask.detach()) if it is not being trained")
    return attention_forward(q, k, v, *args)
