"""The operator torch.ops.qkv.attention_forward_stats: qkv.attention(...,
return_stats=True) as torch.compile and fake tensors see it. The dense forward's
arguments (_torch_ops.OpArgs) and the statistics' settings in; out, lse and the
statistics (_stats.HEAD_KEYS, then _stats.ROW_KEYS, empty unless row_stats) out, from
the same forward pass. out is differentiable through the dense backward operator; the
statistics, like lse, are not."""

from __future__ import annotations

import torch

from . import _core, _stats
from ._arrays import Torch, dims
from ._torch_ops import (OpArgs, attention_backward, dense_outputs, option_grads,
                         options_schema, restore, save_for_backward, vector_grads_wanted)


def _allocate(q, layout, row_stats):
    batch, q_len, q_heads, _ = dims(q, layout)
    stats = _stats.allocate(Torch, q, (batch, q_heads), (batch, q_heads, q_len) if row_stats else None)
    for key in _stats.ROW_KEYS:
        stats.setdefault(key, q.new_empty((0,), dtype=stats["max_weight_mean"].dtype))
    return stats


@torch.library.custom_op(
    "qkv::attention_forward_stats", mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, {options_schema(defaults=False)}, "
           f"float saturation_threshold, bool row_stats) -> ({', '.join(['Tensor'] * 9)})")
def attention_forward_stats(q, k, v, *settings):
    args = OpArgs(*settings[:len(OpArgs._fields)])
    saturation_threshold, row_stats = settings[len(OpArgs._fields):]
    layout = args.layout
    stats = _allocate(q, layout, row_stats)
    wanted = {key: array for key, array in stats.items() if array.numel() or key not in _stats.ROW_KEYS}
    out, lse, _ = _core.forward(Torch, q, k, v, layout=layout, options=args.options(),
                                want_lse=True,
                                stats=_stats.for_library(Torch, wanted, saturation_threshold))
    return (out, lse, *(stats[key] for key in (*_stats.HEAD_KEYS, *_stats.ROW_KEYS)))


@attention_forward_stats.register_fake
def _(q, k, v, *settings):
    args = OpArgs(*settings[:len(OpArgs._fields)])
    stats = _allocate(q, args.layout, settings[len(OpArgs._fields) + 1])
    return (*dense_outputs(q, v, args.layout),
            *(stats[key] for key in (*_stats.HEAD_KEYS, *_stats.ROW_KEYS)))


def _setup_context(ctx, inputs, output):
    q, k, v, *settings = inputs
    save_for_backward(ctx, (q, k, v), OpArgs(*settings[:len(OpArgs._fields)]), *output[:2])
    ctx.mark_non_differentiable(*output[1:])


def _backward(ctx, dout, *_):
    (q, k, v), out, lse, args = restore(ctx, 3)
    grad_sinks, grad_slopes = vector_grads_wanted(ctx, 3)
    dout = Torch.inner_contiguous(dout)
    dq, dk, dv, dsinks, dslopes = attention_backward(q, k, v, out, lse, dout, *args,
                                                     grad_sinks, grad_slopes)
    grads = option_grads(ctx, 3, dsinks, dslopes, grad_sinks, grad_slopes)
    return (dq, dk, dv, *grads, *(None,) * (len(ctx.needs_input_grad) - 3 - len(grads)))


attention_forward_stats.register_autograd(_backward, setup_context=_setup_context)


def traced_stats(q, k, v, args: OpArgs, row_stats: bool, threshold: float):
    """(out, lse, stats dict) of a traced qkv.attention(..., return_stats=True)."""
    out, lse, *values = attention_forward_stats(q, k, v, *args, threshold, row_stats)
    keys = _stats.HEAD_KEYS + (_stats.ROW_KEYS if row_stats else ())
    return out, lse, dict(zip(keys, values))


__all__ = ["attention_forward_stats", "traced_stats"]
