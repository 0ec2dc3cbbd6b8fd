"""Rotary embedding + cache append + attention in one call (qkv/rotary.hpp,
qkv/batch_plan.hpp's "Appending"): the Python half of ``BatchPlan.run(..., k_new=, v_new=,
rotary_cos=, ...)`` and of ``KVCache.append``/``attend`` with rotary tables.

The tables are what transformers' rotary embeddings return: cos and sin ``[rows,
rotary_dim]`` — one row per new token, or (with ``positions``) a table indexed by each new
token's position — in NeoX half-split order (``cat(freqs, freqs)``), or pairs
(``repeat_interleave(freqs, 2)``) with ``rotary_interleaved=True``. float32, bfloat16 or
float16 (widened to float32, exactly); the rotation is computed in float32 and rounded as
PyTorch's float32 ``x * cos + rotate_half(x) * sin`` is, so it equals transformers'
``apply_rotary_pos_emb`` on float32 inputs bit for bit.
"""

from __future__ import annotations

import numpy as np

from . import _qkv
from ._arrays import Error
from ._decode_eager import _cache_array, _float32_packed, _int_array, _is_torch, key_lists, records_array

_FUNCTION = "qkv.BatchPlan.run"


def table(x, name: str, function: str):
    """A rotary table as the float32 2-D array the binding reads (None stays None):
    float32 as is, bfloat16/float16 widened (exact); other dtypes are a TypeError."""
    if x is None:
        return None
    if _is_torch(x):
        import torch

        if x.device.type != "cpu":
            raise TypeError(f"{function}: {name}: expected a CPU tensor, got device {x.device}")
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"{function}: {name}: expected dtype float32, bfloat16 or float16, got {x.dtype}")
        x = x.detach().to(torch.float32)
        if x.ndim == 3 and x.shape[0] == 1:  # transformers' [1, seq, rotary_dim]
            x = x[0]
        return x.contiguous().numpy() if x.ndim == 2 and x.shape[-1] > 1 and x.stride(-1) != 1 else x.numpy()
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{function}: {name}: expected a numpy.ndarray or a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (np.float32, np.float16) and x.dtype.name != "bfloat16":
        raise TypeError(f"{function}: {name}: expected dtype float32, bfloat16 or float16, got {x.dtype}")
    if x.ndim == 3 and x.shape[0] == 1:
        x = x[0]
    return x.astype(np.float32, copy=False)


def _positions(positions, function: str):
    if positions is None:
        return None
    array = _int_array(positions, None, "positions", function)
    return array if array.dtype in (np.int32, np.int64) else array.astype(np.int64)


def rotary_arguments(function, rotary_cos, rotary_sin, rotary_interleaved, rotary_dim, positions):
    """The binding's rotary keywords, converted (the checks themselves are the library's)."""
    if not isinstance(rotary_interleaved, (bool, np.bool_)):
        raise TypeError(f"{function}: rotary_interleaved: expected a bool, got {rotary_interleaved!r}")
    return dict(rotary_cos=table(rotary_cos, "rotary_cos", function),
                rotary_sin=table(rotary_sin, "rotary_sin", function),
                positions=_positions(positions, function), rotary_interleaved=bool(rotary_interleaved),
                rotary_dim=None if rotary_dim is None else rotary_dim)


def rotate(x, function: str, *, rotary_cos, rotary_sin, rotary_interleaved=False, rotary_dim=None, positions=None):
    """x ``[n, H, d]`` (any real dtype) rotated into a new float32 NumPy array."""
    x_lib = _float32_packed(x, "x", function)
    out = np.empty(x_lib.shape, dtype=np.float32)
    _qkv.apply_rotary(x_lib, out, function=function,
                      **rotary_arguments(function, rotary_cos, rotary_sin, rotary_interleaved, rotary_dim, positions))
    return out


def _traced_handle(plan, q):
    """The plan's handle when the call is traced (torch.compile, fake tensors), else None."""
    if not _is_torch(q):
        return None
    from . import _torch_ops_cache

    if not _torch_ops_cache.traced(q):
        return None
    if plan._handle is None:
        raise Error(f"{_FUNCTION}: traced (torch.compile), but the plan was made before torch was imported: "
                    "make it after `import torch`")
    return plan._handle


def run(plan, q, k_cache, v_cache, *, k_scale, v_scale, return_lse, indices, k_new, v_new, rotary_cos, rotary_sin,
        rotary_interleaved, rotary_dim, positions, k_rope_new=None, k_rope_cache=None):
    """BatchPlan.run with new tokens: traced as torch.ops.qkv.batch_plan_run_appending,
    eagerly the binding. With k_rope_cache (MLA's two pools, 4-D here) v_cache None means
    the latent values: k_cache's own rows."""
    if v_cache is None and k_rope_cache is None:
        raise Error(f"{_FUNCTION}: v_cache: None (the values in the keys) is not with k_new: pass the value cache")
    handle = _traced_handle(plan, q)
    if handle is not None:
        from . import _torch_ops_rotary

        out, lse = _torch_ops_rotary.batch_plan_run_appending(
            handle, q, k_cache, v_cache, k_scale, v_scale, k_new, v_new, rotary_cos, rotary_sin, positions,
            bool(rotary_interleaved), rotary_dim, indices, k_rope_new, k_rope_cache, plan.v_dim)
        return (out, lse) if return_lse else out
    return eager_run(plan, q, k_cache, v_cache, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse,
                     indices=indices, k_new=k_new, v_new=v_new, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                     rotary_interleaved=rotary_interleaved, rotary_dim=rotary_dim, positions=positions,
                     k_rope_new=k_rope_new, k_rope_cache=k_rope_cache)


