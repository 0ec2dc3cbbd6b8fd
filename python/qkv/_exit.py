"""The library's objects let go when the interpreter exits.

A qkv.KVCache or qkv.BatchPlan holds a qkv._qkv instance (the C++ cache, the plan and its
Options). nanobind lists every such instance still alive when its internals are torn down,
after the interpreter's finalization, as "leaked" (dozens of lines on stderr), and
finalization does not free everything a program held: a module whose functions PyTorch
keeps in C++ (any torch.library operator, a script's own included) keeps its globals, and
the caches, plans and models stored there, alive to the end, uncleared. Those objects are
not leaked by the binding; the program holds them until the process ends.

So qkv releases them itself, in an atexit hook: atexit hooks run after the program's
last statement (and after threading joins its non-daemon threads), before finalization.
Every live KVCache and BatchPlan drops its qkv._qkv instances there; the C++ objects are
freed and nanobind has nothing to report. A true reference leak in the binding (an
instance whose count never reaches zero) is still reported: the hook only drops the
references the Python objects hold.

Hooks run last-registered first, so an atexit hook a program registers after importing
qkv still finds its caches intact. Anything that uses a released object afterwards (a
daemon thread, a hook registered before qkv was imported) gets qkv.Error saying so.
"""

from __future__ import annotations

import atexit
import weakref

from ._qkv import Error

_LIVE: "weakref.WeakSet[object]" = weakref.WeakSet()  # objects with a _release() method


def release_at_exit(obj) -> None:
    """Calls obj._release() when the interpreter exits, if obj is still alive then."""
    _LIVE.add(obj)


class Released:
    """What a released object holds instead of its qkv._qkv instance: any use raises."""

    def __init__(self, what: str):
        self._what = what

    def __getattr__(self, name):
        raise Error(f"{self._what}: used after the interpreter began to exit (qkv releases its caches and "
                    "plans in an atexit hook, before finalization)")


@atexit.register
def _release_all() -> None:
    for obj in list(_LIVE):
        obj._release()
    _LIVE.clear()
