"""The eager half of qkv.KVCache and qkv.decode (qkv/_decode.py): the argument conversions
and the library call. Attention of new tokens against a key/value cache, for a
generation loop. Caches are read in place (torch or NumPy, float32, bfloat16, float16,
int8 or float8: qkv/_float8.py); queries and outputs are the caller's type and dtype, computed in float32.

Layouts: with ``layout="bhsd"`` (the default, PyTorch's and Hugging Face's) q, k, v and
out are ``[batch, heads, seq, dim]``; with ``"bshd"`` ``[batch, seq, heads, dim]``. A
paged cache is always the vLLM pool ``[num_blocks, block_size, kv_heads, dim]``.
"""

from __future__ import annotations

import numbers
import sys

import numpy as np

from . import _float8, _qkv
from ._arrays import LAYOUTS, Error, NumPy, Torch
from ._options import make_options

_STORAGE = ("float32", "bfloat16", "float16")


def _is_torch(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _storage_name(dtype, function: str = "qkv") -> str:
    """'float32', 'bfloat16', 'float16', 'int8', 'int4', 'float8_e4m3fn' or 'float8_e5m2' from a
    name, a NumPy (ml_dtypes) or a torch dtype."""
    if isinstance(dtype, str):
        name = dtype
    elif isinstance(dtype, type) and dtype.__module__ == "ml_dtypes":  # the scalar type, ml_dtypes.float8_e5m2
        name = dtype.__name__
    else:
        name = str(dtype).replace("torch.", "")
    if name in _float8.FORMATS:
        return name
    if name in ("int8", "<class 'numpy.int8'>"):
        return "int8"
    if name == "int4":
        return "int4"
    if name in ("float", "float32", "<class 'numpy.float32'>"):
        return "float32"
    if name in ("half", "float16", "<class 'numpy.float16'>"):
        return "float16"
    if name in ("bfloat16",):
        return "bfloat16"
    raise Error(f"{function}: dtype: expected float32, bfloat16, float16, int8, int4, float8_e4m3fn or float8_e5m2, "
                f"got {dtype!r}")


def _check_layout(function: str, layout: str) -> None:
    if layout not in LAYOUTS:
        raise Error(f"{function}: layout: expected 'bhsd' or 'bshd', got {layout!r}")


def refuse_grad(function: str, **arrays) -> None:
    """Decoding (qkv.decode, KVCache.attend, BatchPlan.run) is forward-only: an input that
    requires grad while grad mode is on would get an output without a graph and no word of
    it, so it is an error (detach it, or call under torch.no_grad(), as generation does)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.is_grad_enabled():
        return
    for name, x in arrays.items():
        if isinstance(x, torch.Tensor) and x.requires_grad:
            raise Error(f"{function}: {name}: requires grad, but {function} is forward-only (it has no "
                        "backward): detach it, or call under torch.no_grad()")


def _float32_logical(x, layout: str, name: str, function: str):
    """x as the library's float32 [batch, seq, heads, dim] array (a view when x is
    float32 already; a converted copy otherwise: queries and new tokens are small)."""
    if getattr(x, "ndim", None) != 4:
        raise Error(f"{function}: {name}: expected 4 dimensions, got shape {tuple(getattr(x, 'shape', ()))}")
    if _is_torch(x):
        import torch

        if x.device.type != "cpu":
            raise TypeError(f"{function}: {name}: expected a CPU tensor, got device {x.device}")
        x = x.detach()
        if x.dtype != torch.float32:
            _expect_real(x.is_complex() or x.dtype == torch.bool, x.dtype, name, function)
            x = x.to(torch.float32)
        if layout == "bhsd":
            x = x.transpose(1, 2)
        if x.shape[-1] > 1 and x.stride(-1) != 1:
            x = x.contiguous()
        return x.numpy()
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{function}: {name}: expected a numpy.ndarray or a torch.Tensor, got {type(x).__name__}")
    if x.dtype != np.float32:
        _expect_real(x.dtype.kind not in "iuf", x.dtype, name, function)
        x = x.astype(np.float32)
    return x.swapaxes(1, 2) if layout == "bhsd" else x


def _float32_packed(x, name: str, function: str):
    """x as a float32 [total, heads, dim] array (a view when x is float32 already)."""
    torch = sys.modules.get("torch")
    if (torch is not None and type(x) is torch.Tensor and x.dtype is torch.float32 and x.ndim == 3
            and not x.requires_grad and x.device.type == "cpu" and (x.shape[-1] <= 1 or x.stride(-1) == 1)):
        return x.numpy()  # the common case: a view, nothing to convert
    if getattr(x, "ndim", None) != 3:
        raise Error(f"{function}: {name}: expected [total, heads, dim], got shape {tuple(getattr(x, 'shape', ()))}")
    if _is_torch(x):
        import torch

        if x.device.type != "cpu":
            raise TypeError(f"{function}: {name}: expected a CPU tensor, got device {x.device}")
        x = x.detach()
        if x.dtype != torch.float32:
            _expect_real(x.is_complex() or x.dtype == torch.bool, x.dtype, name, function)
            x = x.to(torch.float32)
        return (x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()).numpy()
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{function}: {name}: expected a numpy.ndarray or a torch.Tensor, got {type(x).__name__}")
    if x.dtype != np.float32:
        _expect_real(x.dtype.kind not in "iuf", x.dtype, name, function)
        x = x.astype(np.float32)
    return x


def _expect_real(refused: bool, dtype, name: str, function: str) -> None:
    """Queries and new keys of any real dtype are converted to float32; others refused
    here, before a conversion that would drop an imaginary part or fail naming nothing."""
    if refused:
        raise TypeError(f"{function}: {name}: expected a real (integer or float) dtype, got {dtype}")


def _empty_out(like, batch: int, seq: int, heads: int, dim: int, layout: str):
    """(out in the caller's type, dtype and layout; its float32 [B, S, H, D] view or a
    float32 scratch when the caller's dtype is not float32)."""
    if _is_torch(like):
        import torch

        shape = (batch, heads, seq, dim) if layout == "bhsd" else (batch, seq, heads, dim)
        out = torch.empty(shape, dtype=like.dtype if like.is_floating_point() else torch.float32)
        work = out if out.dtype == torch.float32 else torch.empty(shape, dtype=torch.float32)
        logical = work.transpose(1, 2) if layout == "bhsd" else work
        return out, work, logical.numpy()
    shape = (batch, heads, seq, dim) if layout == "bhsd" else (batch, seq, heads, dim)
    out = np.empty(shape, dtype=like.dtype if like.dtype in (np.float32, np.float64, np.float16) else np.float32)
    work = out if out.dtype == np.float32 else np.empty(shape, dtype=np.float32)
    return out, work, (work.swapaxes(1, 2) if layout == "bhsd" else work)


def _finish(out, work):
    if work is not out:
        if _is_torch(out):
            out.copy_(work)
        else:
            out[...] = work
    return out


def result(q, out, work, lse):
    """out (finished from its float32 work array), or (out, lse) when lse was asked for
    (a torch tensor for torch queries)."""
    out = _finish(out, work)
    if lse is None:
        return out
    if _is_torch(q):
        import torch

        lse = torch.from_numpy(lse)
    return out, lse


def _torch_cache_views():
    """torch dtype → (the dtype the library reads its bits as, bits_as), made once."""
    global _TORCH_CACHE_VIEWS
    if _TORCH_CACHE_VIEWS is None:
        import torch

        _TORCH_CACHE_VIEWS = {torch.bfloat16: (torch.int16, "bfloat16"), torch.float16: (torch.int16, "float16"),
                              torch.float32: (None, ""), torch.int8: (None, "")}
    return _TORCH_CACHE_VIEWS


_TORCH_CACHE_VIEWS = None


def records_array(records, function: str):
    """FlashMLA's records as the array the binding reads in place (a CPU tensor's own memory)."""
    if _is_torch(records):
        if records.device.type != "cpu":
            raise TypeError(f"{function}: k_cache: expected a CPU tensor, got device {records.device}")
        return records.detach().numpy()
    return records


def _cache_array(x, name: str, function: str):
    """(array the library reads in place, bits_as): torch bfloat16 goes over as int16 bits,
    float8 (torch or ml_dtypes) as uint8 bytes (qkv/_float8.py)."""
    if _is_torch(x) and x.device.type != "cpu":
        raise TypeError(f"{function}: {name}: expected a CPU tensor, got device {x.device}")
    if _is_torch(x):  # the common case first: one lookup, one view (every decode call's caches)
        known = _torch_cache_views().get(x.dtype)
        if known is not None:
            if x.requires_grad:
                x = x.detach()
            view, bits_as = known
            return (x.view(view) if view is not None else x).numpy(), bits_as
    float8 = _float8.cache_bytes(x.detach() if _is_torch(x) else x, name, function)
    if float8 is not None:
        return float8
    if _is_torch(x):
        import torch

        if x.device.type != "cpu":
            raise TypeError(f"{function}: {name}: expected a CPU tensor, got device {x.device}")
        x = x.detach()
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy(), "bfloat16"
        if x.dtype == torch.float16:
            return x.view(torch.int16).numpy(), "float16"
        if x.dtype in (torch.float32, torch.int8):
            return x.numpy(), ""
        raise TypeError(f"{function}: {name}: expected dtype float32, bfloat16, float16, int8, float8_e4m3fn or "
                        f"float8_e5m2, got {x.dtype}")
    if isinstance(x, np.ndarray):
        return x, ""
    raise TypeError(f"{function}: {name}: expected a numpy.ndarray or a torch.Tensor, got {type(x).__name__}")


def _int_array(values, dtype, name: str, function: str):
    """A contiguous integer array of `values`: of `dtype`, or (dtype None) of its own
    integer dtype, for the binding to check before narrowing."""
    if _is_torch(values):
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    # NumPy keeps Python ints past uint64 as objects, and the cast to int64 below would wrap
    # uint64 past int64 (without a dtype the binding checks the uint64 entries itself).
    if array.dtype == object and all(isinstance(x, numbers.Integral) for x in array.flat) or (
            array.dtype == np.uint64 and dtype is np.int64 and array.size and array.max() >= 2**63):
        raise Error(f"{function}: {name}: expected integers in [-2**63, 2**63), got {max(array.flat, key=abs)}")
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"{function}: {name}: expected integers, got dtype {array.dtype}")
    if dtype is None and array.dtype.kind not in "iu":
        dtype = np.int64  # an empty list
    return np.ascontiguousarray(array, dtype=dtype)


