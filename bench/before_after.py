#!/usr/bin/env python3
"""Before/after timing of two builds of qkv, row by row, on both SIMD targets.

    bench/before_after.sh BASE_BUILD NEW_BUILD [--quick] [--targets AVX3 AVX2]
                          [--threads 1 2] [--rounds 2] [--only dense mask decode small]

Runs the C++ probes of both build directories (it builds nothing: build the targets
qkv_dense_probe, qkv_mask_probe, qkv_decode_probe and qkv_small_call in each first) on
the rows of the dense, mask, decode and small-call benchmarks, scaled to fit about ten
minutes in all (--quick: tiny shapes, a minute or so, to check the plumbing):

  dense   1 thread: qkv_dense_probe (fastest run by the thread's CPU time), more threads:
          qkv_mask_probe none/causal (fastest wall time); [1,8,2048,d] bhsd, fwd and bwd
  mask    qkv_mask_probe, bench_masks.py's kinds at [4,12,512,32] and its varlen row
          (16 sequences of 16..1024 keys, H=8, d=64), fwd and bwd, fastest wall time
  decode  qkv_decode_probe decode: bench_decode.py's 12/12/64, 32/8/128, 64/8/128 at
          32768 keys, fp32 and bf16 head-major and paged 16, int8 [N, Hkv, d]; best wall ms
  small   qkv_small_call (median µs per call, threads 0/1/2) and qkv_decode_probe
          small-call (best mean µs, attention_forward and decode, 1 and 2 threads)

The SIMD target is forced with QKV_SIMD_TARGET (the library), QKV_PROBE_TARGET
(qkv_decode_probe) and qkv_dense_probe's target argument. Each row runs base, new, base,
new, … (--rounds pairs) before the next row starts, so drift (load, clocks, other
processes) hits both builds alike. Per build the better round counts (the probes already
keep their best or median of several calls); "after/before" > 1 means the new build is
slower; "noise" is the larger of the two builds' spreads between their own rounds
(max/min − 1): a ratio inside 1 ± noise is within noise. Load average (uptime) is
printed at the start and at the end.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

PROBES = ("qkv_dense_probe", "qkv_mask_probe", "qkv_decode_probe", "qkv_small_call")


@dataclass
class Job:
    """One probe invocation; `parse` turns its output into {row label: value}."""
    section: str
    argv: list[str]
    parse: Callable[[str], dict[str, float]]
    unit: str
    env: dict[str, str] = field(default_factory=dict)


def key_values(text: str) -> dict[str, float]:
    values = {}
    for item in text.split():
        if "=" in item:
            key, value = item.split("=", 1)
            try:
                values[key] = float(value)
            except ValueError:
                pass
    return values


def dense_probe_times(text: str) -> dict[str, float]:
    """qkv_dense_probe's '  fwd  12.34 ms ...' lines."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^\s+(fwd|bwd)\s+([\d.]+) ms", text, re.M)}


def small_call_medians(text: str) -> dict[str, float]:
    return {f"threads={m.group(1)}": float(m.group(2))
            for m in re.finditer(r"threads=(\d+): median ([\d.]+) us", text)}


def jobs_for(args, target: str) -> list[tuple[str, Job]]:
    """(row prefix, job) for one SIMD target, in the order they run."""
    q = args.quick
    n, repeats = (256, 2) if q else (2048, 3)
    jobs = []
    for threads in args.threads:
        t = f"{threads} thr"
        if "dense" in args.only:
            for d, causal in ((64, False), (64, True), (128, False)):
                shape = f"dense [1,8,{n},{d}]{' causal' if causal else ''}"
                if threads == 1:
                    argv = ["qkv_dense_probe", str(n), str(d), str(int(causal)), "8", str(repeats), "both", "bhsd", target]
                    jobs.append((f"{t} | {shape}", Job("dense", argv, dense_probe_times, "ms, thread CPU, best")))
                else:
                    argv = ["qkv_mask_probe", "causal" if causal else "none", "1", "8", str(n), str(d), str(threads),
                            str(repeats + 2)]
                    jobs.append((f"{t} | {shape}", Job("dense", argv, min_times, "ms, wall, best")))
        if "mask" in args.only:
            b, h, mn, md = (2, 4, 128, 32) if q else (4, 12, 512, 32)
            for kind in ("none", "bool_B11N", "bool_B1NN", "float_B1NN", "causal+pad", "float_bias", "key_lengths",
                         "key_lengths+causal"):
                argv = ["qkv_mask_probe", kind, str(b), str(h), str(mn), str(md), str(threads), "3" if q else "5"]
                jobs.append((f"{t} | mask [{b},{h},{mn},{md}] {kind}", Job("mask", argv, min_times, "ms, wall, best")))
            seqs, vn = (4, 128) if q else (16, 1024)
            argv = ["qkv_mask_probe", "varlen", str(seqs), "8", str(vn), "64", str(threads), "3" if q else "5"]
            jobs.append((f"{t} | varlen {seqs} seqs 16..{vn}, H=8 d=64",
                         Job("mask", argv, min_times, "ms, wall, best")))
        if "decode" in args.only:
            keys = 2048 if q else 32768
            shapes = ((32, 8, 128),) if q else ((12, 12, 64), (32, 8, 128), (64, 8, 128))
            for hq, hkv, d in shapes:
                rows = [(ty, page) for ty in ("f32", "bf16") for page in (-1, 16)] + [("i8", 0)]
                for ty, page in rows:
                    layout = {-1: "head-major", 16: "paged 16", 0: "[N,Hkv,d]"}[page]
                    argv = ["qkv_decode_probe", "decode", str(hq), str(hkv), str(d), str(keys), ty, str(threads), str(page)]
                    env = {"QKV_PROBE_ROUNDS": "5"} if q else {}
                    jobs.append((f"{t} | decode {hq}/{hkv} d{d} N={keys} {ty} {layout}",
                                 Job("decode", argv, lambda text: {"": key_values(text)["decode_ms"]}, "ms, wall, best",
                                     env)))
    if "small" in args.only:
        calls = "2000" if q else "20000"
        jobs.append(("- | small call q [1,12,1,64], 64 keys, attention_forward",
                     Job("small", ["qkv_small_call", calls], small_call_medians, "µs, median")))
        if not q:  # a fixed 440 000 calls
            jobs.append(("- | small call (decode_probe)",
                         Job("small", ["qkv_decode_probe", "small-call"],
                             lambda text: {k.replace("small_call_us_", ""): v for k, v in key_values(text).items()},
                             "µs, best mean")))
    return jobs


