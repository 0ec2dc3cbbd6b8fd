"""Attention health: the softmax statistics a forward returns with ``return_stats=True``.

Per (batch entry, query head), arrays of the caller's type shaped ``[B, Hq]``
(varlen: ``[sequences, Hq]``), of q's dtype (float32 for 16-bit q, like lse):

    "max_weight_mean"   mean over the counted rows of the row's largest weight max_j P_ij
    "max_weight_max"    the largest weight of any counted row
    "entropy_mean"      mean entropy -sum_j P_ij ln P_ij of the counted rows, in nats
    "saturated_share"   share of counted rows whose largest weight > saturation_threshold
    "rows"              counted rows (int64): query rows with at least one key

and with ``return_row_stats=True`` the per-row values, laid out like lse
(``[B, Hq, Nq]``; varlen ``[Hq, total_q]``):

    "row_max_weight", "row_entropy"

A uniform row over n keys has largest weight 1/n and entropy ln n; a one-hot
(saturated) row 1 and 0. Rows whose keys are all masked are not counted (their per-row
values are 0); a head without counted rows gets NaN and rows = 0.
"""

from __future__ import annotations

import numbers

import numpy as np

from ._arrays import Torch
from ._qkv import Error

HEAD_KEYS = ("max_weight_mean", "max_weight_max", "entropy_mean", "saturated_share", "rows")
ROW_KEYS = ("row_max_weight", "row_entropy")
DEFAULT_THRESHOLD = 0.99

STATS_DOC = """
    return_stats: also return a dict of softmax statistics per (batch entry, head):
        ``"max_weight_mean"``, ``"max_weight_max"``, ``"entropy_mean"`` (nats),
        ``"saturated_share"`` and ``"rows"`` (int64), each ``[B, Hq]``, from the same
        pass (a few percent of its time; nothing when not asked). Rows whose keys are
        all masked are not counted; a head without counted rows gets NaN.
    return_row_stats: also (implies return_stats) the per-row ``"row_max_weight"`` and
        ``"row_entropy"``, shaped like lse.
    saturation_threshold: a row is saturated when its largest weight exceeds this
        (default 0.99), in [0, 1].
"""


def check_threshold(function: str, threshold) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real):
        raise TypeError(f"{function}: saturation_threshold: expected a number in [0, 1], "
                        f"got {threshold!r}")
    if not 0.0 <= float(threshold) <= 1.0:
        raise Error(f"{function}: saturation_threshold: expected a weight in [0, 1], "
                    f"got {threshold!r}")
    return float(threshold)


def _empty_counts(fw, shape, like):
    if fw is Torch:
        import torch

        return torch.empty(shape, dtype=torch.int64, device=like.device)
    return np.empty(shape, dtype=np.int64)


def allocate(fw, like, head_shape, row_shape=None) -> dict:
    """New output arrays of `like`'s kind, of lse's dtype (float32 for 16-bit inputs): the
    head statistics, and the per-row ones when row_shape is given."""
    stats = {key: fw.empty_lse(head_shape, like) for key in HEAD_KEYS if key != "rows"}
    stats["rows"] = _empty_counts(fw, head_shape, like)
    if row_shape is not None:
        for key in ROW_KEYS:
            stats[key] = fw.empty_lse(row_shape, like)
    return {key: stats[key] for key in (*HEAD_KEYS, *ROW_KEYS) if key in stats}


def for_library(fw, stats: dict, threshold: float) -> dict:
    """The `stats` keyword of qkv._qkv.forward / varlen_forward."""
    library = {key: fw.for_library(array) for key, array in stats.items()}
    library["saturation_threshold"] = threshold
    return library


__all__ = ["HEAD_KEYS", "ROW_KEYS", "DEFAULT_THRESHOLD", "STATS_DOC", "allocate",
           "check_threshold", "for_library"]