def _options(function: str, q, scale, causal, threads, window, softcap, alibi_slopes, sinks,
             precision=None):
    """The call's Options, built as qkv.attention builds its own (the same keywords, the
    same C++ checks and so the same errors)."""
    fw = Torch if any(_is_torch(x) for x in (q, alibi_slopes, sinks)) else NumPy  # no gradient here
    return make_options(function, fw, scale=scale, causal=causal,
                        threads=threads, window=window, softcap=softcap,
                        alibi_slopes=alibi_slopes, sinks=sinks, precision=precision)


def decode(q, k_cache, v_cache, cache_lengths, *, block_table=None, scale=None, causal="bottom_right",
           layout="bhsd", return_lse=False, threads=None, window=None, softcap=None, alibi_slopes=None,
           sinks=None, k_scale=None, v_scale=None, precision=None, indices=None):
    """qkv.decode (qkv/_decode.py documents it) on plain arrays: the library call."""
    fn = "qkv.decode"
    _check_layout(fn, layout)
    options = _options(fn, q, scale, causal, threads, window, softcap, alibi_slopes, sinks, precision)
    q_lib = _float32_logical(q, layout, "q", fn)
    k_lib, bits_as = _cache_array(k_cache, "k_cache", fn)
    v_lib, v_bits = _cache_array(v_cache, "v_cache", fn)
    if bits_as != v_bits:
        raise TypeError(f"{fn}: v_cache: expected the dtype of k_cache")
    if block_table is None:
        if k_lib.ndim != 4 or v_lib.ndim != 4:
            raise Error(f"{fn}: k_cache, v_cache: expected 4 dimensions")
        if layout == "bhsd":
            k_lib, v_lib = k_lib.swapaxes(1, 2), v_lib.swapaxes(1, 2)
        table = None
    else:
        table = _int_array(block_table, None, "block_table", fn)  # int64 entries: checked in C++
    lengths = _int_array(cache_lengths, np.int64, "cache_lengths", fn)
    scales = {}
    for name, row_scales in (("k_scale", k_scale), ("v_scale", v_scale)):
        if bits_as in _float8.FORMATS:  # a float or Hkv floats, whatever the layout
            scales[name] = _float8.scale_vector(fn, name, row_scales)
            continue
        if row_scales is None:
            continue
        if _is_torch(row_scales):
            row_scales = row_scales.detach().numpy()
        row_scales = np.asarray(row_scales)
        if block_table is None and layout == "bhsd" and row_scales.ndim == 3:
            row_scales = row_scales.swapaxes(1, 2)
        scales[name] = row_scales
    batch, q_len, q_heads, _ = q_lib.shape
    v_dim = v_lib.shape[3] if v_lib.ndim == 4 else 0
    out, work, out_lib = _empty_out(q, batch, q_len, q_heads, v_dim, layout)
    lse = None
    if return_lse:
        lse = np.empty((batch, q_heads, q_len), dtype=np.float32)
    _qkv.decode(q_lib, k_lib, v_lib, lengths, out_lib, lse=lse, block_table=table, bits_as=bits_as,
                indices=key_lists(indices), options=options, **scales)
    return result(q, out, work, lse)


def mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, cache_lengths, *, block_table=None, scale=None,
               causal="bottom_right", indices=None, return_lse=False, threads=None, softcap=None, sinks=None,
               precision=None, ckv_scale=None, kpe_scale=None):
    """qkv.mla_decode (qkv/_decode.py documents it) on plain arrays: the library call."""
    fn = "qkv.mla_decode"
    if scale is None:  # the C++ check names it too; here before any conversion
        raise Error(f"{fn}: scale: required (the model's softmax scale, e.g. DeepSeek's "
                    "1/sqrt(qk_nope_head_dim + qk_rope_head_dim) times its YaRN factor)")
    options = _options(fn, q_nope, scale, causal, threads, None, softcap, None, sinks, precision)
    nope = _float32_logical(q_nope, "bshd", "q_nope", fn)
    pe = _float32_logical(q_pe, "bshd", "q_pe", fn)
    ckv, bits_as = _cache_array(ckv_cache, "ckv_cache", fn)
    kpe, kpe_bits = _cache_array(kpe_cache, "kpe_cache", fn)
    if bits_as != kpe_bits or ckv.dtype != kpe.dtype:
        raise TypeError(f"{fn}: kpe_cache: expected the dtype of ckv_cache")
    table = None if block_table is None else _int_array(block_table, None, "block_table", fn)
    lengths = _int_array(cache_lengths, np.int64, "cache_lengths", fn)
    batch, q_len, heads, _ = nope.shape
    dc = ckv.shape[-1] if ckv.ndim == 3 else 0
    out, work, out_lib = _empty_out(q_nope, batch, q_len, heads, dc, "bshd")
    lse = np.empty((batch, heads, q_len), dtype=np.float32) if return_lse else None
    # Per-tensor scales as 1-D float32 arrays; their count, their values and whether this
    # cache takes them at all are checked in C++ (the words of every entry point).
    scales = {name: _float8.scale_vector(fn, name, value)
              for name, value in (("ckv_scale", ckv_scale), ("kpe_scale", kpe_scale))}
    _qkv.mla_decode(nope, pe, ckv, kpe, lengths, out_lib, lse=lse, block_table=table, bits_as=bits_as,
                    indices=key_lists(indices), options=options, **scales)
    return result(q_nope, out, work, lse)


