"""qkv.dropout_mask: the attention-dropout keep mask qkv's kernels apply for a seed."""

from __future__ import annotations

import numpy as np

from . import _qkv


def dropout_mask(batch: int, heads: int, q_len: int, k_len: int, dropout_p: float, seed: int,
                 offset: int = 0):
    """A bool NumPy array ``[batch, heads, q_len, k_len]``: True where attention dropout
    with probability ``dropout_p`` and this ``seed`` keeps weight (i, j) (kept weights are
    scaled by 1/(1 − p)). For varlen calls, ``batch`` indexes the sequences and i, j count
    from each sequence's start. The same mask for every thread count and backend."""
    keep = np.empty((batch, heads, q_len, k_len), dtype=np.bool_)
    _qkv.dropout_mask(keep, float(dropout_p), int(seed) % (1 << 64), int(offset))
    return keep
