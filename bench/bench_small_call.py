"""Fixed cost of one small attention call (issue 11, part 3), qkv next to PyTorch.

Shape: q [1, 12, 1, 64] against 64 keys (k, v [1, 12, 64, 64]), float32: one decoding
step of one layer of a small model, where the call's fixed costs (argument passing,
validation, dispatch, threads) are most of its time.

Every call is timed on its own (perf_counter_ns), warm, the implementations interleaved
in blocks so they share the machine's moods; the table gives the median over all calls
and the 10th/90th percentiles. Load average (other workers share the cores) is printed
with the results.

Also measured, because a small call is usually followed by more Python:
- `spin`: after a call that runs on 2 threads, how much CPU the process burns while the
  calling thread sleeps for 20 ms (idle OpenMP workers that spin instead of sleeping show
  up here), and how long a fixed piece of Python takes right after such a call.

    python bench/bench_small_call.py [--calls 20000] [--probe build/release/bench/qkv_small_call]

--probe: the C++ timing (bench/small_call.cpp), run as a subprocess and printed as is.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

import qkv
import qkv.torch as qt


def percentile(sorted_values, p):
    return sorted_values[min(len(sorted_values) - 1, int(p * len(sorted_values)))]


def time_calls(functions: dict, calls: int, block: int = 200):
    """name -> sorted per-call times in µs; `calls` calls each, interleaved in blocks."""
    times = {name: [] for name in functions}
    clock = time.perf_counter_ns
    for fn in functions.values():  # warm: caches, lazy imports, thread pools
        for _ in range(500):
            fn()
    rounds = max(1, calls // block)
    names = list(functions)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            fn, out = functions[name], times[name]
            for _ in range(block):
                start = clock()
                fn()
                out.append((clock() - start) / 1e3)
    return {name: sorted(values) for name, values in times.items()}


def small_call_rows(calls: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 12, 1, 64, generator=g)
    k = torch.randn(1, 12, 64, 64, generator=g)
    v = torch.randn(1, 12, 64, 64, generator=g)
    qn, kn, vn = q.numpy(), k.numpy(), v.numpy()
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.allclose(qt.scaled_dot_product_attention(q, k, v), expected, atol=1e-5)
    assert np.allclose(qkv.attention(qn, kn, vn), expected.numpy(), atol=1e-5)
    functions = {
        "torch.nn.functional.scaled_dot_product_attention":
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
        "qkv.torch.scaled_dot_product_attention": lambda: qt.scaled_dot_product_attention(q, k, v),
        "qkv.attention (NumPy)": lambda: qkv.attention(qn, kn, vn),
        "qkv.attention (torch)": lambda: qkv.attention(q, k, v),
    }
    return time_calls(functions, calls)


def spin_rows(repeats: int = 30):
    """(CPU ms burnt during a 20 ms sleep after a 2-thread call, µs of a fixed Python
    loop right after it), medians; for qkv and, as the peer, torch."""
    g = torch.Generator().manual_seed(1)
    # Big enough that both qkv (forward tiles) and torch run it on 2 threads.
    q = torch.randn(1, 8, 256, 64, generator=g)
    qn = q.numpy()

    def python_work():
        total = 0
        for i in range(3000):
            total += i * i
        return total

    def measure(call):
        burnt, after = [], []
        for _ in range(repeats):
            call()
            start = time.perf_counter_ns()
            python_work()
            after.append((time.perf_counter_ns() - start) / 1e3)
            call()
            cpu = time.process_time()
            time.sleep(0.02)
            burnt.append((time.process_time() - cpu) * 1e3)
        return statistics.median(burnt), statistics.median(after)

    time.sleep(0.05)
    quiet_start = time.perf_counter_ns()
    for _ in range(repeats):
        python_work()
    quiet = (time.perf_counter_ns() - quiet_start) / 1e3 / repeats
    return {
        "no call before (Python loop alone)": (0.0, quiet),
        "after qkv.attention (NumPy, 2 threads)": measure(lambda: qkv.attention(qn, qn, qn, threads=2)),
        "after torch SDPA (2 threads)": measure(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000, help="timed calls per implementation")
    parser.add_argument("--probe", default=None, help="path of the qkv_small_call C++ probe")
    args = parser.parse_args()

    print(f"# python {sys.version.split()[0]}, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), qkv {qkv.__version__}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}")
    print(f"# load average before: {os.getloadavg()}")
    if args.probe:
        print(subprocess.run([args.probe], check=True, capture_output=True, text=True).stdout, end="")
    rows = small_call_rows(args.calls)
    print("| call, q [1,12,1,64], 64 keys, fp32 | median µs | p10 µs | p90 µs |")
    print("|---|---|---|---|")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.1f} | {percentile(values, 0.1):.1f} | "
              f"{percentile(values, 0.9):.1f} |")
    print()
    print("| after a 2-thread call [1,8,256,64] | CPU ms burnt in a 20 ms sleep | Python loop µs |")
    print("|---|---|---|")
    for name, (burnt, after) in spin_rows().items():
        print(f"| {name} | {burnt:.2f} | {after:.0f} |")
    print(f"# load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
