"""Handles: how a traced operator names a Python object that lives outside the graph (a
KVCache, a BatchPlan) — an int64 scalar tensor the object holds, mapped back to the object
when the operator runs. Held weakly: the object lives as long as its caller keeps it.

Why a tensor and not an int: torch.compile makes an int read from an object a constant
of the graph, guarded; the next object's other int fails the guard, and the recompiled
graph takes it as a symbolic int, which no lookup can hash. A tensor is a graph input:
every object of a kind (a new BatchPlan each serving step) passes through one graph, and
only the operator's real implementation, which runs outside tracing, reads its value.
The fake implementations never need the object (their shapes come from their tensor
arguments and from plain arguments read at trace time), so they never read the handle."""

from __future__ import annotations

import weakref

import torch


class Handles:
    def __init__(self, what: str):
        self._what = what
        self._objects: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
        self._next = 0

    def register(self, obj) -> torch.Tensor:
        """A new handle for `obj`: an int64 scalar tensor (call it outside any trace)."""
        self._next += 1
        self._objects[self._next] = obj
        return torch.tensor(self._next, dtype=torch.int64)

    def get(self, handle: torch.Tensor):
        """The object named by `handle` (at run time: a real tensor)."""
        if not isinstance(handle, torch.Tensor) or handle.dtype != torch.int64 or handle.ndim != 0:
            raise TypeError(f"{self._what}: handle: expected an int64 scalar tensor (the object's .handle), "
                            f"got {handle!r}")
        obj = self._objects.get(int(handle))
        if obj is None:
            raise RuntimeError(f"{self._what}: handle {int(handle)}: the object no longer exists")
        return obj
