"""qkv.KVCache and qkv.decode: attention of new tokens against a key/value cache, for a
generation loop. Caches are read in place (torch or NumPy, float32, bfloat16, float16,
int8 or float8); queries and outputs are the caller's type and dtype, computed in float32.

Layouts: with ``layout="bhsd"`` (the default, PyTorch's and Hugging Face's) q, k, v and
out are ``[batch, heads, seq, dim]``; with ``"bshd"`` ``[batch, seq, heads, dim]``. A
paged cache is always the vLLM pool ``[num_blocks, block_size, kv_heads, dim]``.
"""

from __future__ import annotations

import sys

import numpy as np

from . import _decode_eager, _exit, _float8, _qkv
from ._arrays import Error
from ._decode_eager import (_check_layout, _empty_out, _float32_logical, _float32_packed, _int_array, _is_torch,
                            _options, _storage_name, refuse_grad)


def decode(q, k_cache, v_cache, cache_lengths, *, block_table=None, scale=None, causal="bottom_right",
           layout="bhsd", return_lse=False, threads=None, window=None, softcap=None, alibi_slopes=None,
           sinks=None, k_scale=None, v_scale=None, precision=None, indices=None, v_dim=None):
    """Attention of q against caller-owned caches, read in place (no copy of the cache).

    q: ``[B, Hq, Nq, d]`` (layout "bhsd") or ``[B, Nq, Hq, d]`` ("bshd"), any float dtype
    (computed in float32, returned in q's dtype).
    k_cache, v_cache: contiguous ``[B, Hkv, capacity, d]`` ("bhsd") / ``[B, capacity, Hkv, d]``
    ("bshd"); or, with ``block_table [B, max_blocks]`` (int32, or int64 whose entries
    fit int32), the paged pool
    ``[num_blocks, block_size, Hkv, d]``. float32, bfloat16, float16, int8 with scales, or
    float8 with scales (torch.float8_e4m3fn / torch.float8_e5m2 tensors, ml_dtypes arrays).
    cache_lengths: ``[B]`` keys held per sequence, the new tokens' own keys included.
    causal: ``"bottom_right"`` (default: the queries are each sequence's last tokens),
    ``"top_left"`` or None.
    int8 caches take ``k_scale`` and ``v_scale``, one float32 per cached row (the row's
    values are int8 · scale): ``[B, Hkv, capacity]`` ("bhsd"), ``[B, capacity, Hkv]``
    ("bshd"), or ``[num_blocks, block_size, Hkv]`` for a paged pool.
    float8 caches (vLLM's and SGLang's FP8 KV caches) take ``k_scale`` and ``v_scale`` as a
    float (per tensor) or a sequence / 1-D array / CPU tensor of Hkv floats (per kv head),
    each positive and finite: the cached values are float8 · scale. Required (vLLM's
    layers use 1.0 when a checkpoint has none: pass ``k_scale=1.0, v_scale=1.0`` for that);
    a missing, miscounted or bad scale raises qkv.Error naming it. Caches of other dtypes
    refuse a scale by name.
    scale, causal, threads, window, softcap, alibi_slopes, sinks, precision: as in ``qkv.attention``
    (the same Options, checked alike: a bad value gets the same error;
    ``window=(left, right)``, -1 or None unbounded; a sliding window reads only the keys
    in it).
    indices: optional key lists (DeepSeek sparse attention's top-k, as in
    ``qkv.sparse_attention``): int32 or int64 ``[B, Nq, topk]`` (shared by every head) or
    ``[B, Hkv, Nq, topk]`` (per kv head) of cache positions ``0..cache_lengths[b]-1``, -1
    for none. Each query attends the keys it lists (repeats once) that ``causal`` allows;
    an index outside ``[-1, cache_lengths[b])`` raises qkv.Error naming its batch entry
    and row. ``window`` and ``alibi_slopes`` are refused with them.
    v_cache=None with ``v_dim``: the values are the keys' first v_dim channels, read in
    place from k_cache (DeepSeek-V4's and Gemma 4's K = V layers, MLA's latent cache): no
    second cache, and each row is read from memory once. int8 and float8 keys lend the
    values their scales (k_scale).
    Returns out like q (with v's last dimension), or ``(out, lse [B, Hq, Nq])``.
    With torch tensors under torch.compile or torch.export the call is the operator
    ``torch.ops.qkv.decode`` (the same computation).
    """
    fn = "qkv.decode"
    _check_layout(fn, layout)
    if v_cache is None:
        v_cache, v_scale = _values_in_keys(fn, k_cache, v_dim, k_scale, v_scale)
    elif v_dim is not None:
        raise Error(f"{fn}: v_dim: only with v_cache=None (the values then being the keys' first v_dim channels)")
    refuse_grad(fn, q=q, k_cache=k_cache, v_cache=v_cache, k_scale=k_scale, v_scale=v_scale,
                alibi_slopes=alibi_slopes, sinks=sinks)
    if _is_torch(q):
        from . import _torch_ops_cache

        if _torch_ops_cache.traced(q):  # torch.compile, fake tensors: the operator
            from ._torch_ops import refuse_precision_when_traced

            refuse_precision_when_traced(precision)
            return _torch_ops_cache.traced_decode(
                fn, q, k_cache, v_cache, cache_lengths, block_table=block_table, scale=scale,
                causal=causal, layout=layout, return_lse=return_lse, threads=threads,
                window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                k_scale=k_scale, v_scale=v_scale, indices=indices)
    return _decode_eager.decode(q, k_cache, v_cache, cache_lengths, block_table=block_table,
                                scale=scale, causal=causal, layout=layout,
                                return_lse=return_lse, threads=threads, window=window,
                                softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                                k_scale=k_scale, v_scale=v_scale, precision=precision, indices=indices)


