"""What the Python benchmarks share: the best or median time of calls, the CPU's name and
the SIMD target qkv runs on (every figure names its CPU). Imported by the bench_*.py
scripts, which run from this folder."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time


def best_of(repeats, fn):
    """The shortest of `repeats` timed calls of fn, after one untimed call (first touch of
    the outputs, the thread pool's start)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def interleaved_medians(fns, repeats):
    """The median time of each of fns over `repeats` rounds, after one untimed call of each.
    Each round times every fn once, the order reversed every other round, so a load that
    comes and goes (another tenant of these shared VMs) lands on all of them alike."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for round_ in range(repeats):
        order = range(len(fns)) if round_ % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            start = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def _cpuinfo():
    """/proc/cpuinfo's fields of its first processor (empty where there is none)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model():
    """/proc/cpuinfo's model name (platform.processor() where there is none)."""
    return _cpuinfo().get("model name") or platform.processor()


def cpu_vendor():
    """/proc/cpuinfo's vendor_id (AuthenticAMD, GenuineIntel), or "" where there is none."""
    return _cpuinfo().get("vendor_id", "")


def cpu_family_model():
    """'family F model M' from /proc/cpuinfo (empty where there is none)."""
    fields = _cpuinfo()
    if not fields:
        return ""
    return f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"


def simd_target():
    """The SIMD target qkv's kernels run on in this process's environment. The Python
    package does not expose it, but an unknown QKV_SIMD_TARGET makes the library list the
    targets of its build that this CPU runs, best first (src/cpu/simd_target.cpp), and the
    best is what it picks when the variable is unset: ask a child interpreter."""
    forced = os.environ.get("QKV_SIMD_TARGET")
    if forced:
        return f"{forced.upper()} (forced by QKV_SIMD_TARGET)"
    probe = ("import numpy as np, qkv\n"
             "x = np.ones((1, 1, 1, 8), np.float32)\n"
             "try:\n    qkv.attention(x, x, x)\nexcept qkv.Error as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, QKV_SIMD_TARGET="?"),
                          capture_output=True, text=True, check=True)
    listed = done.stdout.rsplit("choose one of", 1)
    return listed[1].split(",")[0].strip() if len(listed) == 2 else "unknown"


class OthersBusy:
    """How many cores the rest of the machine kept busy while a row ran: the CPU time of
    every process (/proc/stat) less this one's (/proc/self/stat), over the wall time. The
    1-minute load average lags a row by a minute; this is the row's own neighbour, which
    on a 2-core VM decides whether a 2-thread team gets both cores. Linux only (else None).

        with OthersBusy() as others:
            ...
        others.cores   # e.g. 0.02 quiet, ~1 with one busy neighbour
    """

    cores = None

    @staticmethod
    def _sample():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
        return busy, int(own[11]) + int(own[12]), time.perf_counter()  # utime + stime, clock ticks

    def __enter__(self):
        try:
            self._start = self._sample()
        except (OSError, ValueError, IndexError):
            self._start = None
        return self

    def __exit__(self, *exc):
        if self._start is not None:
            busy, own, wall = (b - a for a, b in zip(self._start, self._sample()))
            self.cores = max(0.0, (busy - own) / os.sysconf("SC_CLK_TCK") / wall)
        return False
