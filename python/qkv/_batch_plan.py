"""qkv.BatchPlan: one attention call per layer for a whole continuous-batching step —
prefill chunks and decode tokens of many sequences against their caches (contiguous, or
the paged pool vLLM and FlashAttention use), planned once per step.

    plan = qkv.BatchPlan(cu_seqlens_q, cache_lengths, num_heads=32, num_kv_heads=8,
                         head_dim=128, block_table=table, block_size=16)
    for layer in layers:
        out = plan.run(q, k_pool[layer], v_pool[layer])   # q [total_q, Hq, d]

Draft trees (speculative decoding): ``tree_mask`` holds each sequence's boolean
``[n_s, n_s]`` mask among its new tokens, flattened, from ``tree_mask_offsets[s]``:

    plan = qkv.BatchPlan(cu_seqlens_q, cache_lengths, ..., tree_mask=masks.ravel(),
                         tree_mask_offsets=offsets)   # offsets[s] = -1: no tree

See qkv/batch_plan.hpp for the contract (what a sequence's bits depend on, the errors).
"""

from __future__ import annotations

import sys

import numpy as np

from . import _exit, _float8, _qkv
from ._decode_eager import (_cache_array, _float32_packed, _int_array, _is_torch, _storage_name, records_array,
                            refuse_grad)
from ._options import make_options
from ._arrays import Error, NumPy, Torch
from ._decode import KVCache


def _scales(name, x, bits_as):
    """k_scale / v_scale as the binding reads them: a float8 cache's 1 or Hkv floats as a
    float32 vector (qkv/_float8.py), int8 row scales as they are."""
    if bits_as in _float8.FORMATS:
        return _float8.scale_vector("qkv.BatchPlan.run", name, x)
    if x is None:
        return None
    return x.detach().numpy() if _is_torch(x) else np.asarray(x)


def _tree_mask(mask, function: str):
    """tree_mask as the flat, contiguous bool/uint8 array the binding reads (None: no trees)."""
    if mask is None:
        return None
    if _is_torch(mask):
        mask = mask.detach().cpu().numpy()
    array = np.asarray(mask)
    if array.dtype != np.bool_ and array.dtype != np.uint8:
        raise TypeError(f"{function}: tree_mask: expected dtype bool or uint8, got {array.dtype}")
    return np.ascontiguousarray(array.reshape(-1))