def _values_in_keys(fn, k_cache, v_dim, k_scale, v_scale):
    """(v_cache, v_scale) for v_cache=None: k_cache's first v_dim channels, a view."""
    if v_dim is None:
        raise Error(f"{fn}: v_cache: None needs v_dim (the values being the keys' first v_dim channels)")
    if v_scale is not None:
        raise Error(f"{fn}: v_scale: not with v_cache=None (the values use the keys' k_scale)")
    head_dim = k_cache.shape[-1]
    if isinstance(v_dim, bool) or not isinstance(v_dim, (int, np.integer)) or not 1 <= v_dim <= head_dim:
        raise Error(f"{fn}: v_dim: expected an integer in 1..{head_dim} (k_cache's head_dim), got {v_dim!r}")
    return k_cache[..., :int(v_dim)], k_scale


def mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, cache_lengths, *, block_table=None, scale,
               causal="bottom_right", indices=None, return_lse=False, threads=None, softcap=None, sinks=None,
               precision=None, ckv_scale=None, kpe_scale=None, cache_format=None):
    """Multi-head latent attention (DeepSeek V2/V3/V3.2, Kimi K2, GLM-5) in its absorbed form,
    over latent caches read in place: every query head attends the one latent head,

        S[h, j] = scale * (q_nope[h] . ckv[j] + q_pe[h] . kpe[j]),  out[h] = softmax(S[h]) @ ckv

    (W_UK folded into q_nope by the caller, W_UV applied to the output by the caller).

    q_nope ``[B, Nq, H, dc]``, q_pe ``[B, Nq, H, dr]``: any float dtype (computed in float32,
    returned in q_nope's dtype). ckv_cache ``[B, capacity, dc]`` and kpe_cache
    ``[B, capacity, dr]``, or with ``block_table [B, max_blocks]`` the paged pools
    ``[num_blocks, block_size, dc | dr]``: float32, bfloat16, float16, float8_e4m3fn or
    float8_e5m2 (both the same; float8 as torch tensors or ml_dtypes arrays), never copied.
    ckv_scale, kpe_scale: float8 caches only, and required for them — each cache's scale
    per tensor (a float or a one-element tensor), the stored values being cache · scale. cache_lengths ``[B]``: keys held, the new tokens' own included.
    scale: required — the model's own (DeepSeek: ``1/sqrt(qk_nope_head_dim +
    qk_rope_head_dim)`` times its YaRN factor; ``1/sqrt(dc + dr)`` would be wrong).
    causal: ``"bottom_right"`` (default: query i of Nq sees keys ``j <= i + length - Nq``,
    speculative and multi-token-prediction steps), ``"top_left"`` or None.
    indices: DeepSeek-V3.2's sparse attention, ``[B, Nq, topk]`` int32/int64 cache
    positions, -1 none (``qkv.sparse_attention``'s rules). softcap, sinks, threads,
    precision: as in ``qkv.attention``. Returns out ``[B, Nq, H, dc]``, or ``(out, lse
    [B, H, Nq])``. With torch tensors under torch.compile or torch.export the call is the
    operator ``torch.ops.qkv.mla_decode``.

    cache_format="fp8_ds_mla": FlashMLA's FP8 latent cache (vLLM's kv_cache_dtype of that
    name; DeepSeek-V3.2, GLM-5). ckv_cache is then one uint8 array of records
    ``[B, capacity, R]`` or paged ``[num_blocks, block_size, R]``, R = dc + 4*dc/128 + 2*dr
    bytes (656 for 512 + 64): c_kv as float8_e4m3fn, one float32 scale per 128 values, k_pe
    as bfloat16; kpe_cache is None and the records carry the scales (ckv_scale, kpe_scale
    refused). Window and alibi_slopes are refused. Under torch.compile the operator is
    ``torch.ops.qkv.mla_decode_records``.
    """
    fn = "qkv.mla_decode"
    if cache_format is not None:
        return _mla_decode_records(fn, q_nope, q_pe, ckv_cache, kpe_cache, cache_lengths, block_table=block_table,
                                   scale=scale, causal=causal, indices=indices, return_lse=return_lse,
                                   threads=threads, softcap=softcap, sinks=sinks, precision=precision,
                                   ckv_scale=ckv_scale, kpe_scale=kpe_scale, cache_format=cache_format)
    refuse_grad(fn, q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv_cache, kpe_cache=kpe_cache, sinks=sinks)
    if _is_torch(q_nope):
        from . import _torch_ops_cache

        if _torch_ops_cache.traced(q_nope):
            from ._torch_ops import refuse_precision_when_traced

            refuse_precision_when_traced(precision)
            return _torch_ops_cache.traced_mla_decode(
                fn, q_nope, q_pe, ckv_cache, kpe_cache, cache_lengths, block_table=block_table, scale=scale,
                causal=causal, indices=indices, return_lse=return_lse, threads=threads, softcap=softcap,
                sinks=sinks, ckv_scale=ckv_scale, kpe_scale=kpe_scale)
    return _decode_eager.mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, cache_lengths, block_table=block_table,
                                    scale=scale, causal=causal, indices=indices, return_lse=return_lse,
                                    threads=threads, softcap=softcap, sinks=sinks, precision=precision,
                                    ckv_scale=ckv_scale, kpe_scale=kpe_scale)


