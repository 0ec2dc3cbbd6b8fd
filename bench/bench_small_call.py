"""Fixed cost of one small attention call (issue 11, part 3), qkv next to PyTorch.

Shape: q [1, 12, 1, 64] against 64 keys (k, v [1, 12, 64, 64]), float32: one decoding
step of one layer of a small model, where the call's fixed costs (argument passing,
validation, dispatch, threads) are most of its time.

Every call is timed on its own (perf_counter_ns), warm, the implementations interleaved
in blocks so they share the machine's moods; the table gives the median over all calls
and the 10th/90th percentiles. Load average (other workers share the cores) is printed
with the results.

Also measured, because a small call is usually followed by more Python:
- after a call that runs on 2 threads: how much CPU the process burns while the calling
  thread sleeps for 20 ms (idle OpenMP workers that spin instead of sleeping show up
  here), and how long a fixed piece of Python takes right after such a call, next to
  the same piece after 20 ms of idleness.

    python bench/bench_small_call.py [--calls 20000] [--probe build/release/bench/qkv_small_call]
                                     [--torch-first]

--probe: the C++ timing (bench/small_call.cpp), run as a subprocess and printed as is.
--torch-first: import torch before qkv. The process then keeps the OpenMP wait policy
libgomp was loaded with (spinning, unless OMP_WAIT_POLICY says otherwise); by default qkv
is imported first and its workers, torch's too (one libgomp), wait passively
(qkv/_threads.py).
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import time

if "--torch-first" in sys.argv:
    importlib.import_module("torch")
import qkv  # noqa: E402  (before torch by default: see above)
import qkv.torch as qt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402


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
    return time_calls(functions, calls), (q, k, v)


def spin_rows(repeats: int = 40):
    """Per 2-thread call: (median µs of the call itself, median CPU ms the process burns
    while its thread sleeps 20 ms right after it, median µs of a fixed Python loop run
    right after it, and of the same loop after 20 ms of idleness); qkv and, as the peer,
    torch."""
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
        calls, burnt, after, idle = [], [], [], []
        clock = time.perf_counter_ns
        for _ in range(repeats):
            time.sleep(0.02)
            start = clock()
            python_work()
            idle.append((clock() - start) / 1e3)
            start = clock()
            call()
            middle = clock()
            python_work()
            after.append((clock() - middle) / 1e3)
            calls.append((middle - start) / 1e3)
            call()
            cpu = time.process_time()
            time.sleep(0.02)
            burnt.append((time.process_time() - cpu) * 1e3)
        return tuple(statistics.median(x) for x in (calls, burnt, after, idle))

    return {
        "qkv.attention (NumPy, threads=2)": measure(lambda: qkv.attention(qn, qn, qn, threads=2)),
        "torch SDPA (2 threads)": measure(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000, help="timed calls per implementation")
    parser.add_argument("--probe", default=None, help="path of the qkv_small_call C++ probe")
    parser.add_argument("--torch-first", action="store_true", help="import torch before qkv")
    args = parser.parse_args()

    print(f"# python {sys.version.split()[0]}, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), qkv {qkv.__version__}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}, "
          f"qkv's OpenMP wait decision: {getattr(getattr(qkv, '_threads', None), 'decision', None)}")
    print(f"# load average before: {os.getloadavg()}")
    if args.probe:
        print(subprocess.run([args.probe], check=True, capture_output=True, text=True).stdout, end="")
    threads = torch.get_num_threads()
    rows, (q, k, v) = small_call_rows(args.calls)
    print("| call, q [1,12,1,64], 64 keys, fp32 | median µs | p10 µs | p90 µs |")
    print("|---|---|---|---|")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.1f} | {percentile(values, 0.1):.1f} | "
              f"{percentile(values, 0.9):.1f} |")
    torch.set_num_threads(1)
    one = time_calls({
        "torch.nn.functional.scaled_dot_product_attention, torch 1 thread":
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
        "qkv.torch.scaled_dot_product_attention, torch 1 thread":
            lambda: qt.scaled_dot_product_attention(q, k, v),
    }, args.calls // 2)
    torch.set_num_threads(threads)
    for name, values in one.items():
        print(f"| {name} | {statistics.median(values):.1f} | {percentile(values, 0.1):.1f} | "
              f"{percentile(values, 0.9):.1f} |")
    print()
    print("| 2-thread call, [1,8,256,64] | call µs | CPU ms burnt in the 20 ms sleep after it "
          "| Python loop µs right after | same loop µs after 20 ms idle |")
    print("|---|---|---|---|---|")
    for name, (call, burnt, after, idle) in spin_rows().items():
        print(f"| {name} | {call:.0f} | {burnt:.2f} | {after:.0f} | {idle:.0f} |")
    print(f"# load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
