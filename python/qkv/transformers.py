"""qkv.transformers — qkv as an attention implementation of Hugging Face transformers.

Importing this module registers the name ``"qkv"`` with transformers' public registries
(``AttentionInterface`` for the attention function, ``AttentionMaskInterface`` for the
masks it is given), so that every attention layer of a model runs on qkv::

    import qkv.transformers  # registers attn_implementation="qkv"
    model = AutoModel.from_pretrained(name, attn_implementation="qkv")
    # or, on a loaded model: model.set_attn_implementation("qkv")

Masks are built as for ``"sdpa"`` (``[B, 1, Nq, Nk]``, or None where a causal flag or no
mask says the same), as additive floats in the model's dtype (0 attends, -inf removes):
models compose masks that way (DeepSeek-V4 appends a 0 / -inf bias, which a boolean
mask would invert), and models that append keys always get a mask (additive_mask).
Before calling qkv, a mask is read once per forward and routed to the cheapest qkv call
that means the same thing:

- every key kept                      → no mask
- each batch entry keeps a prefix of its keys (right padding of an encoder batch)
                                      → ``key_lengths``
- causal, plus right padding          → ``causal="top_left"`` and ``key_lengths``
- causal over a KV cache, no padding  → ``causal="bottom_right"``
- a causal sliding window (Mistral, Gemma 2's and gpt-oss's sliding layers), no padding
                                      → ``causal="bottom_right"`` and ``window=(left, -1)``
                                        (decode steps read only the window's keys)
- anything else (left padding, packed sequences, biases)
                                      → the mask itself

Key lengths and causality let qkv skip whole key blocks instead of reading a mask per
element. Float masks whose entries are 0 or "removed" (-inf or the dtype's most negative
value) are routed so when every query row keeps at least one key; otherwise (a left-padded
query under a causal mask keeps none) they are passed unchanged: a row that keeps no key
gives 0 where its entries are -inf (additive_mask's, as ``"sdpa"``'s boolean masks), and
the average of the values where they are finite (a model's own eager-style mask, as
``"eager"`` and ``"sdpa"`` give). Boolean masks (a model's own) are routed the same way.

Inside ``with qkv.torch.collect_stats() as stats:`` every layer's call also records its
softmax statistics (largest weight, entropy, saturated share per head; see qkv.torch),
labelled ``"layer <layer_idx>"`` unless a ``qkv.torch.stats_label`` is active.

What a model passes, and what happens to it. Never a silent wrong answer: a keyword
that is neither computed nor known to be redundant raises NotImplementedError naming
the keyword and the model's class (the lists are IMPLEMENTED and CARRY_NOTHING).

- computed: the mask, ``is_causal``, ``scaling``; attention dropout in training (the keep
  mask drawn from torch's default generator, so ``torch.manual_seed`` reproduces a run);
  logit soft-capping (Gemma 2's ``softcap``); per-head attention sinks (gpt-oss's and
  DeepSeek-V4's ``s_aux``, with their gradient); grouped-query attention, ``dv != d``
  and K = V (DeepSeek-V4's one shared head of 512) read in place.
- ignored, because the mask or the call already says it: ``sliding_window``,
  ``position_ids``, flash-attention's varlen keywords (``cu_seq_lens_q/k``,
  ``max_length_q/k``; several packed sequences with no mask are refused), ``seq_idx``,
  ``deterministic``, and output requests (``output_attentions`` gives None weights, as
  ``"sdpa"``; ``use_cache``, ``output_router_logits``, ...).
- ``indices`` (DeepSeek Sparse Attention's top-k keys: DeepSeek-V3.2, GLM-5) go to
  ``qkv.sparse_attention``, the mask folded into the lists (_sparse_indices; its softmax
  statistics are not collected).
- refused (NotImplementedError): ``position_bias`` (T5's learned relative bias), per-query ``sinks``, ``block_indices``
  and any keyword not listed.

bfloat16 and float16 tensors go to qkv as they are (float32 sums, the output rounded
once); other floating dtypes are computed in float32.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from . import _torch_ops, _torch_stats
from . import torch as _qkv_torch  # noqa: F401  (registers every torch.ops.qkv operator)
from ._attention import attention as _qkv_attention
from ._attention import plain_torch_forward as _plain_torch_forward

NAME = "qkv"

# The dtypes qkv's kernels take (bfloat16 and float16 with float32 sums and one rounding
# of the output, bfloat16 on the CPU's dot-product units or AMX tiles where they pay);
# other floating dtypes are computed in float32. Until 2026-12-02 bfloat16 and float16
# were widened to float32 here, which made a bf16 model's attention run at fp32 speed.
_NATIVE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      dropout: float = 0.0, scaling: Optional[float] = None,
                      is_causal: Optional[bool] = None, **kwargs):
    """transformers' attention-function contract: query ``[B, Hq, Nq, d]``, key and value
    ``[B, Hkv, Nk, d|dv]`` (Hkv divides Hq: grouped-query attention, read in place),
    ``attention_mask`` None or ``[B|1, 1|Hq, Nq|1, >= Nk]`` (bool: True attends; float:
    added to the logits) → ``(out [B, Nq, Hq, dv], None)``, contiguous.

    ``is_causal`` (or the module's ``is_causal``, default True, as for ``"sdpa"``) makes a
    call with several queries and no mask causal. Other keywords: those in IMPLEMENTED
    are computed, those in CARRY_NOTHING are ignored (each says why), any other one
    that is not None raises NotImplementedError naming it and the model's class."""
    _check_keywords(module, kwargs, attention_mask)
    # Variants: dropout only in training (transformers passes 0.0 in eval already), the
    # soft-cap as given, sinks as float32 (a cast keeps their gradient).
    variants = {}
    if dropout > 0 and getattr(module, "training", True):
        variants["dropout_p"] = float(dropout)
    if kwargs.get("softcap") is not None:
        variants["softcap"] = float(kwargs["softcap"])
    if kwargs.get("s_aux") is not None:
        variants["sinks"] = kwargs["s_aux"].float()

    q_len, k_len = query.shape[2], key.shape[2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal, key_lengths, mask, window = route_mask(attention_mask, query.shape[0], q_len, k_len)
    if window is not None:
        variants["window"] = window
    if attention_mask is None and is_causal and q_len > 1:
        # Several queries and no mask: transformers left the causal mask out (as for
        # sdpa's is_causal, top-left). One query attends to every key.
        causal = "top_left"
    if kwargs.get("indices") is not None:
        return _sparse_indices(module, query, key, value, kwargs["indices"],
                               Route(causal, key_lengths, mask, window), scaling, variants)

    dtype = query.dtype
    if dtype not in _NATIVE_DTYPES:
        query, key, value = (x.float() for x in (query, key, value))
    if mask is not None and mask.is_floating_point() and mask.dtype not in (torch.float32, torch.float64):
        mask = mask.float()  # a bf16/fp16 additive mask: qkv adds float32 (exact widening)

    # Attention health: while qkv.torch.collect_stats() is active (eager), each layer's
    # call records its softmax statistics, labelled with the layer (see _layer_label).
    collectors = () if torch.compiler.is_compiling() else _torch_stats.active()
    stats_kwargs = {}
    if collectors:
        row_stats, threshold = _torch_stats.settings(collectors)
        stats_kwargs = dict(return_stats=True, return_row_stats=row_stats,
                            saturation_threshold=threshold)

    if mask is None and key_lengths is None and not variants and not collectors:
        # A decode step's usual call: its Options made once, not per layer (same result).
        out = _plain_torch_forward(query.transpose(1, 2), key.transpose(1, 2),
                                   value.transpose(1, 2), causal=causal, scale=scaling,
                                   layout="bshd")
        if out is not None:
            return out.to(dtype), None

    # threads: torch.get_num_threads() when the call runs (TORCH_THREADS), which
    # torch.compile could not trace here (it returns no tensor). [B, H, N, d] tensors
    # seen as [B, N, H, d] (a view): qkv then allocates the output
    # as [B, Nq, Hq, dv] in C order, which is what transformers reshapes next, no copy.
    out = _qkv_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                         layout="bshd", causal=causal, mask=mask, key_lengths=key_lengths,
                         scale=scaling, threads=_torch_ops.TORCH_THREADS, **variants,
                         **stats_kwargs)
    if collectors:
        out, stats = out
        _torch_stats.record(collectors, stats, (query.shape[0], query.shape[1], q_len, k_len),
                            default_label=_layer_label(module))
    return out.to(dtype), None


# Keywords (beyond the named parameters) that this backend computes.
IMPLEMENTED = frozenset({
    "softcap",  # Gemma 2's logit soft-cap → qkv's softcap variant
    "s_aux",    # per-head attention sinks (gpt-oss, DeepSeek-V4) → qkv's sinks
    "indices",  # DeepSeek Sparse Attention's top-k keys → _sparse_indices
})

# Keywords known to carry nothing the mask does not already say, or nothing attention
# computes: ignored whatever their value. Read from what transformers 5.24's models pass
# to their attention functions (explicitly, or in the **kwargs they forward, which are
# transformers' TransformersKwargs and FlashAttentionKwargs).
CARRY_NOTHING = frozenset({
    # The window is in the mask: sliding layers' masks come from
    # create_sliding_window_causal_mask (route_mask turns the band back into `window`).
    "sliding_window",
    # Read by the mask builder: packed sequences (positions restarting at 0) make a
    # block-diagonal mask.
    "position_ids",
    # flash-attention's view of packed sequences, which the mask built from position_ids
    # already separates (a call with several packed sequences and no mask is refused).
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
    "seq_idx",  # the same packing, for linear-attention (Mamba) layers
    # Requests about outputs: attention weights are not returned (None, as "sdpa"), the
    # rest concern other layers or the loss.
    "output_attentions", "output_hidden_states", "output_router_logits", "use_cache",
    "num_items_in_batch",
    "deterministic",  # flash-attention's deterministic backward; qkv's always is
})


def _check_keywords(module, kwargs, attention_mask) -> None:
    """Never a silent wrong answer: a keyword this backend neither computes nor knows to
    be redundant would be dropped, so it is refused instead."""
    for name, value in kwargs.items():
        if value is None or name in IMPLEMENTED or name in CARRY_NOTHING:
            continue
        raise NotImplementedError(
            f"qkv.transformers: {type(module).__name__} passes `{name}` to its attention "
            f"function, which the qkv attention backend does not implement; use "
            f"attn_implementation='eager' for this model")
    packed = kwargs.get("cu_seq_lens_q")
    if attention_mask is None and packed is not None and packed.numel() > 2:
        raise NotImplementedError(
            f"qkv.transformers: {type(module).__name__} passes `cu_seq_lens_q` for "
            f"{packed.numel() - 1} packed sequences and no mask; pass position_ids that "
            f"restart at each sequence so that transformers builds the mask that separates them")


def _sparse_indices(module, query, key, value, indices, route: "Route", scale, variants):
    """Attention over the keys ``indices`` lists: ``[B, Nq, topk]`` integers (DeepSeek
    Sparse Attention's top-k, one set per query shared by every head; DeepSeek-V3.2,
    GLM-5), on ``qkv.sparse_attention`` — never a dense mask. A listed key takes part only
    where the routed mask allows it as well: transformers' indexer lists removed keys when
    a row allows fewer than topk (``torch.topk`` over -inf scores), and eager adds the mask
    to the scattered top-k mask. So the route's key lengths, sliding window and 0 / -inf
    mask are folded into the lists (-1 where the key is removed); its causal mode is
    sparse_attention's own. What cannot be folded into one list per query is refused by
    name: a per-head mask, an additive mask with other values (biases), dropout."""
    from ._sparse import sparse_attention

    where = f"qkv.transformers: {type(module).__name__} passes `indices` (DeepSeek Sparse Attention)"
    if "dropout_p" in variants:
        raise NotImplementedError(f"{where} with attention dropout in training; qkv's sparse attention "
                                  "has no dropout")
    if indices.ndim != 3 or indices.shape[0] != query.shape[0] or indices.shape[1] != query.shape[2]:
        raise NotImplementedError(f"{where} of shape {tuple(indices.shape)}; expected [batch, queries, topk] "
                                  f"= [{query.shape[0]}, {query.shape[2]}, topk]")
    batch, q_len, k_len = query.shape[0], query.shape[2], key.shape[2]
    listed = indices.long()
    safe = listed.clamp(0, max(k_len - 1, 0))
    keep = (listed >= 0) & (listed < k_len)
    if route.key_lengths is not None:
        keep &= safe < route.key_lengths.to(safe.device).view(-1, 1, 1)
    if route.window is not None:  # bottom-right (left, right): query i sits at k_len - q_len + i
        left, right = route.window
        position = torch.arange(q_len, device=safe.device).view(1, -1, 1) + (k_len - q_len)
        if left >= 0:
            keep &= safe >= position - left
        if right >= 0:
            keep &= safe <= position + right
    if route.mask is not None:
        mask = route.mask
        if mask.shape[1] != 1:
            raise NotImplementedError(f"{where} together with a per-head mask {tuple(mask.shape)}")
        if mask.dtype != torch.bool:
            removed = mask <= torch.finfo(mask.dtype).min
            if not bool(((mask == 0) | removed).all()):
                raise NotImplementedError(f"{where} together with an additive mask holding biases "
                                          "(values other than 0 and -inf)")
            mask = ~removed
        rows = mask[:, 0, :, :k_len].expand(batch, q_len, k_len)
        keep &= torch.gather(rows, 2, safe)
    folded = torch.where(keep, listed, torch.full_like(listed, -1))

    dtype = query.dtype
    if dtype not in _NATIVE_DTYPES:
        query, key, value = (x.float() for x in (query, key, value))
    out = sparse_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), folded,
                           scale=scale, causal=route.causal, layout="bshd",
                           threads=_torch_ops.TORCH_THREADS, **variants)
    return out.to(dtype), None


