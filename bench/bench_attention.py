#!/usr/bin/env python3
"""qkv against PyTorch's scaled_dot_product_attention on the CPU, in one process.

For every row: the same fp32 inputs go through torch SDPA (its fused flash kernel) and
qkv's cpu backend, with the same thread count; we report the median of --repeats timed
runs after a warm-up, GFLOP/s, the share of the machine's FMA peak (measured by
build/release/bench/qkv_fma_peak, same threads), the speed ratio torch/qkv (> 1: qkv
is faster) and each one's max abs error against an fp64 oracle (the same math in
float64 through torch, materialized; tests check it agrees with qkv's reference
backend).

FLOPs: forward 4·B·H·Nq·Nk·d (half when causal); forward+backward counts the backward
as 2.5× the forward, so fwd+bwd = 3.5× forward.

--dtype bfloat16|float16: the inputs are rounded to that type and both run on them (torch
SDPA and qkv in that dtype); the row adds qkv's own fp32 time on the same (widened)
values and the speed fp32/half (> 1: the half call is faster; with the fp32 arithmetic
the storage type should cost almost nothing, and bf16 dot products, where they run —
QKV_DOT_PRODUCTS, src/cpu/dot_products.hpp — can make it up to 2×), and its share of the
fp32 FMA and bf16 dot peaks measured in the same run. In that mode the three (torch, qkv half, qkv
fp32) are timed interleaved, call after call, so a shared machine's load swings hit all
three alike. Errors are then against the fp64 result on
the rounded inputs.

Fairness: torch.set_num_threads(T) for T in --threads (PyTorch uses one thread here
unless told); glibc malloc is told (mallopt) to keep freed large blocks instead of
returning them to the kernel on every call, which would otherwise charge page faults
to whoever allocates (torch allocates its outputs and buffers per call, qkv too).

SIMD targets: QKV_SIMD_TARGET=AVX2 makes qkv run its AVX2 kernels on an AVX-512 CPU and
ATEN_CPU_CAPABILITY=avx2 does the same for PyTorch; set both to measure the AVX2 rows
(qkv_fma_peak then measures the AVX2 peak too). bench/portability.py does it for every target.
"""
from __future__ import annotations

import argparse
import ctypes
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import qkv
from bench_timing import cpu_vendor


def keep_freed_memory() -> None:
    libc = ctypes.CDLL("libc.so.6")
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)  # serve big blocks from the heap…
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 62)  # …and never give them back


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    kv_heads: int
    n: int
    d: int
    causal: bool

    def label(self) -> str:
        heads = f"H={self.heads}" + (f"/{self.kv_heads}" if self.kv_heads != self.heads else "")
        return f"B={self.batch} {heads} N={self.n} d={self.d}{' causal' if self.causal else ''}"

    def forward_flops(self) -> float:
        f = 4.0 * self.batch * self.heads * self.n * self.n * self.d
        return f / 2 if self.causal else f


def shapes(quick: bool, half: bool = False) -> list[Shape]:
    if half:  # the half-precision issues' rows (10: N = 4096; 23: N = 1024, GQA 32/8)
        rows = [Shape(1, 8, 8, 1024, d, causal) for causal in (False, True) for d in (64, 128)]
        rows += [Shape(1, 32, 8, 1024, d, causal) for causal in (False, True) for d in (64, 128)]
        if not quick:
            rows += [Shape(1, 8, 8, 4096, d, causal) for causal in (False, True) for d in (64, 128)]
        return rows
    rows = []
    ns = (512, 1024, 2048, 4096) if quick else (512, 1024, 2048, 4096, 8192)
    for causal in (False, True):
        for n in ns:
            rows.append(Shape(1, 8, 8, n, 64, causal))
        for n in (2048, 4096):
            rows.append(Shape(1, 8, 8, n, 128, causal))
        rows.append(Shape(1, 32, 8, 2048, 128, causal))
        rows.append(Shape(8, 16, 16, 512, 64, causal))
    return rows


# The probes' folder; bench/portability.py points it at another build (--build).
BUILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build", "release", "bench")
BF16_PEAK: dict[int, float] = {}  # threads → the bf16 dot peak (GFLOP/s; 0: no unit)
AMX_PEAK: dict[int, float] = {}  # threads → the AMX tiles' bf16 peak (GFLOP/s; 0: none)


def bf16_unit_peak(threads: int) -> tuple[str, float]:
    """The unit qkv's bfloat16 calls (precision "fast") run on here and its peak, by
    src/cpu/dot_products.cpp's bf16_unit: the AMX tiles where the CPU has them unless
    QKV_AMX=off; else vdpbf16ps where the CPU has it and it pays (AMD) or
    QKV_DOT_PRODUCTS=on; else the fp32 FMAs (an Intel with QKV_AMX=off), whose peak the
    caller has already."""
    dots = os.environ.get("QKV_DOT_PRODUCTS", "auto").lower()
    amx = os.environ.get("QKV_AMX", "auto").lower()
    if dots != "off" and amx != "off" and AMX_PEAK.get(threads, 0.0) > 0:
        return "amx", AMX_PEAK[threads]
    pays = dots == "on" or "AMD" in cpu_vendor()
    if dots != "off" and pays and BF16_PEAK.get(threads, 0.0) > 0:
        return "bf16 dot", BF16_PEAK[threads]
    return "fp32 FMA", 0.0



