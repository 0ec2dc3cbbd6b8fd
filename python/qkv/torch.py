"""qkv.torch — qkv inside PyTorch models.

``scaled_dot_product_attention`` takes the arguments of
``torch.nn.functional.scaled_dot_product_attention`` and means the same thing, so a
model switches by changing one import::

    from qkv.torch import scaled_dot_product_attention
    # was: from torch.nn.functional import scaled_dot_product_attention

``collect_stats()`` records how saturated every attention call's softmax is (largest
weight, entropy per head), from the same forward, without changing the call::

    with qkv.torch.collect_stats() as stats:
        model(batch)
"""

from __future__ import annotations

import math

import torch

from . import _autograd, _torch_ops, _torch_stats
# The other operators (torch.ops.qkv.*), registered with torch on import so that a
# traced or exported program that names them finds them.
from . import _torch_ops_cache, _torch_ops_index, _torch_ops_rotary, _torch_ops_stats, _torch_ops_varlen  # noqa: F401
from ._arrays import Torch
from ._options import Options, make_options
from ._qkv import Error
from ._torch_stats import StatsCollector, collect_stats, stats_label

_FN = "qkv.torch.scaled_dot_product_attention"


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 window=None, alibi_slopes=None, softcap=None, sinks=None,
                                 precision=None):
    """softmax(scale·query·keyᵀ + attn_mask)·value, as
    ``torch.nn.functional.scaled_dot_product_attention`` computes it, by qkv.

    Shapes as in PyTorch: query ``(..., Hq, L, E)``, key ``(..., H, S, E)``, value
    ``(..., H, S, Ev)`` → ``(..., Hq, L, Ev)``, with 2 or more dimensions and the leading
    ones broadcast; ``enable_gqa=True`` lets H divide Hq (grouped-query attention).
    ``is_causal=True`` is the top-left causal mask (query i sees keys j <= i, also when
    L != S). A bool ``attn_mask`` marks the pairs that take part (True = attend); a float
    one is added to the scaled logits; it broadcasts to ``(..., Hq, L, S)``.
    ``scale`` defaults to 1/sqrt(E). Differentiable in query, key and value (autograd runs
    qkv's backward). Inputs are read in place through their strides (the q/k/v slices of
    a packed projection too); only a last dimension that is not contiguous is copied.

    Where qkv differs from PyTorch, on purpose or for now:

    - A query row whose keys are all masked gives output 0 and zero gradients (PyTorch
      2.13's CPU kernels agree; older PyTorch releases and some backends give NaN).
    - ``dropout_p > 0`` drops attention weights as PyTorch does (kept ones scaled by
      1/(1 − p)), with qkv's own mask: a hash of a seed drawn from torch's default
      generator, so ``torch.manual_seed`` reproduces a run, but the bits differ from
      PyTorch's. The backward regenerates the same mask.
    - Keyword-only extensions (qkv.attention documents them): ``window=(left, right)``,
      ``alibi_slopes``, ``softcap``, ``sinks`` (differentiable). All of them, dropout
      included, trace under torch.compile (fullgraph) and torch.export: the call is the
      operator ``torch.ops.qkv.attention_forward``; a compiled call draws its dropout
      seed from the same generator, in the same order, as an eager one. ``precision``
      (None / ``"fast"`` or ``"exact"``, as in qkv.attention) runs eagerly only.
    - float32, float64, bfloat16 and float16 on the CPU only (TypeError otherwise).
      bfloat16 and float16 are read in place, computed in float32 and rounded once to
      the input dtype (gradients too).
    - ``scale`` must be finite and > 0, and E >= 1.
    - A float ``attn_mask`` that requires grad raises NotImplementedError (its gradient
      is not implemented yet); a bool mask or a detached float mask is fine.
    - Bad arguments raise TypeError or ValueError (qkv.Error) naming the argument,
      where PyTorch raises RuntimeError. Double backward is not supported.

    Runs with ``torch.get_num_threads()`` threads; results do not depend on the count.
    """
    _check_tensors(query, key, value)
    if not 0.0 <= dropout_p < 1.0:
        raise Error(f"{_FN}: dropout_p: expected a probability in [0, 1), got {dropout_p}")
    if is_causal and attn_mask is not None:
        raise Error(f"{_FN}: attn_mask must be None when is_causal=True (as in PyTorch)")

    q_len, head_dim = query.shape[-2:]
    k_len, key_dim = key.shape[-2:]
    v_len, v_dim = value.shape[-2:]
    if key_dim != head_dim:
        raise Error(f"{_FN}: key.shape[-1] (head dim): expected {head_dim} "
                    f"(as query.shape[-1]), got {key_dim}")
    if v_len != k_len:
        raise Error(f"{_FN}: value.shape[-2] (keys): expected {k_len} "
                    f"(as key.shape[-2]), got {v_len}")
    if head_dim == 0:
        raise Error(f"{_FN}: query.shape[-1] (head dim): expected >= 1, got 0")

    if _plain_4d(query, key, value, enable_gqa):
        # The common case, [B, H, L, E] tensors of one batch whose heads qkv reads as
        # they are: no view to make, nothing to reshape afterwards.
        q, k, v = query, key, value
        batch, heads = query.shape[0], query.shape[1]
        batch_shape, out_rank, rank = (batch,), 4, 4
        out_shape = None
    else:
        # Every tensor as (*batch, heads, seq, dim) with at least one batch axis: views.
        out_rank = max(query.ndim, key.ndim, value.ndim)
        rank = max(out_rank, 4)
        q, k, v = (x[(None,) * (rank - x.ndim)] for x in (query, key, value))
        q, k, v, heads = _match_heads(q, k, v, enable_gqa, out_rank)
        batch_shape = _broadcast(q.shape[:-3], k.shape[:-3], v.shape[:-3],
                                 what="the batch dimensions of query, key and value")
        batch = math.prod(batch_shape)
        # One batch axis: a view for 4-D inputs; reshape copies only when higher-rank batch
        # axes cannot be merged.
        q, k, v = (x.expand(*batch_shape, *x.shape[-3:]).reshape(batch, *x.shape[-3:])
                   for x in (q, k, v))
        out_shape = (*batch_shape, heads, q_len, v_dim)[rank - out_rank:]
    keep = bias = None
    if attn_mask is not None:
        keep, bias = _mask_views(attn_mask, query.dtype, out_rank, rank, batch_shape, heads,
                                 q_len, k_len)

    if heads == 0 or v_dim == 0:  # nothing to compute; qkv needs heads, dims >= 1
        anchor = query.sum() + key.sum() + value.sum()  # keeps autograd connected
        shape = (*batch_shape, heads, q_len, v_dim)[rank - out_rank:]
        return query.new_zeros(shape) + 0 * anchor

    q, k, v = (Torch.inner_contiguous(x) for x in (q, k, v))
    has_variants = bool(dropout_p or window is not None or alibi_slopes is not None or softcap
                        or sinks is not None or precision is not None)
    if _torch_ops.traced(q, k, v):
        _torch_ops.refuse_precision_when_traced(precision)
        args = _torch_ops.OpArgs.plain(_FN, keep, bias, None, scale,
                                       "top_left" if is_causal else None, "bhsd", "auto",
                                       _torch_ops.TORCH_THREADS, False, like=q,
                                       window=window, alibi_slopes=alibi_slopes,
                                       softcap=softcap, sinks=sinks, dropout_p=dropout_p)
        out, _ = _torch_ops.traced_forward(q, k, v, args)
        return out if out_shape is None else out.reshape(out_shape)
    causal = "top_left" if is_causal else None
    if has_variants:
        options = make_options(_FN, Torch, scale=scale, causal=causal,
                               threads=torch.get_num_threads(), window=window,
                               alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks,
                               dropout_p=dropout_p, precision=precision).replace(keep=keep, bias=bias)
    else:
        options = Options(_FN, causal, scale, "auto",
                          torch.get_num_threads(), False, keep, bias)
    # Attention health, only while qkv.torch.collect_stats() is active.
    stats = library_stats = None
    collectors = _torch_stats.active()
    if collectors:
        stats, library_stats = _torch_stats.prepare(collectors, q, batch, heads, q_len)
    out, _ = _autograd.forward_with_autograd(q, k, v, layout="bhsd", options=options,
                                             stats=library_stats, want_lse=False)
    if stats is not None:
        _torch_stats.record(collectors, stats, (batch, heads, q_len, k_len))
    return out if out_shape is None else out.reshape(out_shape)