def _layer_label(module) -> str:
    """"layer 3" for transformers' attention modules (their layer_idx), else the class."""
    index = getattr(module, "layer_idx", None)
    return f"layer {index}" if index is not None else type(module).__name__


# The masks of one forward pass are the same few tensors for every layer (a full and a
# sliding one where layers alternate them, as Gemma's and gpt-oss's do): each is routed
# once. The routes of the last _ROUTES_KEPT masks are kept, newest last.
_ROUTES_KEPT = 4
_recent_routes: list = []  # (weak reference to the mask as given, its key, Route)


class Route(NamedTuple):
    """What qkv is asked to do for a mask: at most one of key_lengths and mask is set;
    window, when set, is qkv's ``(left, right)`` on top of the causal mode."""
    causal: Optional[str]
    key_lengths: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    window: Optional[tuple] = None


def route_mask(mask: Optional[torch.Tensor], batch: int, q_len: int, k_len: int) -> Route:
    """The qkv call (a Route) that means what ``mask`` means for
    ``[batch, ·, q_len, k_len]`` attention."""
    if mask is None:
        return Route(None, None, None)
    given = mask  # the cache's key: a static cache's slice below is a new tensor each call
    if mask.ndim == 4 and mask.shape[-1] > k_len:
        mask = mask[..., :k_len]  # static caches build masks over their whole capacity
    if torch.compiler.is_compiling() or mask.ndim != 4 or mask.device.type != "cpu":
        return Route(None, None, _inner_contiguous(mask))
    key = (given._version, batch, q_len, k_len, given.data_ptr(), tuple(given.stride()),
           tuple(given.shape))
    for ref, known, result in _recent_routes:
        if ref() is given and known == key:
            return result
    result = _route(mask, batch, q_len, k_len)
    try:
        entry = (weakref.ref(given), key, result)
    except TypeError:  # a tensor subclass without weak references: route every call
        return result
    live = [kept for kept in _recent_routes if kept[0]() is not None]
    _recent_routes[:] = live[-(_ROUTES_KEPT - 1):] + [entry]
    return result


