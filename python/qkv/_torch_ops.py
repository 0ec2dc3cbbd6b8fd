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

Every tensor argument is already in its final form: masks 4-D, key_lengths int64,
alibi_slopes and sinks float32 [Hq], the dropout seed an int64 scalar tensor (a tensor,
not an int, so that a compiled graph draws a new one per call: draw_seed), a block mask
(qkv.flex_attention) as its state, slot and bytes tensors. The variants (window, ALiBi,
soft-cap, sinks, dropout, block mask) are trailing arguments with defaults that mean
"off"; one schema string (options_schema) declares them for every operator. The log-sum-exp output is not differentiable (qkv's backward takes no gradient
for it); double backward raises.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import _core
from ._arrays import Torch, dims
from ._options import Options, per_head_vector

# A thread count meaning "torch.get_num_threads() when the call runs", resolved inside
# the operators so that torch.compile, which cannot trace get_num_threads, never sees it.
TORCH_THREADS = -(1 << 30)


@torch.compiler.assume_constant_result
def _checked_scalars(function, scale, causal, backend, threads, check_finite,
                     window=None, softcap=None, dropout_p=0.0) -> tuple:
    """(scale, causal name, backend name, threads, check_finite, window left, window
    right, softcap, dropout_p) as Options binds them, its setter checking each. Under
    torch.compile dynamo runs this while tracing (its arguments are constants) and keeps
    the result instead of tracing into nanobind."""
    o = Options(function, causal, scale, backend, threads, check_finite, window=window,
                softcap=softcap, dropout_p=dropout_p)
    left, right = o.window
    return (o.scale, o.causal_name, o.backend_name, o.threads, o.check_finite, left, right,
            o.softcap, o.dropout_p)


def seed_tensor(seed: int) -> Tensor:
    """A dropout seed in [0, 2**64) as the operators' int64 scalar (two's complement)."""
    seed = int(seed) % (1 << 64)
    return torch.tensor(seed - (1 << 64) if seed >= 1 << 63 else seed, dtype=torch.int64)


@torch.library.custom_op("qkv::draw_seed", mutates_args=(),
                         tags=(torch.Tag.nondeterministic_seeded,))
def draw_seed(like: Tensor) -> Tensor:
    """A dropout seed drawn from torch's default generator exactly as an eager call draws
    it (_arrays._torch_random_seed), so that a compiled run after torch.manual_seed
    reproduces the eager one; an operator, so that no compiler replaces the draw by its
    own random numbers. `like` only names the device."""
    return torch.randint(0, 2**63 - 1, (), dtype=torch.int64)


@draw_seed.register_fake
def _(like):
    return torch.empty((), dtype=torch.int64, device=like.device)


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
    window_left: int = -1
    window_right: int = -1
    alibi_slopes: Optional[Tensor] = None
    softcap: float = 0.0
    sinks: Optional[Tensor] = None
    dropout_p: float = 0.0
    seed: Optional[Tensor] = None
    # A block-sparse mask (qkv.flex_attention; qkv/block_sparse.hpp): state, slot and
    # bytes tensors and the block sizes, or None / 0.
    block_state: Optional[Tensor] = None
    block_slot: Optional[Tensor] = None
    block_bytes: Optional[Tensor] = None
    block_q: int = 0
    block_k: int = 0

    @staticmethod
    def of(options: Options, layout: str) -> "OpArgs":
        left, right = options.window
        seed = seed_tensor(options.seed) if options.dropout_p else None
        blocks = options.fields()["block_mask"] if options.has_variants() else None
        blocks = (None, None, None, 0, 0) if blocks is None else blocks
        return OpArgs(options.keep, options.bias, options.key_lengths, options.scale,
                      options.causal_name, layout, options.backend_name, options.threads,
                      options.check_finite, left, right, options.alibi_slopes,
                      options.softcap, options.sinks, options.dropout_p, seed, *blocks)

    @staticmethod
    def plain(function, keep, bias, key_lengths, scale, causal, layout, backend, threads,
              check_finite, like=None, window=None, alibi_slopes=None, softcap=None,
              sinks=None, dropout_p=0.0, seed=None) -> "OpArgs":
        """From a traced call's keywords: the scalars checked and converted by the same
        C++ setter as an eager call's (so a bad value gets the same error), as the plain
        values the schema takes. With dropout and no seed, the seed is drawn in the
        graph (draw_seed, from `like`'s device), once per call as eagerly."""
        (scale, causal, backend, threads, check_finite, left, right, softcap,
         dropout_p) = _checked_scalars(function, scale, causal, backend, threads,
                                       check_finite, window, softcap, dropout_p)
        alibi_slopes = per_head_vector(function, Torch, "alibi_slopes", alibi_slopes)
        sinks = per_head_vector(function, Torch, "sinks", sinks)
        if dropout_p:
            seed = draw_seed(like) if seed is None else seed_tensor(seed)
        else:
            seed = None
        return OpArgs(keep, bias, key_lengths, scale, causal, layout, backend, threads,
                      check_finite, left, right, alibi_slopes, softcap, sinks, dropout_p,
                      seed)

    def has_variants(self) -> bool:
        return bool(self.window_left != -1 or self.window_right != -1
                    or self.alibi_slopes is not None or self.softcap or self.sinks is not None
                    or self.dropout_p or self.block_state is not None)

    def options(self) -> Options:
        """The bound Options of one operator call (TORCH_THREADS resolved now)."""
        threads = torch.get_num_threads() if self.threads == TORCH_THREADS else self.threads
        options = Options("torch.ops.qkv", self.causal, self.scale, self.backend, threads,
                          self.check_finite, self.keep, self.bias, self.key_lengths)
        if not self.has_variants():
            return options
        seed = None if self.seed is None else int(self.seed) % (1 << 64)
        blocks = None
        if self.block_state is not None:
            blocks = (self.block_state, self.block_slot, self.block_bytes, self.block_q,
                      self.block_k)
        return options.replace(window=(self.window_left, self.window_right),
                               alibi_slopes=self.alibi_slopes, softcap=self.softcap,
                               sinks=self.sinks, dropout_p=self.dropout_p, seed=seed,
                               block_mask=blocks)

    def without_tensors(self) -> "OpArgs":
        """For ctx: the tensors travel through save_for_backward instead."""
        return self._replace(**dict.fromkeys(_TENSOR_FIELDS))

    def tensors(self) -> tuple:
        return tuple(getattr(self, name) for name in _TENSOR_FIELDS)

    def with_tensors(self, tensors) -> "OpArgs":
        return self._replace(**dict(zip(_TENSOR_FIELDS, tensors)))