class BatchPlan:
    """A serving step planned once: ``cu_seqlens_q [B+1]`` (prefix sums of each sequence's
    new queries; int32 or int64), ``cache_lengths [B]`` (keys each cache holds, the new
    tokens' own included), the heads and head sizes, and for a paged pool its
    ``block_table [B, max_blocks]`` and ``block_size``. The options are qkv.attention's
    (the same checks, the same errors); causal defaults to "bottom_right" (each sequence's
    new queries are its newest tokens). fixed_key_split=True makes a row's bits depend only
    on that row and the keys it sees (a token decoded alone reproduces its prefill row).
    dtype: the caches' dtype the plan's cost model assumes (default float32); runs over
    caches of another dtype are planned again once for that dtype.
    precision: None or "fast" (the default) or "exact", as qkv.decode's: with "fast", pools
    of bfloat16 (or float8 with values in the keys) with one kv head and >= 16 query heads
    run on AVX512-BF16 where the CPU has it (docs/numerics.md); "exact" keeps float32.

    Draft trees (verifying an EAGLE/Medusa/MTP tree in one step): ``tree_mask``, bool or
    uint8 (NumPy or torch; any shape, read flattened in row-major order), holds for each
    sequence s with a tree its ``[n_s, n_s]`` mask among its n_s new tokens (its last n_s
    keys), row-major from ``tree_mask_offsets[s]`` (one int per sequence; -1: no tree).
    Entry (i, j) true: new token i sees new token j. Each new token sees the whole cached
    prefix and exactly the new tokens its row says: the tree replaces causality among them
    (causal "bottom_right" or "none" alike; "top_left" is refused), any pattern is allowed
    (a token may see a later one), but every token must see itself (the diagonal is true).
    Equal to attention with that dense mask; keys a row does not see never reach it. Not
    with window, alibi_slopes or indices; softcap and sinks combine. The plan copies the masks.

    Shared prefixes (parallel sampling, beam search, a common system prompt; FlashInfer's
    cascade attention): with ``shared_prefixes=True`` and a paged layout, sequences whose
    block tables start with the same pool blocks are grouped at plan time
    (``plan.prefix_groups``); each group's shared keys are attended once for all its
    members' queries and merged with each member's own keys by LSE. Rows equal the plain
    step's within float32 rounding; grouped rows' bits depend on their group (not batch
    invariant); deterministic for any thread count. Not with causal "top_left", window,
    alibi_slopes, fixed_key_split, or indices at run; softcap and sinks combine.
    """

    def __init__(self, cu_seqlens_q, cache_lengths, *, num_heads, num_kv_heads, head_dim, v_dim=None,
                 block_table=None, block_size=None, causal="bottom_right", window=None, softcap=None,
                 alibi_slopes=None, sinks=None, scale=None, threads=None, fixed_key_split=False, dtype=None,
                 tree_mask=None, tree_mask_offsets=None, shared_prefixes=False, precision=None):
        fn = "qkv.BatchPlan"
        framework = Torch if any(_is_torch(x) for x in (cu_seqlens_q, alibi_slopes, sinks)) else NumPy
        self._options = make_options(fn, framework, scale=scale, causal=causal, threads=threads, window=window,
                                     softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                                     fixed_key_split=fixed_key_split, precision=precision)
        self._layout = dict(
            cu_seqlens_q=_int_array(cu_seqlens_q, None, "cu_seqlens_q", fn),
            cache_lengths=_int_array(cache_lengths, None, "cache_lengths", fn),
            num_heads=int(num_heads), num_kv_heads=int(num_kv_heads), head_dim=int(head_dim),
            v_dim=int(v_dim or 0),
            block_table=None if block_table is None else _int_array(block_table, None, "block_table", fn),
            block_size=0 if block_size is None else int(block_size),
            tree_mask=_tree_mask(tree_mask, fn),
            tree_mask_offsets=None if tree_mask_offsets is None else _int_array(
                tree_mask_offsets, None, "tree_mask_offsets", fn),
            share_prefixes=bool(shared_prefixes))
        if block_table is not None and block_size is None:
            raise Error(f"{fn}: block_size: expected the pool's rows per block with a block_table")
        self._v_dim = int(v_dim or head_dim)
        first = "float32" if dtype is None else _storage_name(dtype, fn)
        self._plans = {first: self._plan(first)}  # validates the layout now
        _exit.release_at_exit(self)  # the C++ plans and options are freed before finalization (qkv/_exit.py)
        # The traced operator's name for this plan (qkv/_torch_ops_cache.py), made here, out of
        # any trace; a plan made before torch is imported is not traceable.
        self._handle = None
        if "torch" in sys.modules:
            from . import _torch_ops_cache

            self._handle = _torch_ops_cache.register_plan(self)

    def _release(self):
        """At exit (qkv/_exit.py): frees the C++ plans and options; any later use raises qkv.Error."""
        self._plans = self._options = _exit.Released("qkv.BatchPlan")

    def _plan(self, storage: str):
        return _qkv.BatchPlan(storage=storage, options=self._options, **self._layout)

    sequences = property(lambda self: next(iter(self._plans.values())).sequences)
    total_queries = property(lambda self: next(iter(self._plans.values())).total_queries)

    def task_costs(self):
        """The plan's cost estimate per task (flop-equivalents), costliest first."""
        return next(iter(self._plans.values())).task_costs()

    @property
    def prefix_groups(self):
        """With shared_prefixes=True: the groups found, ``[(sequences, shared_keys), ...]``
        (sequences ascending; shared keys are whole blocks from key 0). Empty otherwise."""
        return [(list(members), keys) for members, keys in next(iter(self._plans.values())).prefix_groups()]

    v_dim = property(lambda self: self._v_dim)

    def run(self, q, k_cache, v_cache, *, k_scale=None, v_scale=None, return_lse=False, indices=None, k_new=None,
            v_new=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=False, rotary_dim=None, positions=None,
            k_rope_cache=None, cache_format=None, k_rope_new=None, power_of_two_scales=True):
        """One layer: q ``[total_q, Hq, d]`` against ``k_cache``/``v_cache`` — contiguous
        ``[B, capacity, Hkv, d]`` or the pool ``[num_blocks, block_size, Hkv, d]``, float32,
        bfloat16, float16, int8 (with ``k_scale``/``v_scale``, one float32 per row) or float8
        (torch.float8_e4m3fn / float8_e5m2 or ml_dtypes; ``k_scale``/``v_scale`` a float or
        Hkv floats, required: as ``qkv.decode``), read in place; or ``k_cache`` a ``qkv.KVCache`` (v_cache None): any of its storages
        (int4 and float windows too), its lengths and block table the plan's. Returns out
        ``[total_q, Hq, dv]`` (q's dtype when floating) or
        ``(out, lse [Hq, total_q])``. Traceable (torch.compile fullgraph, torch.export):
        torch.ops.qkv.batch_plan_run, the plan named by a handle. Forward-only: an input
        that requires grad (with grad mode on) is an error.
        indices: optional packed key lists (DeepSeek sparse attention's top-k), int32 or
        int64 ``[total_q, topk]``: row n lists positions ``0..cache_lengths[b]-1`` within
        the n-th packed query's own sequence b, -1 for none; as ``qkv.decode``'s indices
        (causal on top, repeats once, out-of-range a qkv.Error naming sequence and row).
        v_cache=None with an array k_cache: the values are its first ``v_dim`` channels (the
        plan's), read in place (K = V layers, MLA's latent cache); int8 and float8 keys lend
        their k_scale.
        k_new, v_new ``[total_q, Hkv, d | dv]`` (packed as q): the step's new tokens, written
        into each sequence's last rows of k_cache/v_cache (the plan's cache_lengths count
        them) — IN PLACE: the caller's caches (and int8 scales) are modified — then
        attended, in one call. rotary_cos/rotary_sin ``[total_q, rotary_dim]`` (or tables
        ``[max_position, rotary_dim]`` indexed by ``positions [total_q]``): q and k_new are
        rotated first (NeoX half-split order; pairs with ``rotary_interleaved=True``; the
        first ``rotary_dim`` channels when that is below head_dim). q itself is never
        modified (rotated into scratch). qkv/_rotary.py and docs/decode-and-caches.md say more.
        Traced: torch.ops.qkv.batch_plan_run_appending, which declares the caches mutated.
        k_rope_cache: MLA's latent cache as two pools (FlashInfer's ckv / kpe): k_cache
        ``[.., Hkv, dc]`` holds each key's first dc channels and k_rope_cache ``[.., Hkv, dr]``
        (same dtype, layout and block table) its last dr, head_dim = dc + dr (both 3-D,
        FlashInfer's ``[blocks, block_size, dc | dr]``: one kv head); q's rows are
        ``[q_nope | q_pe]``; with v_cache=None and v_dim=dc the values are k_cache's rows.
        Read in place, bitwise the step over one combined pool of the same values. float32,
        bfloat16 and float16 only (int8 and float8 refused: a combined pool takes them); not
        with a qkv.KVCache. With k_new ``[total_q, Hkv, dc]`` and k_rope_new ``[total_q, Hkv,
        dr]`` (``[total_q, dc | dr]`` with 3-D pools) the step's new rows are written into both
        pools first (FlashInfer's append_paged_mla_kv_cache, then the run, in one call): the
        rotary tables rotate k_rope_new and q's last dr channels only (q_pe; DeepSeek's pairs
        are ``rotary_interleaved=True`` with tables ``repeat_interleave(freqs, 2)``, vLLM's
        is_neox_style=False); v_cache None: the values are the latent rows k_new writes (no
        v_new).
        cache_format="fp8_ds_mla": k_cache is FlashMLA's FP8 records (vLLM's kv_cache_dtype of
        that name; qkv.mla_decode's layout), uint8 ``[B, capacity, R]`` or the pool
        ``[num_blocks, block_size, R]``, read in place; v_cache None; the plan has one kv
        head, head_dim dc + dr and v_dim dc (a multiple of 128). Each query row runs on
        mla_decode's records kernel, so a sequence's rows are mla_decode's over the same
        records. indices as above; window, ALiBi, trees and shared prefixes refused. Traced:
        torch.ops.qkv.batch_plan_run_records. With k_new (c_kv ``[total_q, dc]``) and
        k_rope_new (k_pe ``[total_q, dr]``) the step's new tokens are packed into their records
        first, IN PLACE (as qkv.pack_mla_records packs them, power_of_two_scales its rule; the
        rotary tables rotate k_pe and q_pe), then attended; traced:
        torch.ops.qkv.batch_plan_run_records_appending."""
        refuse_grad("qkv.BatchPlan.run", q=q, k_cache=k_cache, v_cache=v_cache, k_scale=k_scale, v_scale=v_scale,
                    k_new=k_new, v_new=v_new, k_rope_cache=k_rope_cache, k_rope_new=k_rope_new)
        appending = dict(k_new=k_new, k_rope_new=k_rope_new, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                         rotary_dim=rotary_dim, positions=positions, rotary_interleaved=rotary_interleaved)
        if cache_format is not None:
            return self._run_records(q, k_cache, cache_format, return_lse, indices, appending, power_of_two_scales,
                                     v_cache=v_cache, k_scale=k_scale, v_scale=v_scale, k_rope_cache=k_rope_cache,
                                     v_new=v_new)
        if power_of_two_scales is not True:
            raise Error("qkv.BatchPlan.run: power_of_two_scales: only with cache_format='fp8_ds_mla' and k_new (the "
                        "scales of the records the call packs)")
        if k_rope_cache is not None and isinstance(k_cache, KVCache):
            raise Error("qkv.BatchPlan.run: k_rope_cache: not with a qkv.KVCache as k_cache (a cache keeps each "
                        "key whole); pass the two pools as arrays")
        if k_rope_new is not None and k_rope_cache is None:
            raise Error("qkv.BatchPlan.run: k_rope_new: only with k_rope_cache (keys in two parts: their last dr "
                        "channels are written there)")
        if k_rope_cache is not None and getattr(k_cache, "ndim", 0) == 3 and getattr(k_rope_cache, "ndim", 0) == 3:
            # FlashInfer's pools [blocks, block_size, dc] / [.., dr]: the one latent head as a view
            k_cache, k_rope_cache = k_cache[:, :, None], k_rope_cache[:, :, None]
            v_cache = v_cache if getattr(v_cache, "ndim", 0) != 3 else v_cache[:, :, None]
            k_new, k_rope_new, v_new = (x[:, None] if getattr(x, "ndim", 0) == 2 else x for x in (k_new, k_rope_new, v_new))
        if any(x is not None for x in (k_new, v_new, rotary_cos, rotary_sin, rotary_dim, positions)) or rotary_interleaved:
            from . import _rotary

            if k_rope_cache is not None:  # MLA's two pools: rows written into both, then the step
                return _rotary.run(self, q, k_cache, v_cache, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse,
                                   indices=indices, k_new=k_new, v_new=v_new, rotary_cos=rotary_cos,
                                   rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved, rotary_dim=rotary_dim,
                                   positions=positions, k_rope_new=k_rope_new, k_rope_cache=k_rope_cache)

            from ._float8 import cache_bytes

            if any(cache_bytes(x, name, "qkv.BatchPlan.run") is not None
                   for x, name in ((k_cache, "k_cache"), (v_cache, "v_cache")) if x is not None and not isinstance(x, KVCache)):
                raise Error("qkv.BatchPlan.run: k_new: float8 caches are not yet written from Python (the C++ "
                            "BatchPlan::run_appending writes them); append with the caches' own writer, then run")
            if isinstance(k_cache, KVCache):
                raise Error("qkv.BatchPlan.run: k_new: not with a qkv.KVCache as k_cache (the cache appends its own "
                            "new tokens: cache.append(k, v, rotary_cos=...), or cache.attend(q, k_new=, v_new=))")
            return _rotary.run(self, q, k_cache, v_cache, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse,
                               indices=indices, k_new=k_new, v_new=v_new, rotary_cos=rotary_cos,
                               rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved, rotary_dim=rotary_dim,
                               positions=positions)
        if v_cache is None and not isinstance(k_cache, KVCache):
            if v_scale is not None:
                raise Error("qkv.BatchPlan.run: v_scale: not with v_cache=None (the values use the keys' k_scale)")
            v_cache, v_scale = k_cache[..., :self._v_dim], k_scale
        if _is_torch(q):
            from . import _torch_ops_cache

            if _torch_ops_cache.traced(q):  # torch.compile, fake tensors: the operator
                if isinstance(k_cache, KVCache):
                    raise Error("qkv.BatchPlan.run: over a qkv.KVCache it is not traceable (torch.compile): pass "
                                "the cache's storage arrays, or run it eagerly")
                if self._handle is None:
                    raise Error("qkv.BatchPlan.run: traced (torch.compile), but the plan was made before torch "
                                "was imported: make it after `import torch`")
                import torch

                # A float8 cache's float scales become tensors: the operator's schema takes tensors.
                k_scale, v_scale = (_torch_ops_cache._tensor(x, torch.float32) for x in (k_scale, v_scale))
                out, lse = _torch_ops_cache.batch_plan_run(self._handle, q, k_cache, v_cache, k_scale, v_scale,
                                                           indices, k_rope_cache)
                return (out, lse) if return_lse else out
        return self.eager_run(q, k_cache, v_cache, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse,
                              indices=indices, k_rope_cache=k_rope_cache)

    def _run_records(self, q, records, cache_format, return_lse, indices, appending, power_of_two_scales, **unused):
        """run() with cache_format: the arguments it does not take refused by name, then the
        appending run (k_new given), the operator (traced) or eager_run_records."""
        fn = "qkv.BatchPlan.run"
        if cache_format != "fp8_ds_mla":
            raise Error(f"{fn}: cache_format: expected None or 'fp8_ds_mla' (FlashMLA's FP8 records), got "
                        f"{cache_format!r}")
        for name, value in unused.items():
            if value is not None:
                raise Error(f"{fn}: {name}: expected None with cache_format='fp8_ds_mla' (the records hold the "
                            "keys, values and scales; new tokens come as k_new (c_kv) and k_rope_new (k_pe))")
        if isinstance(records, KVCache):
            raise Error(f"{fn}: k_cache: with cache_format='fp8_ds_mla', the records array (uint8), not a qkv.KVCache")
        if any(value is not None for name, value in appending.items() if name != "rotary_interleaved") \
                or appending["rotary_interleaved"]:
            from . import _rotary

            return _rotary.run_records(self, q, records, return_lse=return_lse, indices=indices,
                                       power_of_two_scales=power_of_two_scales, **appending)
        if power_of_two_scales is not True:
            raise Error(f"{fn}: power_of_two_scales: only with k_new (the scales of the records the call packs)")
        if _is_torch(q):
            from . import _torch_ops_cache

            if _torch_ops_cache.traced(q):
                if self._handle is None:
                    raise Error(f"{fn}: traced (torch.compile), but the plan was made before torch was imported: "
                                "make it after `import torch`")
                out, lse = _torch_ops_cache.batch_plan_run_records(self._handle, q, records, indices)
                return (out, lse) if return_lse else out
        return self.eager_run_records(q, records, return_lse=return_lse, indices=indices)

    def eager_run_records(self, q, records, *, return_lse=False, indices=None):
        """run(cache_format="fp8_ds_mla") itself, outside any tracing (what the operator calls)."""
        fn = "qkv.BatchPlan.run"
        from ._decode_eager import key_lists

        indices = key_lists(indices)
        q_lib = _float32_packed(q, "q", fn)
        records = records_array(records, fn)
        return self._run(q, q_lib, "float8_e4m3fn", return_lse,
                         lambda plan, out, lse: plan.run_records(q_lib, records, out, lse=lse, indices=indices))

    def eager_run(self, q, k_cache, v_cache, *, k_scale=None, v_scale=None, return_lse=False, indices=None,
                  k_rope_cache=None):
        """run() itself, outside any tracing (what the operator calls)."""
        fn = "qkv.BatchPlan.run"
        from ._decode_eager import key_lists

        indices = key_lists(indices)
        q_lib = _float32_packed(q, "q", fn)
        if isinstance(k_cache, KVCache):  # the cache itself: any of its storages, int4 and windows too
            if v_cache is not None or k_scale is not None or v_scale is not None:
                raise Error(f"{fn}: with a qkv.KVCache as k_cache, v_cache, k_scale and v_scale are None")
            return self._run(q, q_lib, k_cache.dtype, return_lse,
                             lambda plan, out, lse: plan.run_cache(q_lib, k_cache._cache, out, lse=lse,
                                                                    indices=indices))
        k_lib, bits_as = _cache_array(k_cache, "k_cache", fn)
        v_lib, v_bits = _cache_array(v_cache, "v_cache", fn)
        if bits_as != v_bits:
            raise TypeError(f"{fn}: v_cache: expected the dtype of k_cache")
        rope_lib = None
        if k_rope_cache is not None:
            rope_lib, rope_bits = _cache_array(k_rope_cache, "k_rope_cache", fn)
            if rope_bits != bits_as or rope_lib.dtype != k_lib.dtype:
                raise TypeError(f"{fn}: k_rope_cache: expected the dtype of k_cache")
        storage = bits_as or ("int8" if k_lib.dtype == np.int8 else "float16" if k_lib.dtype == np.float16
                              else "float32")
        return self._run(q, q_lib, storage, return_lse,
                         lambda plan, out, lse: plan.run(q_lib, k_lib, v_lib, out, lse=lse, bits_as=bits_as,
                                                         k_scale=_scales("k_scale", k_scale, bits_as),
                                                         v_scale=_scales("v_scale", v_scale, bits_as),
                                                         indices=indices, k_rope_cache=rope_lib))

    def _run(self, q, q_lib, storage, return_lse, call):
        """The plan for `storage` (made on first use) run by `call(plan, out, lse)`; out in q's kind."""
        plan = self._plans.get(storage)
        if plan is None:
            plan = self._plans[storage] = self._plan(storage)
        total, heads = q_lib.shape[0], q_lib.shape[1]
        out_lib = np.empty((total, heads, self._v_dim), dtype=np.float32)
        lse = np.empty((heads, total), dtype=np.float32) if return_lse else None
        call(plan, out_lib, lse)
        out = out_lib
        if _is_torch(q):
            import torch

            out = torch.from_numpy(out_lib)
            if q.is_floating_point() and q.dtype != torch.float32:
                out = out.to(q.dtype)
            lse = None if lse is None else torch.from_numpy(lse)
        elif q.dtype in (np.float64, np.float16):
            out = out_lib.astype(q.dtype)
        return (out, lse) if return_lse else out
