"""qkv.dropout_mask: the attention-dropout keep mask qkv's kernels apply for a seed."""

from __future__ import annotations

import numbers

import numpy as np

from . import _qkv
from ._qkv import Error


def dropout_mask(batch: int, heads: int, q_len: int, k_len: int, dropout_p: float, seed: int,
                 offset: int = 0):
    """A bool NumPy array ``[batch, heads, q_len, k_len]``: True where attention dropout
    with probability ``dropout_p`` and this ``seed`` keeps weight (i, j) (kept weights are
    scaled by 1/(1 − p)). For varlen calls, ``batch`` indexes the sequences and i, j count
    from each sequence's start. The same mask for every thread count and backend."""
    fn = "qkv.dropout_mask"
    sizes = dict(batch=batch, heads=heads, q_len=q_len, k_len=k_len)
    for name, n in sizes.items():
        _integer(fn, name, n, 0, 1 << 63)
    _integer(fn, "offset", offset, 0, 1 << 64)
    try:
        keep = np.empty((batch, heads, q_len, k_len), dtype=np.bool_)
    except (ValueError, MemoryError) as e:  # NumPy's own words name no argument
        raise Error(f"{fn}: [batch, heads, q_len, k_len] = {list(sizes.values())}: cannot be allocated ({e})") from None
    _qkv.dropout_mask(keep, float(dropout_p), int(seed) % (1 << 64), int(offset))
    return keep


def _integer(fn: str, name: str, value, low: int, high: int) -> None:
    """`value` an int in [low, high) (high a power of 2), checked before NumPy or the
    binding narrow it."""
    if not isinstance(value, numbers.Integral):
        raise TypeError(f"{fn}: {name}: expected an int, got {type(value).__name__} {value!r}")
    if not low <= int(value) < high:
        raise Error(f"{fn}: {name}: expected an int in [{low}, 2**{high.bit_length() - 1}), got {value}")
