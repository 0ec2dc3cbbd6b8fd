"""How the OpenMP worker threads wait between parallel regions, decided once, here,
before qkv's library (and with it libgomp) is loaded.

libgomp lets an idle worker spin for ~300 000 iterations (milliseconds) after every
parallel region before it sleeps, unless OMP_WAIT_POLICY or GOMP_SPINCOUNT says
otherwise, and it reads them only when it is loaded. In a Python program the next
statements are rarely another parallel region: the spinning workers burn a core each
through them, and on a machine with more runnable threads than cores they take the
time slices a team's last thread needs, so a 2-thread call waits for a scheduler tick.
Measured on the 2-core test machine (bench/RESULTS.md §6, "Small calls"): a 2-thread
[1,8,256,64] call takes 1.6 ms and then burns 0.06 ms of CPU in the next 20 ms with
passive waits, 3.5–4.0 ms spinning; under load a spinning team's call took 31.9 ms
against 1.8 ms (the file's history). What passive costs is a futex wake-up (microseconds)
per parallel region, which qkv opens only for work worth several threads (the small
decode-sized calls run on the calling thread, with no region at all).

So, unless the environment already sets OMP_WAIT_POLICY or GOMP_SPINCOUNT, qkv sets
OMP_WAIT_POLICY=PASSIVE for the moment its library loads libgomp and removes it again
(child processes inherit nothing). The process has one libgomp (torch's is the same
soname): when something loaded it before qkv, typically `import torch` first, its
policy stays as it was; set OMP_WAIT_POLICY=PASSIVE in the environment, or import qkv
first, to get the passive one there too.
"""

from __future__ import annotations

import ctypes
import os

_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

# What happened at import: "passive" (qkv chose it), "environment" (the user's
# variables apply) or "already loaded" (libgomp kept the policy it was loaded with).
decision = None


def _libgomp_loaded() -> bool:
    try:
        ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    return True


def before_load() -> bool:
    """Sets OMP_WAIT_POLICY=PASSIVE when qkv decides; True when after_load must undo it."""
    global decision
    if any(name in os.environ for name in _VARIABLES):
        decision = "environment"
        return False
    if _libgomp_loaded():
        decision = "already loaded"
        return False
    decision = "passive"
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def after_load(was_set: bool) -> None:
    if was_set:
        os.environ.pop("OMP_WAIT_POLICY", None)


# GOMP_SPINCOUNT from which idle workers count as spinning: libgomp's own count with no
# policy set is 300 000 (milliseconds), enough to span a model step's other operators
# between two attention calls; far fewer spins end before the next call comes.
_SPINNING_COUNT = 100_000


def _spin_count(text: str) -> float:
    """GOMP_SPINCOUNT as libgomp reads it: a count with an optional k/M/G/T suffix
    (powers of 1000), or "infinite"/"infinity"; ValueError for what libgomp ignores."""
    text = text.strip().lower()
    if text in ("infinite", "infinity"):
        return float("inf")
    factor = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}.get(text[-1:])
    return int(text[:-1] if factor else text) * (factor or 1)


def workers_spin() -> bool:
    """Whether libgomp's idle workers spin between parallel regions rather than sleep,
    as far as the environment tells (libgomp read it when it loaded): qkv's small decode
    calls use a second thread only when it is awake (qkv/threads.hpp)."""
    if decision == "passive":
        return False
    count = os.environ.get("GOMP_SPINCOUNT")
    if count is not None:  # it overrides the policy's count (a bad value: ignored)
        try:
            return _spin_count(count) >= _SPINNING_COUNT
        except ValueError:
            pass
    return os.environ.get("OMP_WAIT_POLICY", "").strip().lower() != "passive"