def _route(mask, batch, q_len, k_len) -> Route:
    keep = _as_keep(mask)
    if keep is None:  # a float mask with other values, or fully masked rows: as it is
        return Route(None, None, _inner_contiguous(mask))
    mask_batch, mask_heads, mask_queries, _ = keep.shape
    if mask_heads != 1 or mask_batch not in (1, batch) or mask_queries not in (1, q_len):
        return Route(None, None, _inner_contiguous(keep))
    columns = torch.arange(k_len)
    counts = keep[:, 0].sum(-1)  # [Bm, Qm]: keys each query row keeps

    # Each batch entry keeps its first L_b keys, whatever the query.
    lengths = counts[:, 0]
    if torch.equal(keep[:, 0], (columns < lengths[:, None, None]).expand_as(keep[:, 0])):
        if bool((lengths == k_len).all()):
            return Route(None, None, None)
        return Route(None, _per_batch(lengths, batch), None)

    if mask_queries == q_len and q_len > 1:
        rows = torch.arange(q_len)[:, None]
        # Causal (top-left: query i sees keys j <= i) and key padding: the last row
        # keeps min(q_len, L_b) keys, and keys at or past q_len are never visible.
        lengths = counts[:, -1]
        causal = (columns <= rows) & (columns < lengths[:, None, None])
        if torch.equal(keep[:, 0], causal):
            if bool((lengths == min(q_len, k_len)).all()):
                return Route("top_left", None, None)
            return Route("top_left", _per_batch(lengths, batch), None)
        # Causal over a KV cache (bottom-right: query i is at position k_len - q_len + i),
        # no padding. (With padding the two conventions differ: qkv's bottom-right
        # aligns the last query with each entry's last kept key.)
        if k_len > q_len and torch.equal(keep[:, 0],
                                         (columns <= rows + (k_len - q_len)).expand_as(
                                             keep[:, 0])):
            return Route("bottom_right", None, None)

    # A causal sliding window, no padding: query i (at position k_len - q_len + i) sees
    # its own key and the `left` before it. One decode step's mask is a suffix of the keys.
    if mask_queries == q_len:
        position = torch.arange(q_len)[:, None] + (k_len - q_len)
        left = int(counts[0, -1]) - 1  # the last query is never cut by the start
        band = (columns <= position) & (columns >= position - left)
        if 0 <= left < k_len - 1 and torch.equal(keep[:, 0], band.expand_as(keep[:, 0])):
            return Route("bottom_right", None, None, (left, -1))
    return Route(None, None, _inner_contiguous(keep))