def fma_peak(threads: int) -> tuple[float, str]:
    """(GFLOP/s, the SIMD target Highway picks: the one qkv's kernels dispatch to); the
    bf16 dot peak of the same run goes to BF16_PEAK."""
    exe = os.path.join(BUILD, "qkv_fma_peak")
    out = subprocess.run([exe, str(threads)], check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        fields = dict(f.split("=") for f in line.split())
        if int(fields["threads"]) == threads:
            BF16_PEAK[threads] = float(fields.get("bf16_gflops", 0))
            AMX_PEAK[threads] = float(fields.get("amx_gflops", 0))
            return float(fields["gflops"]), fields.get("target", "?")
    raise RuntimeError(out)


# --clock thread: CPU time of the calling thread, fastest run (see main's help).
CLOCK = {"wall": time.perf_counter, "thread": time.thread_time}
clock = time.perf_counter
summary = statistics.median


def fma_peak_thread_time() -> tuple[float, str]:
    """One core's FMA peak by thread CPU time, on the SIMD target qkv will use
    (QKV_SIMD_TARGET included), from qkv_dense_probe's header line."""
    exe = os.path.join(BUILD, "qkv_dense_probe")
    target = os.environ.get("QKV_SIMD_TARGET", "best") or "best"
    out = subprocess.run([exe, "64", "64", "0", "1", "1", "fwd", "bhsd", target, "bfloat16"],
                         check=True, capture_output=True, text=True).stdout
    header = out.splitlines()[0]
    if "bf16 dot peak " in out:
        BF16_PEAK[1] = float(out.split("bf16 dot peak ")[1].split()[0])
    if "AMX bf16 peak " in out:
        AMX_PEAK[1] = float(out.split("AMX bf16 peak ")[1].split()[0])
    gflops = float(header.split("FMA peak ")[1].split()[0])
    return gflops, header.rsplit("(", 1)[1].rstrip(")")


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return summary(times)


def median_times_interleaved(fns, repeats: int) -> list[float]:
    """Median time of each function, the calls interleaved (a, b, c, a, b, c, ...) so
    that a shared machine's load swings hit every one of them alike."""
    for fn in fns:
        fn()  # warm-up
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, t in zip(fns, times):
            start = clock()
            fn()
            t.append(clock() - start)
    return [summary(t) for t in times]


def make_inputs(s: Shape, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s.batch, s.heads, s.n, s.d, generator=g)
    k = torch.randn(s.batch, s.kv_heads, s.n, s.d, generator=g)
    v = torch.randn(s.batch, s.kv_heads, s.n, s.d, generator=g)
    dout = torch.randn(s.batch, s.heads, s.n, s.d, generator=g)
    return q, k, v, dout


def oracle(s: Shape, q, k, v, dout, backward: bool):
    """fp64 materialized attention (and its gradients), one (batch, head) at a time."""
    group = s.heads // s.kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    grads = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)] if backward else None
    mask = torch.ones(s.n, s.n, dtype=torch.bool).tril() if s.causal else None
    for b in range(s.batch):
        for h in range(s.heads):
            qh = q[b, h].double().requires_grad_(backward)
            kh = k[b, h // group].double().requires_grad_(backward)
            vh = v[b, h // group].double().requires_grad_(backward)
            logits = (qh @ kh.T) / math.sqrt(s.d)
            if mask is not None:
                logits = logits.masked_fill(~mask, float("-inf"))
            o = torch.softmax(logits, dim=-1) @ vh
            out[b, h] = o.detach()
            if backward:
                o.backward(dout[b, h].double())
                grads[0][b, h] += qh.grad
                grads[1][b, h // group] += kh.grad
                grads[2][b, h // group] += vh.grad
    return out, grads


def max_error(results, reference) -> float:
    return max(float((r.double() - ref).abs().max()) for r, ref in zip(results, reference))


def run_torch(s: Shape, q, k, v, dout, backward: bool):
    gqa = s.kv_heads != s.heads
    if not backward:
        with torch.no_grad():
            return [F.scaled_dot_product_attention(q, k, v, is_causal=s.causal, enable_gqa=gqa)]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=s.causal, enable_gqa=gqa)
    out.backward(dout)
    return [t.grad for t in leaves]


def run_qkv(s: Shape, q, k, v, dout, backward: bool, threads: int):
    causal = "top_left" if s.causal else None
    out, lse = qkv.attention(q, k, v, causal=causal, return_lse=True, backend="cpu", threads=threads)
    if not backward:
        return [out]
    return list(qkv.attention_backward(q, k, v, out, lse, dout, causal=causal, backend="cpu",
                                       threads=threads))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="skip N=8192")
    parser.add_argument("--filter", default="", help="only rows whose label contains this")
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="storage type of q, k, v, dout (half: the issue-10 rows, with "
                             "qkv's fp32 time on the same values)")
    parser.add_argument("--clock", default="wall", choices=tuple(CLOCK),
                        help="thread: time each call by the CPU time of the calling thread and "
                             "keep the fastest run (one thread only: torch and qkv then compute on "
                             "the calling thread). Unlike the wall clock it does not count time "
                             "other processes took from us, so a shared machine can still compare "
                             "kernels; the FMA peak is then measured the same way "
                             "(build/release/bench/qkv_dense_probe)")
    args = parser.parse_args()
    global clock, summary
    clock = CLOCK[args.clock]
    if args.clock == "thread":
        if args.threads != [1]:
            parser.error("--clock thread needs --threads 1")
        summary = min
    dtype = getattr(torch, args.dtype)
    half = dtype != torch.float32

    keep_freed_memory()
    measured = {1: fma_peak_thread_time()} if args.clock == "thread" else {
        t: fma_peak(t) for t in args.threads}
    peaks = {t: gflops for t, (gflops, _) in measured.items()}
    target = next(iter(measured.values()))[1]
    print(f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus; "
          f"torch {torch.__version__}; qkv {qkv.__version__}; SIMD {target}; "
          f"dtype {args.dtype}; clock {args.clock}; ATEN_CPU_CAPABILITY "
          f"{os.environ.get('ATEN_CPU_CAPABILITY', 'default')}; QKV_DOT_PRODUCTS "
          f"{os.environ.get('QKV_DOT_PRODUCTS', 'auto')}; load {os.getloadavg()[0]:.1f}; FMA peak "
          + ", ".join(f"{t} thr {p:.0f} GFLOP/s" for t, p in peaks.items())
          + "; bf16 dot peak " + ", ".join(f"{t} thr {p:.0f} GFLOP/s" for t, p in BF16_PEAK.items())
          + "; AMX bf16 peak " + ", ".join(f"{t} thr {p:.0f} GFLOP/s" for t, p in AMX_PEAK.items())
          + (f"; bfloat16 on: {bf16_unit_peak(next(iter(peaks)))[0]} (its peak in '% unit peak')" if half else ""))
    if half:
        print("| shape | pass | thr | torch ms | qkv ms | qkv fp32 ms | qkv fp32/half speed | "
              "qkv GFLOP/s | % fp32 peak | % unit peak | qkv/torch speed | qkv err | torch err |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    else:
        print("| shape | pass | thr | torch ms | qkv ms | qkv GFLOP/s | % peak | qkv/torch speed | "
              "qkv err | torch err |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    with torch.inference_mode(False):
        for s in shapes(args.quick, half):
            if args.filter not in s.label():
                continue
            q, k, v, dout = (x.to(dtype) for x in make_inputs(s))
            widened = [x.float() for x in (q, k, v, dout)]
            for backward in ((False,) if args.no_backward else (False, True)):
                ref_out, ref_grads = oracle(s, q, k, v, dout, backward)
                reference = ref_grads if backward else [ref_out]
                flops = s.forward_flops() * (3.5 if backward else 1.0)
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    if half:  # interleaved: the half/fp32 ratio is what the row is about
                        t_torch, t_qkv, t_fp32 = median_times_interleaved(
                            [lambda: run_torch(s, q, k, v, dout, backward),
                             lambda: run_qkv(s, q, k, v, dout, backward, threads),
                             lambda: run_qkv(s, *widened, backward, threads)], args.repeats)
                    else:
                        t_torch = median_time(lambda: run_torch(s, q, k, v, dout, backward),
                                              args.repeats)
                        t_qkv = median_time(lambda: run_qkv(s, q, k, v, dout, backward, threads),
                                            args.repeats)
                    e_torch = max_error(run_torch(s, q, k, v, dout, backward), reference)
                    e_qkv = max_error(run_qkv(s, q, k, v, dout, backward, threads), reference)
                    gflops = flops / t_qkv / 1e9
                    if half:
                        bf16_peak = bf16_unit_peak(threads)[1] if dtype == torch.bfloat16 else 0.0
                        print(f"| {s.label()} | {'fwd+bwd' if backward else 'fwd'} | {threads} | "
                              f"{t_torch * 1e3:.1f} | {t_qkv * 1e3:.1f} | {t_fp32 * 1e3:.1f} | "
                              f"{t_fp32 / t_qkv:.2f}× | {gflops:.1f} | "
                              f"{100 * gflops / peaks[threads]:.0f}% | "
                              f"{f'{100 * gflops / bf16_peak:.0f}%' if bf16_peak else '—'} | "
                              f"{t_torch / t_qkv:.2f}× | {e_qkv:.1e} | {e_torch:.1e} |", flush=True)
                        continue
                    print(f"| {s.label()} | {'fwd+bwd' if backward else 'fwd'} | {threads} | "
                          f"{t_torch * 1e3:.1f} | {t_qkv * 1e3:.1f} | {gflops:.1f} | "
                          f"{100 * gflops / peaks[threads]:.0f}% | {t_torch / t_qkv:.2f}× | "
                          f"{e_qkv:.1e} | {e_torch:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
