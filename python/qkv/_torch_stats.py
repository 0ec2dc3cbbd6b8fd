"""qkv.torch.collect_stats: attention health of a whole model, recorded per call.

``scaled_dot_product_attention`` keeps its PyTorch signature; while a collector is
active it also asks the forward for its softmax statistics (qkv/_stats.py) and hands
them to the collector, one record per call. With no collector active nothing is
computed and nothing is recorded.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Optional

from . import _stats

_collectors: contextvars.ContextVar[tuple] = contextvars.ContextVar("qkv_stats_collectors",
                                                                    default=())
_label: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("qkv_stats_label",
                                                                       default=None)


class StatsCollector(list):
    """The records of the calls made while it was active, in call order (a list).

    Each record is a dict: ``"call"`` (its index in this collector), ``"label"`` (set
    with ``qkv.torch.stats_label``, else None), ``"shape"`` ``(B, Hq, Nq, Nk)`` with the
    leading batch dimensions flattened into B, and the statistics tensors
    ``"max_weight_mean"``, ``"max_weight_max"``, ``"entropy_mean"``,
    ``"saturated_share"`` and ``"rows"`` (int64), each ``[B, Hq]`` (plus
    ``"row_max_weight"`` and ``"row_entropy"`` ``[B, Hq, Nq]`` with ``row_stats=True``).
    """

    def __init__(self, row_stats: bool = False,
                 saturation_threshold: float = _stats.DEFAULT_THRESHOLD):
        super().__init__()
        self.row_stats = bool(row_stats)
        self.saturation_threshold = _stats.check_threshold("qkv.torch.collect_stats",
                                                           saturation_threshold)

    def __repr__(self):
        return f"StatsCollector({len(self)} calls)"


@contextlib.contextmanager
def collect_stats(row_stats: bool = False, saturation_threshold: float = _stats.DEFAULT_THRESHOLD):
    """Records the softmax statistics of every ``qkv.torch.scaled_dot_product_attention``
    call made inside the block (the model's forward passes, eager mode)::

        with qkv.torch.collect_stats() as stats:
            model(batch)
        for record in stats:
            print(record["call"], record["entropy_mean"].mean(0))   # per head

    The statistics come out of the same forward (a few percent of its time) and take no
    part in autograd. Collectors nest; each active one receives every record, computed
    with the innermost collector's settings (and per-row values when any asks).
    Under torch.compile (and with tensor subclasses) calls are not recorded: qkv's
    traced operator has no statistics output.
    """
    collector = StatsCollector(row_stats, saturation_threshold)
    token = _collectors.set(_collectors.get() + (collector,))
    try:
        yield collector
    finally:
        _collectors.reset(token)


@contextlib.contextmanager
def stats_label(label: str):
    """Labels the records of the calls made inside the block (e.g. the layer's name)."""
    token = _label.set(label)
    try:
        yield
    finally:
        _label.reset(token)


def active() -> tuple:
    """The active collectors, innermost last (an empty tuple: compute nothing)."""
    return _collectors.get()


def settings(collectors: tuple) -> tuple:
    """(row_stats, saturation_threshold) of a call while `collectors` are active."""
    return any(c.row_stats for c in collectors), collectors[-1].saturation_threshold


def prepare(collectors: tuple, like, batch: int, heads: int, q_len: int):
    """(outputs, library dict) for one call while `collectors` are active."""
    row_stats, threshold = settings(collectors)
    from ._arrays import Torch

    outputs = _stats.allocate(Torch, like, (batch, heads),
                              (batch, heads, q_len) if row_stats else None)
    return outputs, _stats.for_library(Torch, outputs, threshold)


def record(collectors: tuple, outputs: dict, shape: tuple, default_label=None) -> None:
    """Appends one call's record to every active collector; its label is stats_label's,
    else `default_label` (qkv.transformers gives the layer's)."""
    label = _label.get()
    if label is None:
        label = default_label
    for collector in collectors:
        collector.append({"call": len(collector), "label": label, "shape": shape, **outputs})


__all__ = ["StatsCollector", "collect_stats", "stats_label"]
