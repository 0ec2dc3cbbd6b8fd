"""Handles: how a traced operator names a Python object that lives outside the graph (a
KVCache, a BatchPlan) — an int, constant in the graph, mapped back to the object when the
operator runs. Held weakly: the object lives as long as its caller keeps it."""

from __future__ import annotations

import weakref


class Handles:
    def __init__(self, what: str):
        self._what = what
        self._objects: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
        self._next = 0

    def register(self, obj) -> int:
        """A new handle for `obj` (call it outside any trace)."""
        self._next += 1
        self._objects[self._next] = obj
        return self._next

    def get(self, handle: int):
        obj = self._objects.get(handle)
        if obj is None:
            raise RuntimeError(f"{self._what}: handle {handle}: the object no longer exists")
        return obj