def _scales(x):
    if x is None:
        return None
    return x.detach().numpy() if _is_torch(x) else x


def eager_run(plan, q, k_cache, v_cache, *, k_scale=None, v_scale=None, return_lse=False, indices=None, k_new=None,
              v_new=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=False, rotary_dim=None,
              positions=None, k_rope_new=None, k_rope_cache=None):
    """The appending run itself, outside any tracing (what the operator calls)."""
    fn = _FUNCTION
    indices = key_lists(indices)
    q_lib = _float32_packed(q, "q", fn)
    k_lib, bits_as = _cache_array(k_cache, "k_cache", fn)
    if v_cache is None:  # the latent values: a view of k_cache's rows (the library sees the same memory)
        v_lib, v_bits = k_lib[..., :plan.v_dim], bits_as
    else:
        v_lib, v_bits = _cache_array(v_cache, "v_cache", fn)
    if bits_as != v_bits:
        raise TypeError(f"{fn}: v_cache: expected the dtype of k_cache")
    rope_lib = None
    if k_rope_cache is not None:
        rope_lib, rope_bits = _cache_array(k_rope_cache, "k_rope_cache", fn)
        if rope_bits != bits_as or rope_lib.dtype != k_lib.dtype:
            raise TypeError(f"{fn}: k_rope_cache: expected the dtype of k_cache")
    new = {name: None if x is None else _float32_packed(x, name, fn)
           for name, x in (("k_new", k_new), ("v_new", v_new), ("k_rope_new", k_rope_new))}
    rotary = rotary_arguments(fn, rotary_cos, rotary_sin, rotary_interleaved, rotary_dim, positions)
    storage = bits_as or ("int8" if k_lib.dtype == np.int8 else "float16" if k_lib.dtype == np.float16 else "float32")
    return plan._run(q, q_lib, storage, return_lse,
                     lambda p, out, lse: _qkv.batch_plan_run_appending(
                         p, q_lib, k_lib, v_lib, out, new["k_new"], new["v_new"], lse=lse, bits_as=bits_as,
                         k_scale=_scales(k_scale), v_scale=_scales(v_scale), indices=indices,
                         k_rope_new=new["k_rope_new"], k_rope_cache=rope_lib, **rotary))


def run_records(plan, q, records, *, return_lse, indices, k_new, k_rope_new, rotary_cos, rotary_sin,
                rotary_interleaved, rotary_dim, positions, power_of_two_scales):
    """BatchPlan.run(cache_format="fp8_ds_mla", k_new=, k_rope_new=): the new tokens packed
    into FlashMLA's records in place, then the step. Traced as
    torch.ops.qkv.batch_plan_run_records_appending."""
    if not isinstance(power_of_two_scales, (bool, np.bool_)):
        raise TypeError(f"{_FUNCTION}: power_of_two_scales: expected a bool, got {power_of_two_scales!r}")
    for name, x in (("k_new", k_new), ("k_rope_new", k_rope_new)):
        if x is None:
            raise Error(f"{_FUNCTION}: {name}: expected with {'k_rope_new' if name == 'k_new' else 'k_new'} over "
                        "FlashMLA's records (each new record packs both: c_kv [total_q, dc], k_pe [total_q, dr])")
    handle = _traced_handle(plan, q)
    if handle is not None:
        from . import _torch_ops_rotary

        out, lse = _torch_ops_rotary.batch_plan_run_records_appending(
            handle, q, records, k_new, k_rope_new, rotary_cos, rotary_sin, positions, bool(rotary_interleaved),
            rotary_dim, bool(power_of_two_scales), indices)
        return (out, lse) if return_lse else out
    fn = _FUNCTION
    indices = key_lists(indices)
    q_lib = _float32_packed(q, "q", fn)
    records = records_array(records, fn)
    rows = {}
    for name, x in (("k_new", k_new), ("k_rope_new", k_rope_new)):
        if getattr(x, "ndim", 0) == 2:  # [total_q, d]: as [total_q, 1, d], the one latent head
            x = x[:, None]
        elif getattr(x, "ndim", 0) == 3 and x.shape[1] != 1:
            raise Error(f"{fn}: {name}: expected [total_q, {'dc' if name == 'k_new' else 'dr'}] or [total_q, 1, "
                        f"{'dc' if name == 'k_new' else 'dr'}] (the records' one latent head), got shape {tuple(x.shape)}")
        rows[name] = _float32_packed(x, name, fn)[:, 0]
    rotary = rotary_arguments(fn, rotary_cos, rotary_sin, rotary_interleaved, rotary_dim, positions)
    return plan._run(q, q_lib, "float8_e4m3fn", return_lse,
                     lambda p, out, lse: _qkv.batch_plan_run_records_appending(
                         p, q_lib, records, out, rows["k_new"], rows["k_rope_new"], lse=lse, indices=indices,
                         power_of_two_scales=bool(power_of_two_scales), **rotary))