def min_times(text: str) -> dict[str, float]:
    values = key_values(text)
    return {"fwd": values["fwd_min_ms"], "bwd": values["bwd_min_ms"]}


def run(build: str, job: Job, target: str) -> dict[str, float]:
    exe = os.path.join(build, "bench", job.argv[0])
    env = dict(os.environ, QKV_SIMD_TARGET=target, QKV_PROBE_TARGET=target, **job.env)
    result = subprocess.run([exe, *job.argv[1:]], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"before_after: {' '.join([exe, *job.argv[1:]])} failed:\n{result.stderr}")
    return job.parse(result.stdout)


def describe(build: str) -> str:
    """The source tree a build dir was configured from, and its commit."""
    source = "?"
    try:
        with open(os.path.join(build, "CMakeCache.txt")) as cache:
            for line in cache:
                if line.startswith("CMAKE_HOME_DIRECTORY:"):
                    source = line.split("=", 1)[1].strip()
        commit = subprocess.run(["git", "-C", source, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", source, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return f"{build} ({source} at {commit}{' + uncommitted changes' if dirty else ''})"
    except OSError:
        return f"{build} (source unknown)"


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="build directory of the code before (e.g. a worktree of main's build/release)")
    parser.add_argument("new", help="build directory of the code after")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: checks that everything runs")
    parser.add_argument("--targets", nargs="+", default=["AVX3", "AVX2"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=2, help="base/new pairs per row (default 2: A B A B)")
    parser.add_argument("--only", nargs="+", default=["dense", "mask", "decode", "small"],
                        choices=("dense", "mask", "decode", "small"))
    args = parser.parse_args()
    for build in (args.base, args.new):
        missing = [p for p in PROBES if not os.access(os.path.join(build, "bench", p), os.X_OK)]
        if missing:
            parser.error(f"{build}/bench lacks {', '.join(missing)} (cmake --build {build} --target {' '.join(PROBES)})")

    started = time.time()
    print(f"# before: {describe(args.base)}")
    print(f"# after:  {describe(args.new)}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {cpu_model()}, {os.cpu_count()} cpus; "
          f"{'--quick, ' if args.quick else ''}{args.rounds} rounds interleaved per row")
    print(f"# load at start: {uptime()}")
    print()
    print("| target | threads | row | unit | before | after | after/before | noise |")
    print("|---|---|---|---|---|---|---|---|")
    for target in args.targets:
        for prefix, job in jobs_for(args, target):
            rounds = {"base": [], "new": []}
            for _ in range(args.rounds):
                for side, build in (("base", args.base), ("new", args.new)):
                    rounds[side].append(run(build, job, target))
            for metric in rounds["base"][0]:  # every figure: lower is better
                base = [r[metric] for r in rounds["base"]]
                new = [r[metric] for r in rounds["new"]]
                noise = max(max(v) / min(v) - 1.0 for v in (base, new))
                label = f"{prefix} {metric}".rstrip()
                print(f"| {target} | {label} | {job.unit} | {min(base):.3f} | {min(new):.3f} | "
                      f"{min(new) / min(base):.3f} | ±{100 * noise:.1f}% |", flush=True)
    print()
    print(f"# load at end: {uptime()}; {time.time() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