def _as_keep(mask):
    """The boolean mask (True: attend) that means what ``mask`` means, or None for a float
    mask that cannot be one: entries other than 0 and "removed", or rows that remove every
    key with a finite value (there a float mask averages every value, as eager and sdpa
    do; qkv's removal gives 0, which -inf entries give too)."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return None
    built = getattr(mask, _BUILT_FROM, None)
    if built is not None and built[0] == mask._version:
        return built[1]  # additive_mask's own, unchanged: read from the boolean it came from
    keep = mask == 0
    removed = mask <= torch.finfo(mask.dtype).min
    if not bool((keep | removed).all()):
        return None
    if not bool(keep.any(-1).all()) and not bool(torch.equal(torch.isneginf(mask), removed)):
        return None
    return keep


def _per_batch(lengths, batch):
    return lengths.to(torch.int64).expand(batch).contiguous()


def _inner_contiguous(mask):
    return mask if mask.stride(-1) == 1 or mask.shape[-1] <= 1 else mask.contiguous()


# Model types whose attention layers append keys, and the mask entries for them, to the
# mask they are given: DeepSeek-V4's compressed layers concatenate their compressed
# entries' 0 / -inf block bias. A mask left out (None: "plain causal") has nothing to
# append to, and a causal flag then hides those entries, which eager attention shows.
_MODELS_THAT_EXTEND_MASKS = frozenset({"deepseek_v4"})


def additive_mask(*args, dtype: torch.dtype = torch.float32, config=None,
                  allow_is_causal_skip: bool = True, **kwargs) -> Optional[torch.Tensor]:
    """The masks ``"qkv"`` is given: ``"sdpa"``'s (None where a causal flag or no mask
    says the same), as additive floats in the model's dtype: 0 attends, -inf removes.
    Models compose masks as floats: DeepSeek-V4 concatenates a 0 / -inf bias cast to the
    mask's dtype, which a boolean mask would invert (-inf → True). route_mask turns the
    result back into causal / key_lengths / window once per forward (or a boolean mask
    where it has no pattern).

    -inf, not ``"eager"``'s most negative finite value: a query row that keeps no key (a
    left-padded position under a causal mask) then gives 0, as with ``"sdpa"``'s boolean
    masks and by qkv's own contract, where the finite value would make qkv, as eager,
    average every value of the row. Such rows are padding; the one before the first
    real token still enters a training loss (it predicts that token)."""
    if getattr(config, "model_type", None) in _MODELS_THAT_EXTEND_MASKS:
        allow_is_causal_skip = False
    keep = sdpa_mask(*args, allow_is_causal_skip=allow_is_causal_skip, **kwargs)
    if keep is None:
        return None
    keep = keep.to(torch.bool)  # (an integer padding mask gives integers)
    mask = torch.where(keep, torch.zeros((), dtype=dtype, device=keep.device),
                       torch.full((), float("-inf"), dtype=dtype, device=keep.device))
    if not torch.compiler.is_compiling():
        # route_mask reads the boolean instead of comparing the floats, while the mask is
        # unchanged (its version); a model's cat or slice makes a new tensor, read in full.
        setattr(mask, _BUILT_FROM, (mask._version, keep))
    return mask


# The attribute by which additive_mask's masks carry the boolean they were built from.
_BUILT_FROM = "_qkv_built_from"


def register() -> None:
    """Registers ``"qkv"`` with transformers (done once on import; calling it again is
    harmless): attention_forward for the attention, additive_mask for its masks."""
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, additive_mask)


register()

__all__ = ["CARRY_NOTHING", "IMPLEMENTED", "NAME", "Route", "additive_mask", "attention_forward",
           "register", "route_mask"]