_TENSOR_FIELDS = ("keep", "bias", "key_lengths", "alibi_slopes", "sinks", "seed",
                  "block_state", "block_slot", "block_bytes")
_NO_GRADS = (None,) * len(OpArgs._fields)
# Where the differentiable per-head vectors sit among an operator's OpArgs.
SLOPES_AT, SINKS_AT = OpArgs._fields.index("alibi_slopes"), OpArgs._fields.index("sinks")

# OpArgs in an operator's schema (torch.library's syntax), written once for every
# operator that takes the options: `defaults=False` for one whose arguments continue
# without defaults.
_SCHEMA_TYPES = {"keep": "Tensor?", "bias": "Tensor?", "key_lengths": "Tensor?",
                 "scale": "float?", "causal": "str", "layout": "str", "backend": "str",
                 "threads": "int", "check_finite": "bool", "window_left": "int",
                 "window_right": "int", "alibi_slopes": "Tensor?", "softcap": "float",
                 "sinks": "Tensor?", "dropout_p": "float", "seed": "Tensor?",
                 "block_state": "Tensor?", "block_slot": "Tensor?", "block_bytes": "Tensor?",
                 "block_q": "int", "block_k": "int"}


def options_schema(defaults: bool = True) -> str:
    def one(name):
        default = OpArgs._field_defaults.get(name, ...)
        if not defaults or default is ...:
            return f"{_SCHEMA_TYPES[name]} {name}"
        return f"{_SCHEMA_TYPES[name]} {name}={'None' if default is None else default}"

    return ", ".join(one(name) for name in OpArgs._fields)


GRAD_FLAGS_SCHEMA = "bool grad_sinks=False, bool grad_slopes=False"
BACKWARD_RETURNS = "(Tensor, Tensor, Tensor, Tensor, Tensor)"


@torch.library.custom_op(
    "qkv::attention_forward", mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, {options_schema()}) -> (Tensor, Tensor)")
def attention_forward(q, k, v, *settings):
    args = OpArgs(*settings)
    layout = args.layout
    out, lse, _ = _core.forward(Torch, q, k, v, layout=layout, options=args.options(),
                                want_lse=True)
    return out, lse


def dense_outputs(q, v, layout):
    """(out, lse) fakes of a dense call: out in q's layout with v's head dim, lse
    [B, Hq, Nq] (float32 for 16-bit q)."""
    batch, q_len, q_heads, _ = dims(q, layout)
    v_dim = dims(v, layout)[3]
    shape = (batch, q_heads, q_len, v_dim) if layout == "bhsd" else (batch, q_len, q_heads, v_dim)
    lse_dtype = torch.float32 if Torch.is_half(q) else q.dtype
    return q.new_empty(shape), q.new_empty((batch, q_heads, q_len), dtype=lse_dtype)


@attention_forward.register_fake
def _(q, k, v, *settings):
    return dense_outputs(q, v, OpArgs(*settings).layout)


@torch.library.custom_op(
    "qkv::attention_backward", mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout, "
           f"{options_schema()}, {GRAD_FLAGS_SCHEMA}) -> {BACKWARD_RETURNS}")
def attention_backward(q, k, v, out, lse, dout, *settings):
    """(dq, dk, dv, dsinks, dslopes); dsinks and dslopes are float32 [Hq] when asked
    (grad_sinks, grad_slopes), else empty."""
    args, grad_sinks, grad_slopes = split_grad_flags(settings)
    layout = args.layout
    dsinks, dslopes = vector_grads(q, args, grad_sinks, grad_slopes)
    dq, dk, dv = _core.backward(Torch, q, k, v, out, lse, dout, layout=layout,
                                options=args.options(), dsinks=dsinks if grad_sinks else None,
                                dalibi=dslopes if grad_slopes else None)
    return dq, dk, dv, dsinks, dslopes