def _refuse_traced(function: str, x) -> None:
    if _is_torch(x):
        from . import _torch_ops_cache

        if _torch_ops_cache.traced(x):
            raise Error(f"{function}: rotary_cos: a KVCache's rotating append is not traceable yet (torch.compile): "
                        "rotate the keys first, or use BatchPlan.run(..., k_new=, rotary_cos=) over cache arrays")


def _logical_rows(cache, x, name: str, function: str):
    """x ([n, Hkv, T, d] "bhsd" or [n, T, Hkv, d]) as float32 [n, T, H, d] NumPy."""
    from ._decode_eager import _float32_logical

    return np.ascontiguousarray(_float32_logical(x, cache.layout, name, function))


def cache_append(cache, k, v, seq, rotary: dict, function: str = "qkv.KVCache.append"):
    """KVCache.append with rotary tables: new token t of entry n is table row n·T + t (or that
    entry of positions); transformers' ``[n, T, rotary_dim]`` tables are taken flattened.
    k is rotated into scratch; the append is the cache's own (every storage type)."""
    _refuse_traced(function, k)
    k_rows = _logical_rows(cache, k, "k", function)
    n, tokens, heads, dim = k_rows.shape
    args = rotary_arguments(function, *(_flat(rotary.get(name)) for name in ("rotary_cos", "rotary_sin")),
                            rotary.get("rotary_interleaved", False), rotary.get("rotary_dim"),
                            _flat(rotary.get("positions"), rows=False))
    rotated = np.empty((n * tokens, heads, dim), dtype=np.float32)
    _qkv.apply_rotary(k_rows.reshape(n * tokens, heads, dim), rotated, function=function, **args)
    from ._decode_eager import _float32_logical

    seqs = None if seq is None else ([int(seq)] if np.ndim(seq) == 0 else [int(s) for s in seq])
    cache._cache.append(rotated.reshape(n, tokens, heads, dim), _float32_logical(v, cache.layout, "v", function), seqs)


def _flat(x, rows: bool = True):
    """[n, T, r] tables (transformers' per-batch output) as [n·T, r]; [n, T] positions as [n·T]."""
    if x is None or getattr(x, "ndim", 0) != (3 if rows else 2):
        return x
    return x.reshape(-1, x.shape[-1]) if rows else x.reshape(-1)


def cache_attend(cache, q, k_new, v_new, rotary: dict, attend):
    """KVCache.attend(q, k_new=, v_new=, rotary_cos=, ...): q's shape is checked against the
    new tokens first, then they are appended (rotated), then q rotated alike attends."""
    function = "qkv.KVCache.attend"
    if k_new is None or v_new is None:
        raise Error(f"{function}: {'k_new' if k_new is None else 'v_new'}: expected with "
                    f"{'v_new' if k_new is None else 'k_new'} (the new tokens' keys and values are appended together)")
    _refuse_traced(function, q)
    q_rows = _logical_rows(cache, q, "q", function)
    k_rows = _logical_rows(cache, k_new, "k_new", function)
    if q_rows.shape[:2] != k_rows.shape[:2] or q_rows.shape[3] != k_rows.shape[3]:
        raise Error(f"{function}: q: expected the batch, tokens and head_dim of k_new {tuple(k_rows.shape)} "
                    f"(as [B, T, H, d]), got {tuple(q_rows.shape)}")
    cache_append(cache, k_new, v_new, None, rotary, "qkv.KVCache.append")
    if rotary.get("rotary_cos") is not None or rotary.get("rotary_sin") is not None:
        n, tokens, heads, dim = q_rows.shape
        args = rotary_arguments(function, *(_flat(rotary.get(name)) for name in ("rotary_cos", "rotary_sin")),
                                rotary.get("rotary_interleaved", False), rotary.get("rotary_dim"),
                                _flat(rotary.get("positions"), rows=False))
        rotated = np.empty((n * tokens, heads, dim), dtype=np.float32)
        _qkv.apply_rotary(q_rows.reshape(n * tokens, heads, dim), rotated, function=function, **args)
        q_rows = rotated.reshape(n, tokens, heads, dim)
        if cache.layout == "bhsd":
            q_rows = q_rows.swapaxes(1, 2)
        if _is_torch(q):
            import torch

            q_rows = torch.from_numpy(q_rows).to(q.dtype if q.is_floating_point() else torch.float32)
        q = q_rows
    return attend(q)
