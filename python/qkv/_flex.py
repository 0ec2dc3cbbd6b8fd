"""qkv.flex_attention: torch's FlexAttention entry point on qkv's kernels, forward and
backward on the CPU (where torch's own flex_attention has no backward).

A BlockMask (torch.nn.attention.flex_attention.create_block_mask) is read in place as
the block-sparse mask of qkv/block_sparse.hpp: its block table gives each block's kind
(empty: skipped; full: no mask work; partial), and only partial blocks get a mask of
their own, built by evaluating the BlockMask's mask_mod once over those blocks
(vectorized: one call per chunk of blocks, with broadcast index tensors) — never an
Nq × Nk mask. The table is cached per BlockMask (its tensors' identity and version), so
the layers of a model sharing one mask pay once.

Traced calls (torch.compile, torch.export): the table is the operator
torch.ops.qkv.flex_block_table (its partial-block count is data-dependent, an unbacked
size), the attention the dense operator with the table among its arguments.
"""

from __future__ import annotations

import collections
import weakref
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from . import _autograd, _torch_ops, mods
from ._arrays import Torch
from ._options import make_options
from ._qkv import Error

_FN = "qkv.flex_attention"
EMPTY, PARTIAL, FULL = 0, 1, 2  # qkv::BlockSparseMask's kinds

# mask_mod functions by handle (an int an operator can take), weakly: a BlockMask keeps
# its mask_mod alive, and a dropped one frees its handle.
_MASK_MODS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_HANDLES: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()
_TABLES: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_TABLES_KEPT = 16
_CHUNK_ELEMENTS = 1 << 22  # mask_mod evaluated over at most this many pairs at once


@torch.compiler.assume_constant_result
def mask_mod_handle(mask_mod) -> int:
    try:
        handle = _HANDLES.get(mask_mod)
    except TypeError:  # held weakly (above): an object without weak references cannot be
        raise TypeError(f"{_FN}: block_mask.mask_mod: expected a function or an object that can be weakly "
                        f"referenced (qkv holds mask_mods weakly), got {type(mask_mod).__qualname__}: "
                        "wrap it in a def or lambda when creating the BlockMask") from None
    if handle is None:
        handle = len(_HANDLES) + 1
        while handle in _MASK_MODS:
            handle += 1
        _HANDLES[mask_mod] = handle
        _MASK_MODS[handle] = mask_mod
    return handle


def _kinds(num_blocks, indices, k_blocks, kind, state):
    """Writes `kind` into state[..., j] for the first num_blocks[...] entries j of indices."""
    if num_blocks is None:
        return
    listed = torch.arange(indices.shape[-1]) < num_blocks[..., None].long()
    columns = torch.where(listed, indices.long(), k_blocks)  # unlisted: the spare column
    wide = torch.zeros((*state.shape[:-1], k_blocks + 1), dtype=torch.uint8)
    wide.scatter_(-1, columns, kind)
    state.copy_(torch.where(wide[..., :k_blocks] == kind, kind, state))