def _plain_4d(query, key, value, enable_gqa) -> bool:
    """Whether query, key and value are [B, H, L, E] tensors of one batch size whose
    heads qkv reads as they are: equal, one key/value head (multi-query), or with
    enable_gqa key/value heads that divide the query heads."""
    if not query.ndim == key.ndim == value.ndim == 4:
        return False
    (batch, q_heads, _, _), (k_batch, k_heads, _, _) = query.shape, key.shape
    v_batch, v_heads = value.shape[0], value.shape[1]
    if not batch == k_batch == v_batch or k_heads != v_heads or k_heads == 0:
        return False
    return q_heads == k_heads or k_heads == 1 or (enable_gqa and q_heads % k_heads == 0)


_DTYPES = frozenset((torch.float32, torch.float64, torch.bfloat16, torch.float16))


def _check_tensors(query, key, value):
    T = torch.Tensor
    if (isinstance(query, T) and isinstance(key, T) and isinstance(value, T)
            and query.dtype in _DTYPES and key.dtype is query.dtype and value.dtype is query.dtype
            and query.is_cpu and key.is_cpu and value.is_cpu
            and query.ndim >= 2 and key.ndim >= 2 and value.ndim >= 2):
        return  # the common case, asked for cheaply; otherwise find what is wrong:
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{_FN}: {name}: expected a torch.Tensor, got "
                            f"{type(x).__module__}.{type(x).__qualname__}")
    if min(query.ndim, key.ndim, value.ndim) < 2:
        raise Error(f"{_FN}: expected query, key and value to have at least 2 dimensions, "
                    f"got {query.ndim}, {key.ndim} and {value.ndim}")
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(f"{_FN}: expected query, key and value of one dtype, got "
                        f"{query.dtype}, {key.dtype} and {value.dtype}")
    if query.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise TypeError(f"{_FN}: qkv takes torch.float32, torch.float64, torch.bfloat16 or "
                        f"torch.float16, got {query.dtype}")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.device.type != "cpu":
            raise TypeError(f"{_FN}: {name}: qkv computes on the CPU, got a tensor on "
                            f"{x.device} (move it with .cpu())")


