"""float8 KV caches from Python: the arrays and scales qkv.decode, qkv.BatchPlan.run and
qkv.KVCache take, as the extension reads them.

Formats: "float8_e4m3fn" (largest finite ±448) and "float8_e5m2" (±57344), the two of
torch (torch.float8_e4m3fn / torch.float8_e5m2), ml_dtypes, vLLM and SGLang. NumPy has
no float8 dtype the extension could be told about, so a float8 cache goes over as a
uint8 view of the same bytes (torch: ``x.view(torch.uint8)``, ml_dtypes: ``x.view(np.uint8)``),
no copy, with the format named beside it (``bits_as``), as bfloat16 goes over as int16.

Scales: stored value = float8 · scale, one scale per tensor or per kv head (vLLM's and
SGLang's per-layer ``k_scale`` / ``v_scale``). They go over as a float32 1-D array of 1
or Hkv values; the extension checks the count and each value (positive, finite) and
repeats them along the cache's rows by strides 0 (python/src/cache_scales.hpp).
"""

from __future__ import annotations

import sys

import numpy as np

from ._arrays import Error

FORMATS = ("float8_e4m3fn", "float8_e5m2")


def _torch():
    return sys.modules.get("torch")


def cache_bytes(x, name: str, function: str):
    """(uint8 view of x's bytes, format name) when x is a float8 torch tensor or ml_dtypes
    array of a format qkv reads; None when x is not float8 at all. Other float8 formats
    (torch's and ml_dtypes' *fnuz, ml_dtypes' float8_e4m3 with infinities) differ in
    their bits and are refused by name."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        format_name = str(x.dtype).replace("torch.", "")
        if format_name in FORMATS:
            return x.view(torch.uint8).numpy(), format_name
    elif isinstance(x, np.ndarray):
        format_name = x.dtype.name
        if format_name in FORMATS:
            return x.view(np.uint8), format_name
    else:
        return None
    if format_name.startswith("float8"):
        raise TypeError(f"{function}: {name}: expected dtype float8_e4m3fn or float8_e5m2 among the float8 "
                        f"formats (the bits differ), got {format_name}")
    return None


def scale_vector(function: str, name: str, value):
    """A float8 cache's `name` (k_scale or v_scale) as the contiguous float32 1-D array the
    extension checks: a float (per tensor), or a sequence / NumPy array / CPU torch
    tensor of 0 or 1 dimensions (1 or Hkv values). None stays None (the extension names
    the missing scale). The count and the values are checked in C++, as for every entry
    point."""
    if value is None:
        return None
    torch = _torch()
    if torch is not None and isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise TypeError(f"{function}: {name}: expected a CPU tensor, got device {value.device}")
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{function}: {name}: expected a real dtype, got {value.dtype}")
        value = value.detach().to(torch.float32).numpy()
    try:
        array = np.asarray(value)
    except (TypeError, ValueError):  # a ragged list
        array = None
    if array is None or array.dtype.kind not in "iuf":
        what = type(value).__name__ if array is None else f"dtype {array.dtype}"
        raise TypeError(f"{function}: {name}: expected a float (per tensor) or a sequence of floats (per kv "
                        f"head), got {what}")
    if array.ndim > 1:
        raise Error(f"{function}: {name}: expected a float (per tensor) or a 1-D sequence of floats (per kv "
                    f"head) for a float8 cache, got shape {tuple(array.shape)}")
    # float64 scales are rounded to float32, the type the kernel multiplies by; one
    # beyond float32's range becomes inf, which the extension then refuses by value.
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(array.reshape(-1), dtype=np.float32)


def config_scales(function: str, name: str, value) -> list:
    """qkv.KVCache's k_scale / v_scale as the float list its C++ config takes ([]: set
    at the first append); the C++ constructor checks count and values."""
    vector = scale_vector(function, name, value)
    return [] if vector is None else vector.tolist()
