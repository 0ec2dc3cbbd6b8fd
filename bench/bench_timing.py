"""What the Python benchmarks share: the best time of a call and the CPU's name (every
figure names its CPU). Imported by the bench_*.py scripts, which run from this folder."""

from __future__ import annotations

import platform
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


def cpu_model():
    """/proc/cpuinfo's model name (platform.processor() where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