def _broadcast(*shapes, what):
    """NumPy/PyTorch broadcasting of shapes (torch.broadcast_shapes costs ~50 µs)."""
    rank = max(len(s) for s in shapes)
    result = []
    for axis in range(-rank, 0):
        extents = {s[axis] for s in shapes if len(s) >= -axis} - {1}
        if len(extents) > 1:
            raise Error(f"{_FN}: {what} do not broadcast: "
                        + ", ".join(str(tuple(s)) for s in shapes))
        result.append(extents.pop() if extents else 1)
    return tuple(result)


def _match_heads(q, k, v, enable_gqa, out_rank):
    """(q, k, v, heads): key/value heads qkv can read with grouped-query attention."""
    q_heads, k_heads, v_heads = q.shape[-3], k.shape[-3], v.shape[-3]
    if enable_gqa:
        if out_rank < 3:
            raise Error(f"{_FN}: enable_gqa=True needs a heads dimension (inputs of 3 or "
                        "more dimensions)")
        if k_heads == 0 or v_heads == 0 or q_heads % k_heads or q_heads % v_heads:
            raise Error(f"{_FN}: enable_gqa=True: the number of heads in key ({k_heads}) "
                        f"and value ({v_heads}) must divide the number of heads in query "
                        f"({q_heads})")
        if k_heads != v_heads:
            # qkv shares one kv head count: repeat each to the lcm, as PyTorch's
            # repeat_interleave would (query head h still reads key head h // (Hq/Hk)).
            kv_heads = math.lcm(k_heads, v_heads)
            k = k.repeat_interleave(kv_heads // k_heads, dim=-3)
            v = v.repeat_interleave(kv_heads // v_heads, dim=-3)
        return q, k, v, q_heads
    heads = _broadcast((q_heads,), (k_heads,), (v_heads,),
                       what="the head counts of query, key and value")[0]
    if q_heads != heads:
        q = q.expand(*q.shape[:-3], heads, *q.shape[-2:])
    if not k_heads == v_heads == 1:  # one kv head is qkv's multi-query attention as is
        k = k.expand(*k.shape[:-3], heads, *k.shape[-2:])
        v = v.expand(*v.shape[:-3], heads, *v.shape[-2:])
    return q, k, v, heads


def _mask_views(mask, dtype, out_rank, rank, batch_shape, heads, q_len, k_len):
    """(keep, bias): attn_mask as qkv's [B|1, H|1, L|1, S] bool or float32 mask."""
    if mask is None:
        return None, None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{_FN}: attn_mask: expected a torch.Tensor or None, got "
                        f"{type(mask).__module__}.{type(mask).__qualname__}")
    if mask.dtype != torch.bool and mask.dtype not in (torch.float32, dtype):
        raise TypeError(f"{_FN}: attn_mask: expected dtype torch.bool, torch.float32 or the "
                        f"query's dtype ({dtype}), got {mask.dtype}")
    if not 2 <= mask.ndim <= out_rank:
        raise Error(f"{_FN}: attn_mask: expected 2 to {out_rank} dimensions (it broadcasts "
                    f"to the attention weights), got shape {tuple(mask.shape)}")
    full = (*batch_shape, heads, q_len, k_len)
    mask = mask[(None,) * (rank - mask.ndim)]
    if _broadcast(tuple(mask.shape), full, what="attn_mask and the attention weights") != full:
        raise Error(f"{_FN}: attn_mask: shape {tuple(mask.shape)} does not broadcast to "
                    f"the attention weights {full}")
    if mask.shape[-1] != k_len:  # broadcast over keys: qkv reads keys contiguously
        mask = mask.expand(*mask.shape[:-1], k_len).contiguous()
    mask_batch = mask.shape[:-3]
    if all(extent == 1 for extent in mask_batch):
        mask = mask.reshape(1, *mask.shape[-3:])
    else:
        mask = mask.expand(*batch_shape, *mask.shape[-3:]).reshape(
            math.prod(batch_shape), *mask.shape[-3:])
    mask = Torch.inner_contiguous(mask)
    if mask.dtype == torch.bool:
        return mask, None
    return None, mask.to(torch.float32)


__all__ = ["scaled_dot_product_attention", "collect_stats", "stats_label", "StatsCollector"]