def _mla_decode_records(fn, q_nope, q_pe, ckv_cache, kpe_cache, cache_lengths, *, cache_format, ckv_scale,
                        kpe_scale, precision, **kwargs):
    """mla_decode over FlashMLA's FP8 records (cache_format="fp8_ds_mla")."""
    if cache_format != "fp8_ds_mla":
        raise Error(f"{fn}: cache_format: expected None or 'fp8_ds_mla' (FlashMLA's FP8 records), got "
                    f"{cache_format!r}")
    for name, value, why in (("kpe_cache", kpe_cache, "the records hold k_pe"),
                             ("ckv_scale", ckv_scale, "the records hold their scales"),
                             ("kpe_scale", kpe_scale, "the records hold their scales")):
        if value is not None:
            raise Error(f"{fn}: {name}: expected None with cache_format='fp8_ds_mla' ({why})")
    refuse_grad(fn, q_nope=q_nope, q_pe=q_pe, sinks=kwargs["sinks"])
    if _is_torch(q_nope):
        from . import _torch_ops_cache

        if _torch_ops_cache.traced(q_nope):
            from ._torch_ops import refuse_precision_when_traced

            refuse_precision_when_traced(precision)
            return _torch_ops_cache.traced_mla_decode_records(fn, q_nope, q_pe, ckv_cache, cache_lengths, **kwargs)
    return _decode_eager.mla_decode_records(q_nope, q_pe, ckv_cache, cache_lengths, precision=precision, **kwargs)