def mla_decode_records(q_nope, q_pe, ckv_cache, cache_lengths, *, block_table=None, scale=None,
                       causal="bottom_right", indices=None, return_lse=False, threads=None, softcap=None,
                       sinks=None, precision=None):
    """qkv.mla_decode with cache_format="fp8_ds_mla" on plain arrays: the library call."""
    fn = "qkv.mla_decode"
    if scale is None:
        raise Error(f"{fn}: scale: required (the model's softmax scale, e.g. DeepSeek's "
                    "1/sqrt(qk_nope_head_dim + qk_rope_head_dim) times its YaRN factor)")
    options = _options(fn, q_nope, scale, causal, threads, None, softcap, None, sinks, precision)
    nope = _float32_logical(q_nope, "bshd", "q_nope", fn)
    pe = _float32_logical(q_pe, "bshd", "q_pe", fn)
    if _is_torch(ckv_cache):
        if ckv_cache.device.type != "cpu":
            raise TypeError(f"{fn}: ckv_cache: expected a CPU tensor, got device {ckv_cache.device}")
        ckv_cache = ckv_cache.detach().numpy()
    table = None if block_table is None else _int_array(block_table, None, "block_table", fn)
    lengths = _int_array(cache_lengths, np.int64, "cache_lengths", fn)
    batch, q_len, heads, dc = nope.shape
    out, work, out_lib = _empty_out(q_nope, batch, q_len, heads, dc, "bshd")
    lse = np.empty((batch, heads, q_len), dtype=np.float32) if return_lse else None
    _qkv.mla_decode_records(nope, pe, ckv_cache, lengths, out_lib, lse=lse, block_table=table,
                            indices=key_lists(indices), options=options)
    return result(q_nope, out, work, lse)


def key_lists(indices):
    """Key lists (qkv.decode's, KVCache.attend's, BatchPlan.run's ``indices``) as the
    binding reads them: NumPy arrays as they are, torch tensors as NumPy views of their
    memory (no copy); dtype, rank and shape are checked in C++, by name."""
    if indices is None:
        return None
    if _is_torch(indices):
        return indices.detach().numpy()
    return indices