def _partial_masks(mask_mod, where, block_q, block_k, q_len, k_len):
    """[P, block_k, block_q] uint8 (key-major: qkv/block_sparse.hpp): mask_mod over the
    pairs of each partial block where[p] = (b, h, q_block, k_block); pairs past the
    lengths are removed."""
    out = torch.empty((where.shape[0], block_k, block_q), dtype=torch.uint8)
    rows, cols = torch.arange(block_q)[None, :, None], torch.arange(block_k)[None, None, :]
    chunk = max(1, _CHUNK_ELEMENTS // (block_q * block_k))
    for start in range(0, where.shape[0], chunk):
        w = where[start:start + chunk]
        b, h = w[:, 0, None, None], w[:, 1, None, None]
        q_idx = w[:, 2, None, None] * block_q + rows
        kv_idx = w[:, 3, None, None] * block_k + cols
        inside = (q_idx < q_len) & (kv_idx < k_len)
        kept = mask_mod(b, h, q_idx.clamp(max=q_len - 1), kv_idx.clamp(max=k_len - 1))
        kept = torch.as_tensor(kept, dtype=torch.bool).expand(inside.shape) & inside
        out[start:start + chunk] = kept.transpose(1, 2).to(torch.uint8)
    return out


def block_table(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, mask_mod,
                block_q, block_k, q_len, k_len):
    """(state [B|1, H|1, QB, KB] uint8, slot int32, bytes [P, block_k, block_q] uint8) of a
    BlockMask's tensors (qkv/block_sparse.hpp), cached for those very tensors."""
    tensors = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    key = (mask_mod, block_q, block_k, q_len, k_len) + tuple(
        None if t is None else (t.data_ptr(), t._version, tuple(t.shape), tuple(t.stride()))
        for t in tensors)
    hit = _TABLES.get(key)
    # The same tensors, not only the same addresses: a new BlockMask may reuse a freed
    # one's memory (and its mask_mod may be the same function over new data).
    if hit is not None and all((ref is None and t is None) or (ref is not None and ref() is t)
                               for ref, t in zip(hit[1], tensors)):
        _TABLES.move_to_end(key)
        return hit[0]
    q_blocks, k_blocks = kv_num_blocks.shape[-1], -(-k_len // block_k)
    state = torch.zeros((*kv_num_blocks.shape, k_blocks), dtype=torch.uint8)
    # Without full blocks listed, every listed block is partial (mask_mod decides).
    _kinds(kv_num_blocks, kv_indices, k_blocks, PARTIAL, state)
    _kinds(full_kv_num_blocks, full_kv_indices, k_blocks, FULL, state)
    if q_blocks * block_q < q_len:
        raise Error(f"{_FN}: block_mask: {q_blocks} query blocks of {block_q} do not cover "
                    f"{q_len} queries")
    where = (state == PARTIAL).nonzero()
    slot = torch.full(state.shape, -1, dtype=torch.int32)
    slot[tuple(where.t())] = torch.arange(where.shape[0], dtype=torch.int32)
    function = _MASK_MODS.get(mask_mod)
    if function is None and where.shape[0]:
        raise Error(f"{_FN}: block_mask: its mask_mod no longer exists")
    masks = _partial_masks(function, where, block_q, block_k, q_len, k_len)
    result = (state, slot, masks)
    _TABLES[key] = (result, tuple(None if t is None else weakref.ref(t) for t in tensors))
    if len(_TABLES) > _TABLES_KEPT:
        _TABLES.popitem(last=False)
    return result


@torch.library.custom_op("qkv::flex_block_table", mutates_args=())
def flex_block_table(kv_num_blocks: Tensor, kv_indices: Tensor,
                     full_kv_num_blocks: Optional[Tensor], full_kv_indices: Optional[Tensor],
                     mask_mod: int, block_q: int, block_k: int, q_len: int,
                     k_len: int) -> Tuple[Tensor, Tensor, Tensor]:
    return tuple(t.clone() for t in block_table(
        kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, mask_mod, block_q,
        block_k, q_len, k_len))


@flex_block_table.register_fake
def _(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, mask_mod, block_q,
      block_k, q_len, k_len):
    shape = (*kv_num_blocks.shape, -(-k_len // block_k))
    partial = torch.library.get_ctx().new_dynamic_size()
    return (kv_num_blocks.new_empty(shape, dtype=torch.uint8),
            kv_num_blocks.new_empty(shape, dtype=torch.int32),
            kv_num_blocks.new_empty((partial, block_k, block_q), dtype=torch.uint8))


def _check(query, key, value, block_mask, enable_gqa):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{_FN}: {name}: expected a torch.Tensor, got {type(x).__qualname__}")
        if x.ndim != 4:
            raise Error(f"{_FN}: {name}: expected 4 dimensions [B, H, N, d], got shape "
                        f"{tuple(x.shape)}")
    q_heads, k_heads = query.shape[1], key.shape[1]
    if not enable_gqa and q_heads != k_heads:
        raise Error(f"{_FN}: key.shape[1] (heads): expected {q_heads} (as query) without "
                    f"enable_gqa=True, got {k_heads}")
    if block_mask is None:
        return
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"{_FN}: block_mask: expected None or a BlockMask (create_block_mask), got "
                        f"{type(block_mask).__qualname__}")
    q_len, k_len = query.shape[2], key.shape[2]
    if tuple(block_mask.seq_lengths) != (q_len, k_len):
        raise Error(f"{_FN}: block_mask: made for (Q_LEN, KV_LEN) = "
                    f"{tuple(block_mask.seq_lengths)}, got query and key lengths "
                    f"({q_len}, {k_len})")
    mask_batch, mask_heads = block_mask.kv_num_blocks.shape[:2]
    if mask_batch not in (1, query.shape[0]) or mask_heads not in (1, q_heads):
        raise Error(f"{_FN}: block_mask: its batch and heads ({mask_batch}, {mask_heads}) "
                    f"must be 1 or the query's ({query.shape[0]}, {q_heads})")


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                   enable_gqa=False, return_lse=False):
    """``torch.nn.attention.flex_attention.flex_attention`` on qkv: query
    ``[B, Hq, L, E]``, key ``[B, Hkv, S, E]``, value ``[B, Hkv, S, Ev]`` →
    ``[B, Hq, L, Ev]`` (and ``lse [B, Hq, L]``, natural log, with ``return_lse=True``).

    block_mask: a torch BlockMask (create_block_mask; any BLOCK_SIZE, B and H of 1
        broadcast), read in place: empty blocks are skipped, full blocks get no mask
        work, partial blocks are masked by its mask_mod, evaluated once per BlockMask
        (cached) over the partial blocks only.
    score_mod: None, or qkv's built-ins (qkv.mods.softcap(cap), qkv.mods.alibi(slopes),
        qkv.mods.bias(tensor), or a list of them); a Python function is a TypeError (qkv
        runs no Python in its kernels; there is no slow path).
    Differentiable in query, key, value (and the ALiBi slopes) on the CPU, float32,
    float64, bfloat16 and float16; traceable by torch.compile (fullgraph) and
    torch.export. A row with no key gives 0 and lse -inf, as torch's.
    """
    _check(query, key, value, block_mask, enable_gqa)
    variants = mods.as_options(score_mod)
    bias = variants.pop("mask", None)
    if bias is not None:
        bias = _bias(bias, query, key, block_mask, variants)
    blocks = None
    if block_mask is not None:
        block_q, block_k = (int(n) for n in block_mask.BLOCK_SIZE)
        blocks = (*flex_block_table(
            block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
            block_mask.full_kv_indices, mask_mod_handle(block_mask.mask_mod), block_q,
            block_k, query.shape[2], key.shape[2]), block_q, block_k)
    q, k, v = (Torch.inner_contiguous(x) for x in (query, key, value))
    if bias is not None and bias.requires_grad and torch.is_grad_enabled():
        out, lse = _with_bias_gradient(q, k, v, bias, scale, return_lse)
    elif _torch_ops.traced(q, k, v):
        args = _torch_ops.OpArgs.plain(_FN, None, bias, None, scale, None, "bhsd", "auto",
                                       _torch_ops.TORCH_THREADS, False, like=q, **variants)
        if blocks is not None:
            args = args._replace(**dict(zip(("block_state", "block_slot", "block_bytes",
                                             "block_q", "block_k"), blocks)))
        out, lse = _torch_ops.traced_forward(q, k, v, args)
    else:
        options = make_options(_FN, Torch, mask=bias, scale=scale,
                               threads=_torch_ops.TORCH_THREADS, **variants)
        if blocks is not None:
            options = options.replace(block_mask=blocks)
        out, lse = _autograd.forward_with_autograd(q, k, v, layout="bhsd", options=options)
    return (out, lse) if return_lse else out


def _bias(bias, query, key, block_mask, variants):
    """qkv.mods.bias's tensor as a float32 [B|1, Hq|1, L, S] mask."""
    if not isinstance(bias, Tensor) or not bias.is_floating_point():
        raise TypeError(f"{_FN}: qkv.mods.bias: expected a float torch.Tensor")
    shape = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    # Checked here, not by torch.broadcast_shapes, whose RuntimeError names no argument.
    if bias.ndim > 4 or any(n not in (1, m) for n, m in zip(reversed(bias.shape), reversed(shape))):
        raise Error(f"{_FN}: qkv.mods.bias: shape {tuple(bias.shape)} does not broadcast to "
                    f"{shape}")
    if block_mask is not None:
        raise Error(f"{_FN}: qkv.mods.bias: takes no block_mask (qkv's kernels do not combine "
                    "an additive mask with a block mask; fold the block mask into the bias)")
    if bias.requires_grad and variants:
        raise Error(f"{_FN}: qkv.mods.bias: a bias that requires grad takes no other "
                    "score_mod (its gradient is computed by PyTorch)")
    bias = bias.float()
    bias = bias.reshape((1,) * (4 - bias.ndim) + tuple(bias.shape))
    return bias.expand(*bias.shape[:3], shape[3])


def _with_bias_gradient(q, k, v, bias, scale, return_lse):
    """(out, lse) with the bias's gradient: qkv's forward (and its q, k, v gradients)
    plus a PyTorch softmax whose value is subtracted out again, so that only its gradient
    with respect to the bias, P ⊙ (dP − δ), remains."""
    out, lse = _autograd.forward_with_autograd(
        q, k, v, layout="bhsd",
        options=make_options(_FN, Torch, mask=bias.detach(), scale=scale,
                             threads=_torch_ops.TORCH_THREADS))
    group = q.shape[1] // k.shape[1]
    keys, values = (x.detach().repeat_interleave(group, dim=1) for x in (k, v))
    logits = q.detach() @ keys.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    weights = torch.softmax(logits.float() + bias, dim=-1).nan_to_num(0.0)
    surrogate = (weights @ values.float()).to(out.dtype)
    return out + (surrogate - surrogate.detach()), lse


__all__ = ["block_table", "flex_attention", "flex_block_table"]