def _scale_dtype_name(scale_dtype) -> str:
    """A KVCache's scale_dtype as the extension takes it; the extension refuses types
    other than float32 and float16 with the C++ message."""
    try:
        return _storage_name(scale_dtype)
    except Error:
        raise Error(f"qkv::KVCache: config.scale_dtype: expected float32 or float16, got {scale_dtype!r}") from None


class KVCache:
    """Keys and values of `batch` sequences, allocated once (appends never reallocate).

        cache = qkv.KVCache(batch, capacity, kv_heads, head_dim, dtype="bfloat16")
        cache.append(k, v)        # k, v [B, Hkv, T, d]: T new tokens per sequence
        out = cache.attend(q)     # q [B, Hq, T, d] against everything cached

    dtype: "float32", "bfloat16" or "float16" (or the torch/NumPy dtype): appended values
    are rounded once to it. paged=True keeps a pool of `num_blocks` blocks of
    `block_size` keys (default: enough for every sequence at capacity) and a block table
    per sequence, the layout vLLM uses; blocks are taken as sequences grow and returned
    by reset(seq).

    dtype="int8" quantizes each stored row with its own scale (max|x| / 127). With
    key_scales="channel" the keys are quantized per channel over groups of `group_size`
    tokens instead, each channel's range in the group mapped onto the 256 levels (a scale
    and a zero point; post-RoPE keys have outlier channels that one scale per row spends
    most of the int8 range on); the newest, partial group is quantized again as it fills.
    paged: group_size must divide block_size.

    dtype="int4" (keys always per channel: key_scales defaults to "channel" for it) stores
    two values a byte: keys per channel over groups of `group_size` tokens, values per
    token over groups of 32 channels, each range mapped onto 16 levels with a scale and
    zero point — float16 (scale_dtype=None or "float16": 4.8 bits a value at group_size
    64 and head_dim 128, keys and values within ±65504) or float32 (scale_dtype="float32":
    5.6 bits, the same accuracy on SmolLM2). float_window=W (int8 and int4 with channel keys) keeps the
    newest tokens' keys and values as float32 — at least W and fewer than W + group_size
    of them — and quantizes a group once its last key is W tokens old: attention weight
    sits on recent tokens, and on SmolLM2 a window of 32 cuts a 4-bit cache's KL
    divergence about tenfold (bench/KV_QUANTIZATION.md). Default (None): 32 for int4
    (min(32, capacity); without it a 4-bit cache misses the quality bar, mean KLD 2e-2),
    none otherwise; float_window=0 asks for none. stored(seq) returns the values
    attention reads.

    dtype="float8_e4m3fn" or "float8_e5m2" (or torch.float8_e4m3fn / ml_dtypes' types)
    stores one byte a value, float8(x / scale) rounded to nearest even (torch's bits),
    finite values beyond the format's largest (448, 57344) saturating to it (torch 2.13's
    CPU cast overflows e5m2 to inf); NaN stays NaN, inf is inf (e5m2) or NaN (e4m3fn). k_scale, v_scale: a float (per tensor) or kv_heads floats
    (per kv head), positive and finite, both or neither; None: per kv head, set by the first
    append that brings tokens to max |x| of that head's finite values / the largest
    finite value (1 for a head with no nonzero one), then kept (reset keeps them).
    scales() reports them ([kv_heads] each).
    """

    def __init__(self, batch, capacity, kv_heads, head_dim, *, v_dim=None, dtype="float32", paged=False,
                 block_size=16, num_blocks=None, layout="bhsd", key_scales=None, group_size=32, float_window=None,
                 scale_dtype=None, k_scale=None, v_scale=None):
        _check_layout("qkv.KVCache", layout)
        self.layout = layout
        storage = _storage_name(dtype, "qkv.KVCache")
        if key_scales is None:
            key_scales = "channel" if storage == "int4" else "row"
        self._cache = _qkv.KVCache(batch, capacity, kv_heads, head_dim, v_dim or 0, storage,
                                   bool(paged), block_size, num_blocks or 0, key_scales, group_size,
                                   None if float_window is None else int(float_window),
                                   "" if scale_dtype is None else _scale_dtype_name(scale_dtype),
                                   _float8.config_scales("qkv.KVCache", "k_scale", k_scale),
                                   _float8.config_scales("qkv.KVCache", "v_scale", v_scale))
        _exit.release_at_exit(self)  # the C++ cache is freed before the interpreter finalizes (qkv/_exit.py)
        self.batch, self.kv_heads, self.head_dim = batch, kv_heads, head_dim
        self.v_dim = v_dim or head_dim
        # For torch.compile: the handle its operators name the cache by, and the state
        # tensor they order appends and attends by (qkv/_torch_ops_cache.py).
        self._handle = self._state = None
        if "torch" in sys.modules:
            self._register_for_torch()

    def _release(self):
        """At exit (qkv/_exit.py): frees the C++ cache; any later use raises qkv.Error."""
        self._cache = _exit.Released("qkv.KVCache")

    def _register_for_torch(self):
        import torch

        from . import _torch_ops_cache

        self._handle = _torch_ops_cache.register_cache(self)
        self._state = torch.tensor(self.lengths, dtype=torch.int64)

    @property
    def handle(self):
        """The int64 scalar tensor torch.ops.qkv.kv_cache_append / kv_cache_attend name this
        cache by (a graph input under torch.compile: qkv/_torch_ops_cache.py's Handles)."""
        if self._handle is None:
            self._register_for_torch()
        return self._handle

    def torch_state(self):
        """The int64 [batch] tensor the traced operators carry (keys cached per sequence,
        as of the last traced append)."""
        if self._state is None:
            self._register_for_torch()
        return self._state

    # Read-only facts.
    dtype = property(lambda self: self._cache.dtype)
    paged = property(lambda self: self._cache.paged)
    block_size = property(lambda self: self._cache.block_size)
    capacity = property(lambda self: self._cache.capacity)
    free_blocks = property(lambda self: self._cache.free_blocks)
    key_scales = property(lambda self: self._cache.key_scales)
    group_size = property(lambda self: self._cache.group_size)
    scale_dtype = property(lambda self: self._cache.scale_dtype)
    float_window = property(lambda self: self._cache.float_window)

    @property
    def quantized_lengths(self):
        """With a float window: keys per sequence read from the quantized storage (the
        newer ones are float32); an empty list without one."""
        return self._cache.quantized_lengths

    def stored(self, seq):
        """(k, v): the keys and values attention reads for sequence `seq` as float32 copies —
        the storage widened or dequantized, the float window's rows as they are —
        ``[Hkv, length, d]`` ("bhsd") or ``[length, Hkv, d]`` ("bshd")."""
        k, v = self._cache.stored(int(seq))
        if self.layout == "bhsd":
            k, v = np.ascontiguousarray(k.transpose(1, 0, 2)), np.ascontiguousarray(v.transpose(1, 0, 2))
        return k, v

    def value_group_scales(self):
        """int4: each value row's group scales then zero points, ``[B, capacity, Hkv,
        2·groups]`` (paged: the pool's rows) NumPy view; value c of a row is ``level · s[c //
        32] + z[c // 32]``. None otherwise."""
        return self._cache.value_group_scales()

    @property
    def lengths(self):
        """Keys held per sequence (a new list)."""
        return self._cache.lengths

    def append(self, k, v, seq=None, **rotary):
        """Appends T new tokens: k ``[n, Hkv, T, d]``, v ``[n, Hkv, T, dv]`` (layout "bhsd")
        for the sequences `seq` (an int, a list of ints, or None for all `batch`).
        Traced (torch.compile, torch.export): the mutating operator
        ``torch.ops.qkv.kv_cache_append``; attend is ``kv_cache_attend``.
        rotary_cos, rotary_sin (``[n*T | max_position, rotary_dim]``, or transformers'
        ``[n, T, rotary_dim]``), rotary_interleaved, rotary_dim, positions: the keys are
        rotated on the way in (k itself is not modified; qkv/_rotary.py; eager only)."""
        fn = "qkv.KVCache.append"
        refuse_grad(fn, k=k, v=v)  # the cache stores values, not a graph: never drop one silently
        if rotary:
            from . import _rotary

            return _rotary.cache_append(self, k, v, seq, _rotary_keywords(fn, rotary))
        if _is_torch(k):
            from . import _torch_ops_cache

            if _torch_ops_cache.traced(k):
                return _torch_ops_cache.traced_append(self, k, v, seq)
        seqs = None if seq is None else ([int(seq)] if np.ndim(seq) == 0 else [int(s) for s in seq])
        self._cache.append(_float32_logical(k, self.layout, "k", fn), _float32_logical(v, self.layout, "v", fn),
                           seqs)

    def append_varlen(self, k, v, cu_seqlens, seq=None):
        """Appends a serving step's packed new tokens: k ``[total, Hkv, d]``, v ``[total,
        Hkv, dv]`` (any layout argument aside: packed rows, as qkv.BatchPlan takes q), rows
        ``cu_seqlens[n]:cu_seqlens[n+1]`` to sequence n (or to ``seq[n]``); 0 rows allowed."""
        fn = "qkv.KVCache.append_varlen"
        refuse_grad(fn, k=k, v=v)
        seqs = None if seq is None else ([int(seq)] if np.ndim(seq) == 0 else [int(s) for s in seq])
        offsets = [int(x) for x in np.asarray(_int_array(cu_seqlens, None, "cu_seqlens", fn)).reshape(-1)]
        k_lib, v_lib = (_float32_packed(x, name, fn) for x, name in ((k, "k"), (v, "v")))
        self._cache.append_varlen(k_lib, v_lib, offsets, seqs)

    def attend(self, q, *, scale=None, causal="bottom_right", return_lse=False, threads=None, window=None,
               softcap=None, alibi_slopes=None, sinks=None, precision=None, indices=None, k_new=None, v_new=None,
               **rotary):
        """Attention of q ``[B, Hq, T, d]`` against every sequence's cache, the T queries
        aligned with each sequence's newest keys. window, softcap, alibi_slopes, sinks,
        precision, indices (key lists of cache positions): as in ``qkv.decode``. Returns
        out like q, or (out, lse).
        k_new, v_new ``[B, Hkv, T, d | dv]``: appended to every sequence first (the cache
        is modified), with rotary_cos/rotary_sin/... as in append; q is then rotated alike
        (into scratch: the caller's q is not modified) and attends. q's shape is checked
        against k_new before the append. Eager only."""
        fn = "qkv.KVCache.attend"
        if k_new is not None or v_new is not None or rotary:
            from . import _rotary

            return _rotary.cache_attend(
                self, q, k_new, v_new, _rotary_keywords(fn, rotary),
                lambda rotated: self.attend(rotated, scale=scale, causal=causal, return_lse=return_lse,
                                            threads=threads, window=window, softcap=softcap,
                                            alibi_slopes=alibi_slopes, sinks=sinks, precision=precision,
                                            indices=indices))
        refuse_grad(fn, q=q, alibi_slopes=alibi_slopes, sinks=sinks)
        if _is_torch(q):
            from . import _torch_ops_cache

            if _torch_ops_cache.traced(q):
                from ._torch_ops import refuse_precision_when_traced

                refuse_precision_when_traced(precision)
                return _torch_ops_cache.traced_attend(
                    self, q, scale=scale, causal=causal, return_lse=return_lse,
                    threads=threads, window=window, softcap=softcap,
                    alibi_slopes=alibi_slopes, sinks=sinks, indices=indices)
        options = _options(fn, q, scale, causal, threads, window, softcap, alibi_slopes, sinks, precision)
        q_lib = _float32_logical(q, self.layout, "q", fn)
        batch, q_len, q_heads, _ = q_lib.shape
        out, work, out_lib = _empty_out(q, batch, q_len, q_heads, self.v_dim, self.layout)
        lse = np.empty((batch, q_heads, q_len), dtype=np.float32) if return_lse else None
        self._cache.attend(q_lib, out_lib, lse=lse, indices=_decode_eager.key_lists(indices), options=options)
        return _decode_eager.result(q, out, work, lse)

    def index_topk(self, q, weights, topk, *, scale=None, causal="bottom_right", threads=None, precision=None):
        """DeepSeek's lightning indexer (``qkv.index_topk``) with this cache's keys as the
        indexer's keys: a cache of index keys (``kv_heads=1``, ``head_dim=di``; its values are
        never read, so make it with ``v_dim=1``). q ``[B, Nq, Hi, di]`` and weights
        ``[B, Nq, Hi]`` in the indexer's shapes whatever the cache's layout (q float32 or
        bfloat16; weights any float, used as float32), NumPy or CPU torch. precision as in
        ``qkv.index_topk``: bfloat16 q over a bfloat16 cache takes the CPU's bf16 unit
        (vdpbf16ps or the AMX tiles) with "fast" (the default). Returns int32
        ``[B, Nq, topk]``: sequence b's top keys among its cached ones by descending
        ``Σ_h weights·relu(scale·q·k)``, ties to the lower index, -1 past the keys a row may
        see. causal ``"bottom_right"`` (the default: row i sees keys
        ``0 .. length(b) - Nq + i``), ``"top_left"`` or None. Every storage (int8, int4,
        paged, float windows) is read in place, each key exactly as ``stored()`` returns it.
        Eager only (no torch.compile operator)."""
        from ._core import eager_cache_index_topk

        return eager_cache_index_topk(self._cache, q, weights, topk, scale=scale, causal=causal, threads=threads,
                                      precision=precision)

    def reset(self, seq=None):
        """Empties one sequence (or all); a paged cache gets their blocks back."""
        if seq is None:
            self._cache.reset()
        else:
            self._cache.reset(int(seq))

    def storage(self):
        """(keys, values): NumPy views of the cache memory — ``[B, capacity, Hkv, d]`` or
        the paged pool ``[num_blocks, block_size, Hkv, d]``; float32, int8, uint16 holding
        bfloat16/float16 bits, uint8 holding float8 bytes (``.view(ml_dtypes.float8_e4m3fn)``
        reads them as such; torch_storage() gives torch float8 tensors), or (int4) uint8
        pairs of levels ``[..., ⌈d / 2⌉]``, channel 2i in the low nibble. Shares memory with the cache (it stays alive with them)."""
        return self._cache.key_storage(), self._cache.value_storage()

    def scales(self):
        """int8: (key scales, value scales), ``[B, capacity, Hkv]`` (or the paged pool's
        ``[num_blocks, block_size, Hkv]``) NumPy views, one float32 per stored row; None
        for other dtypes. The stored values are ``storage() · scales()`` (broadcast).
        int4: (the keys' row scales — 1, or NaN for a non-finite key — None). Every scale
        array of an int4 cache with scale_dtype="float16" is float16.
        float8: (key scales, value scales), float32 ``[Hkv]`` copies, one per kv head (a
        per-tensor scale repeated): the stored values are ``storage() · scale[h]``. None
        until the first append sets them when none were given."""
        return self._cache.scales()

    def channel_scales(self):
        """key_scales="channel": (scales, zero points) of the keys' channels, each
        ``[B, groups, Hkv, d]`` (paged: ``[num_blocks, block_size / group_size, Hkv, d]``)
        NumPy views — key j of a sequence is ``row scale · (storage · scale + zero)`` with
        its group's scale and zero (row scale: scales()[0], 1 or NaN); None otherwise.
        float32, or float16 with scale_dtype="float16"."""
        return self._cache.channel_scales()

    def torch_storage(self):
        """(keys, values) as torch tensors of the cache's dtype over its memory (no copy)."""
        import torch

        keys, values = self.storage()
        to = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
              "int8": torch.int8, "int4": torch.uint8, "float8_e4m3fn": torch.float8_e4m3fn,
              "float8_e5m2": torch.float8_e5m2}[self.dtype]
        k, v = torch.from_numpy(keys), torch.from_numpy(values)
        if to in (torch.bfloat16, torch.float16):
            k, v = k.view(torch.int16).view(to), v.view(torch.int16).view(to)
        elif to in (torch.float8_e4m3fn, torch.float8_e5m2):  # the same bytes, uint8 to NumPy
            k, v = k.view(to), v.view(to)
        return k, v

    def block_table(self):
        """Paged: ``[batch, blocks per sequence]`` int32 view, -1 where no block is assigned."""
        return self._cache.block_table()


def _rotary_keywords(function, keywords):
    """The rotary keywords of KVCache.append/attend; any other is a TypeError naming it."""
    allowed = ("rotary_cos", "rotary_sin", "rotary_interleaved", "rotary_dim", "positions")
    for name in keywords:
        if name not in allowed:
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")
    return keywords