def vector_grads(q, args: OpArgs, grad_sinks: bool, grad_slopes: bool):
    """(dsinks, dslopes): float32 [Hq] where asked for, else empty tensors."""
    def one(wanted, vector):
        size = tuple(vector.shape) if wanted and vector is not None else (0,)
        return torch.empty(size, dtype=torch.float32, device=q.device)

    return one(grad_sinks, args.sinks), one(grad_slopes, args.alibi_slopes)


def split_grad_flags(settings):
    """(OpArgs, grad_sinks, grad_slopes) of a backward operator's arguments after its
    tensors (trailing defaults may be left out)."""
    grad_sinks, grad_slopes = (tuple(settings[len(OpArgs._fields):]) + (False, False))[:2]
    return OpArgs(*settings[:len(OpArgs._fields)]), grad_sinks, grad_slopes


@attention_backward.register_fake
def _(q, k, v, out, lse, dout, *settings):
    args, grad_sinks, grad_slopes = split_grad_flags(settings)
    return (q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(v.shape),
            *vector_grads(q, args, grad_sinks, grad_slopes))


def save_for_backward(ctx, tensors, args: OpArgs, out, lse):
    """ctx of an operator's autograd formula: the call's tensors, out and lse, and the
    options (their tensors saved, the rest kept as plain values)."""
    ctx.save_for_backward(*tensors, out, lse, *args.tensors())
    ctx.args = args.without_tensors()
    ctx.mark_non_differentiable(lse)


def restore(ctx, count):
    """(the first `count` saved tensors, out, lse, the OpArgs)."""
    saved = ctx.saved_tensors
    return saved[:count], saved[count], saved[count + 1], ctx.args.with_tensors(saved[count + 2:])


def vector_grads_wanted(ctx, first_option: int):
    """(grad_sinks, grad_slopes) from ctx.needs_input_grad, which lists only the inputs
    the dispatcher kept: it drops trailing arguments equal to their defaults (None)."""
    needs = ctx.needs_input_grad

    def wanted(at):
        return len(needs) > first_option + at and bool(needs[first_option + at])

    return wanted(SINKS_AT), wanted(SLOPES_AT)


def option_grads(ctx, first_option, dsinks, dslopes, grad_sinks, grad_slopes):
    """The gradients of an operator's OpArgs inputs, as many as autograd has inputs."""
    grads = list(_NO_GRADS)
    grads[SINKS_AT] = dsinks if grad_sinks else None
    grads[SLOPES_AT] = dslopes if grad_slopes else None
    return tuple(grads[:len(ctx.needs_input_grad) - first_option])


def _setup_context(ctx, inputs, output):
    q, k, v, *settings = inputs
    save_for_backward(ctx, (q, k, v), OpArgs(*settings), *output)


def _backward(ctx, dout, _dlse):
    (q, k, v), out, lse, args = restore(ctx, 3)
    grad_sinks, grad_slopes = vector_grads_wanted(ctx, 3)
    # Autograd may hand us an expanded gradient (stride 0 everywhere, from out.sum()).
    dout = Torch.inner_contiguous(dout)
    dq, dk, dv, dsinks, dslopes = attention_backward(q, k, v, out, lse, dout, *args,
                                                     grad_sinks, grad_slopes)
    return (dq, dk, dv, *option_grads(ctx, 3, dsinks, dslopes, grad_sinks, grad_slopes))


attention_forward.register_autograd(_backward, setup_context=_setup_context)


def traced(q, k, v) -> bool:
    """Whether this call is being traced (torch.compile) or gets tensor subclasses
    (fake tensors): then it must go through the operators, with plain arguments."""
    return (torch.compiler.is_compiling()
            or not (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor))


def refuse_precision_when_traced(precision) -> None:
    """The traced operators do not carry `precision` yet: a traced call with it would
    silently compute the default, so it is refused (eager calls take it)."""
    if precision is not None:
        raise NotImplementedError("qkv: precision= is not traced by torch.compile or fake tensors yet; "
                                  "call without it (the default, 'fast') or eagerly")


def refuse_stats_when_traced(stats) -> None:
    if stats is not None:
        raise NotImplementedError(
            "qkv: attention statistics (return_stats) are computed by eager calls on "
            "plain tensors only, not under torch.compile or with tensor subclasses")


def traced_forward(q, k, v, args: OpArgs, stats=None):
    """(out, lse) of a traced call: the operator, with the options as plain values (a
    bound Options is not traceable; the operator binds one when it runs)."""
    refuse_stats_when_traced(stats)
    refuse_bias_gradient(args.bias)
    return attention_forward(q, k, v, *args)


def refuse_bias_gradient(bias) -> None:
    if bias is not None and bias.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            "qkv: the gradient with respect to a float attention mask is not implemented "
            "yet; pass the mask detached (mask.detach()) if it is not being trained")
