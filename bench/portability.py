#!/usr/bin/env python3
"""qkv's workload table, with PASS/MISS, on every SIMD target this CPU runs (issue 42 item 6).

Natively, then on each lower compiled target forced: one markdown table per target and
thread count, each with the unit peaks probed in the same run and a PASS/MISS column
against the row's target.

    python3 bench/portability.py                       # all rows, N = 4096, 1 and 2 threads
    python3 bench/portability.py --quick --threads 1   # N = 1024, fewer repeats (~minutes)
    python3 bench/portability.py --build /path/to/build/release/bench --targets AVX2

Rows (qkv time, the peer's, peer/qkv speed, the share of the row's limit, the target it is
held to):
- fp32 dense forward and forward+backward against torch SDPA, B=1 H=8, d 64 and 128, causal
  and not, N 4096: ≥ 1.2× torch; forward also ≥ 80% of the FMA peak.
- decode against torch SDPA (fp32 cache, batch 1): MHA 12/12 d 64 at 4k and 32k keys
  (≥ 1.1× torch, ≥ 80% of streaming bandwidth); GQA 32/8 and 64/8 d 128 at 32k (≥ 75% of
  streaming bandwidth).
- bfloat16 (precision "fast") forward and forward+backward against torch in bfloat16, the
  fp32 rows' shapes: by the unit the calls run on, AMX ≥ 1.5× / 1.3×, AVX512-BF16 ≥ 2× /
  1.6×, none: speed reported only; every row's max error against the fp64 result within 2×
  torch's (FlashAttention's rule, the numerics contract).
- float16 forward time within 1.1× qkv's fp32 time on the same values (held on AVX2 only).

How: each (target, threads) runs in a fresh process (`--worker`), because qkv reads
QKV_SIMD_TARGET once per process. A forced target also caps the peer the way a CPU with only
that target would: ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA for torch, and below AVX-512
QKV_DOT_PRODUCTS=off (no bf16 unit). Timing, inputs, oracle and probes are
bench_attention.py's and bench_decode.py's, imported; peaks come from the build's
qkv_fma_peak (which measures the forced target since it reads QKV_SIMD_TARGET; an older
build's measures the best one, and then one thread falls back to qkv_dense_probe's per-core
peak on the forced target) and qkv_decode_probe bandwidth (QKV_PROBE_TARGET). The portable
fallbacks (SCALAR, EMU128) are left out unless --targets names them: no real CPU runs them,
and N = 4096 there takes hours.
"""
from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import qkv

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_attention as ba  # noqa: E402  (timing, inputs, oracle, FMA and bf16 peaks)
import bench_decode as bd  # noqa: E402  (decode timing, the bandwidth probe)
import bench_timing  # noqa: E402  (the CPU's name)

FALLBACKS = ("SCALAR", "EMU128")  # Highway's portable targets (see the docstring)


# ---- the parent: which targets, one worker process each ------------------------------

def compiled_targets() -> list[str]:
    """The SIMD targets of this qkv build that this CPU runs, best first. The package has
    no call for them; the library's refusal of an unknown QKV_SIMD_TARGET lists them."""
    code = ("import numpy, qkv\nq = numpy.zeros((1, 1, 1, 8), numpy.float32)\n"
            "try:\n    qkv.attention(q, q, q)\nexcept qkv.Error as error:\n    print(error)\n")
    env = dict(os.environ, QKV_SIMD_TARGET="portability-list")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout
    if "choose one of " not in out:
        raise RuntimeError(f"could not list qkv's SIMD targets from: {out!r}")
    return [name.strip() for name in out.split("choose one of ", 1)[1].split(",")]


def worker_environment(target: str, native: bool) -> dict[str, str]:
    """The environment of a worker on `target`: the natively best one untouched, a lower one
    forced for qkv (kernels and probes) and, as far as the peer lets us, for torch."""
    env = dict(os.environ)
    for name in ("QKV_SIMD_TARGET", "QKV_PROBE_TARGET"):
        env.pop(name, None)
    if native:
        return env
    env["QKV_SIMD_TARGET"] = target          # qkv's kernels (and the fixed qkv_fma_peak)
    env["QKV_PROBE_TARGET"] = target         # qkv_decode_probe's bandwidth pass
    if not target.startswith("AVX3"):        # a CPU without AVX-512
        avx2 = target == "AVX2"
        env["ATEN_CPU_CAPABILITY"] = "avx2" if avx2 else "default"
        env["ONEDNN_MAX_CPU_ISA"] = "AVX2" if avx2 else "SSE41"
        env["QKV_DOT_PRODUCTS"] = "off"      # AVX512-BF16 and AMX need AVX-512
    return env


def parent(args) -> int:
    available = compiled_targets()
    wanted = [t.upper() for t in args.targets] if args.targets else [t for t in available if t not in FALLBACKS]
    unknown = [t for t in wanted if t not in available]
    if unknown:
        print(f"not targets this build and CPU run: {', '.join(unknown)} (available: {', '.join(available)})",
              file=sys.stderr)
        return 2
    print(f"# bench/portability.py: qkv targets this CPU runs: {', '.join(available)} "
          f"(native {available[0]}); measuring {', '.join(wanted)}; threads "
          f"{', '.join(map(str, args.threads))}; {'quick' if args.quick else 'full'}; probes from {args.build}",
          flush=True)
    failed = 0
    for target in wanted:
        native = target == available[0]
        for threads in args.threads:
            command = [sys.executable, os.path.abspath(__file__), "--worker", target, "--threads", str(threads),
                       "--build", args.build] + (["--native"] if native else []) + (["--quick"] if args.quick else [])
            if args.repeats:
                command += ["--repeats", str(args.repeats)]
            result = subprocess.run(command, env=worker_environment(target, native))
            if result.returncode != 0:
                print(f"\n**{target}, {threads} thread(s): the worker exited with {result.returncode}**\n",
                      flush=True)
                failed += 1
    return 1 if failed else 0


# ---- the worker: one target, one thread count, one table -----------------------------

@dataclass
class Row:
    workload: str
    qkv_s: float
    peer: str
    peer_s: float
    share: float | None          # of the row's limit; None: that limit was not measured
    limit: str
    error_ratio: float | None = None
    checks: list[tuple[str, float | None, str, float]] = field(default_factory=list)  # (what, value, ≥|≤, bound)
    held_to: str = "report only"

    def result(self) -> str:
        def show(what, x):
            return f"{x:.1%}" if what == "share" else f"{x:.3f}"  # 79.7% is not 80%, 1.196 not 1.2

        misses = [f"{what} {show(what, value)}, not {sign} {show(what, bound)}"
                  for what, value, sign, bound in self.checks
                  if value is not None and (value < bound if sign == "≥" else value > bound)]
        if misses:
            return "MISS: " + ", ".join(misses)
        if any(value is None for _, value, _, _ in self.checks):
            return "? (limit not measured)"
        return "PASS" if self.checks else "—"

    def markdown(self) -> str:
        share = "—" if self.share is None else f"{self.share:.0%} {self.limit}"
        error = "—" if self.error_ratio is None else f"{self.error_ratio:.2f}×"
        return (f"| {self.workload} | {self.qkv_s * 1e3:.2f} | {self.peer} | {self.peer_s * 1e3:.2f} | "
                f"{self.peer_s / self.qkv_s:.2f}× | {share} | {error} | {self.held_to} | {self.result()} |")


def cpu_name() -> str:
    """/proc/cpuinfo's model name with its family and model (one VM's "AMD EPYC" is Zen 2,
    3 or 4: the numbers say which)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    numbers = f" (family {fields['cpu family']}, model {fields['model']})" if "cpu family" in fields else ""
    return bench_timing.cpu_model() + numbers


class Peaks:
    """The limits of this run, probed in this process's environment (its target)."""

    def __init__(self, threads: int, target: str):
        self.threads = threads
        self.fma, probed = ba.fma_peak(threads)
        self.fma_how = f"qkv_fma_peak, {probed}"
        if probed != target:
            # A build from before qkv_fma_peak read QKV_SIMD_TARGET measured the best
            # target; one core's peak on the forced one comes from qkv_dense_probe instead.
            self.fma, self.fma_how = None, f"not measured: qkv_fma_peak ran {probed}, rebuild it"
            if threads == 1:
                self.fma, probed = ba.fma_peak_thread_time()
                self.fma_how = f"qkv_dense_probe, {probed}, one core by thread CPU time"
        self.stream = float(bd.probe("qkv_decode_probe", "bandwidth", str(threads))["bandwidth_gbs"])
        self.unit, self.unit_peak = self.bf16_unit()

    def bf16_unit(self) -> tuple[str, float | None]:
        """The unit qkv's bfloat16 calls run on here, seen in their results: the fp32 FMAs
        give precision="exact"'s bits (src/cpu/dot_products.hpp), a dot unit does not."""
        x = torch.randn(1, 2, 256, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
        if torch.equal(qkv.attention(x, x, x, threads=1), qkv.attention(x, x, x, threads=1, precision="exact")):
            return "none", self.fma
        unit, peak = ba.bf16_unit_peak(self.threads)  # the tiles where present and allowed
        return ("AMX" if unit == "amx" else "AVX512-BF16"), peak or None


def attention_cases(quick: bool):
    """(shape, its label, fp32 q, k, v, dout) of the dense rows, one shape at a time."""
    n = 1024 if quick else 4096
    for causal in (False, True):
        for d in (64, 128):
            s = ba.Shape(1, 8, 8, n, d, causal)
            yield s, f"d {d}{' causal' if causal else ''} N {n}", *ba.make_inputs(s)


def fp32_rows(peaks: Peaks, threads: int, repeats: int, quick: bool):
    for s, name, q, k, v, dout in attention_cases(quick):
        for backward in (False, True):
            flops = s.forward_flops() * (3.5 if backward else 1.0)
            t_torch, t_qkv = ba.median_times_interleaved(
                [lambda: ba.run_torch(s, q, k, v, dout, backward),
                 lambda: ba.run_qkv(s, q, k, v, dout, backward, threads)], repeats)
            share = None if peaks.fma is None else flops / t_qkv / 1e9 / peaks.fma
            checks = [("speed", t_torch / t_qkv, "≥", 1.2)] + ([] if backward else [("share", share, "≥", 0.8)])
            yield Row(f"fp32 {'fwd+bwd' if backward else 'fwd'} {name}", t_qkv, "torch fp32", t_torch, share,
                      "FMA", checks=checks, held_to="≥ 1.2× torch" + ("" if backward else ", ≥ 80% FMA"))


def bf16_rows(peaks: Peaks, threads: int, repeats: int, quick: bool):
    """precision "fast" against torch in bfloat16, errors against the fp64 result of the
    rounded inputs; the speed target is the unit's (none: reported only)."""
    goals = {"AMX": (1.5, 1.3), "AVX512-BF16": (2.0, 1.6)}.get(peaks.unit)
    for s, name, *fp32 in attention_cases(quick):
        h = [x.bfloat16() for x in fp32]
        for backward in (False, True):
            flops = s.forward_flops() * (3.5 if backward else 1.0)
            t_torch, t_qkv = ba.median_times_interleaved(
                [lambda: ba.run_torch(s, *h, backward), lambda: ba.run_qkv(s, *h, backward, threads)], repeats)
            ref_out, ref_grads = ba.oracle(s, *h, backward)
            reference = ref_grads if backward else [ref_out]
            error_ratio = (ba.max_error(ba.run_qkv(s, *h, backward, threads), reference)
                           / ba.max_error(ba.run_torch(s, *h, backward), reference))
            share = None if not peaks.unit_peak else flops / t_qkv / 1e9 / peaks.unit_peak
            checks, held = [("error", error_ratio, "≤", 2.0)], "error ≤ 2× torch's"
            if goals:
                goal = goals[1 if backward else 0]
                checks.append(("speed", t_torch / t_qkv, "≥", goal))
                held = f"≥ {goal:g}× torch ({peaks.unit}), {held}"
            yield Row(f"bf16 {'fwd+bwd' if backward else 'fwd'} {name}", t_qkv, "torch bf16", t_torch, share,
                      "FMA" if peaks.unit == "none" else peaks.unit, error_ratio, checks, held)


def fp16_rows(peaks: Peaks, threads: int, repeats: int, quick: bool, target: str):
    """float16 forward against qkv's own fp32 time on the same (widened) values."""
    avx2 = target == "AVX2"
    for s, name, q, k, v, dout in attention_cases(quick):
        f16 = [x.half() for x in (q, k, v, dout)]
        widened = [x.float() for x in f16]
        t_half, t_fp32 = ba.median_times_interleaved(
            [lambda: ba.run_qkv(s, *f16, False, threads), lambda: ba.run_qkv(s, *widened, False, threads)],
            repeats)
        share = None if peaks.fma is None else s.forward_flops() / t_half / 1e9 / peaks.fma
        yield Row(f"fp16 fwd {name}", t_half, "qkv fp32", t_fp32, share, "FMA",
                  checks=[("time/fp32's", t_half / t_fp32, "≤", 1.1)] if avx2 else [],
                  held_to="time ≤ 1.1× fp32's" if avx2 else "report only (≤ 1.1× held on AVX2)")


def decode_rows(peaks: Peaks, threads: int, repeats: int):
    """fp32 cache, batch 1, torch SDPA with enable_gqa (the call transformers makes)."""
    for hq, hkv, d, n in ((12, 12, 64, 4096), (12, 12, 64, 32768), (32, 8, 128, 32768), (64, 8, 128, 32768)):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, hq, 1, d, generator=g)
        k = torch.randn(1, hkv, n, d, generator=g)
        v = torch.randn(1, hkv, n, d, generator=g)
        lengths = torch.full((1,), n, dtype=torch.int64)
        t_torch = bd.median_time(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), repeats)
        t_qkv = bd.median_time(lambda: qkv.decode(q, k, v, lengths, threads=threads), repeats)
        share = 2 * n * hkv * d * 4 / t_qkv / 1e9 / peaks.stream  # K and V, fp32, read once
        mha = hq == hkv
        checks = [("speed", t_torch / t_qkv, "≥", 1.1), ("share", share, "≥", 0.8)] if mha else [
            ("share", share, "≥", 0.75)]
        yield Row(f"decode fp32 {hq}/{hkv} d {d} {n // 1024}k keys", t_qkv, "torch fp32", t_torch, share,
                  "stream", checks=checks, held_to="≥ 1.1× torch, ≥ 80% stream" if mha else "≥ 75% stream")
        del k, v


def worker(args) -> int:
    ba.BUILD = bd.BUILD = args.build
    ba.keep_freed_memory()
    torch.set_num_threads(args.threads)
    target = args.worker
    load_start = os.getloadavg()[0]
    peaks = Peaks(args.threads, target)
    repeats = args.repeats or (3 if args.quick else 5)
    forced = "native" if args.native else "forced: QKV_SIMD_TARGET"
    peer = ", ".join(f"{name}={os.environ[name]}" for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                               "QKV_DOT_PRODUCTS") if name in os.environ)
    unit_peak = f"{peaks.unit_peak:.0f} GFLOP/s" if peaks.unit_peak and peaks.unit != "none" else "—"
    fma = "—" if peaks.fma is None else f"{peaks.fma:.1f} GFLOP/s"
    print(f"\n### {cpu_name()} · {target} ({forced}) · {args.threads} thread{'s' * (args.threads > 1)} · "
          f"load {load_start:.2f}\n")
    print(f"torch {torch.__version__} (capability {torch.backends.cpu.get_cpu_capability()}"
          f"{'; ' + peer if peer else ''}), qkv {qkv.__version__}; probed now: FMA peak {fma} "
          f"({peaks.fma_how}), bf16 unit {peaks.unit} ({unit_peak}), streaming read {peaks.stream:.1f} GB/s; "
          f"{'quick, ' if args.quick else ''}median of {repeats} interleaved calls (decode: of up to "
          f"{3 * repeats}); speed = peer ms / qkv ms; error = qkv's max error / torch's against fp64\n")
    print("| workload | qkv ms | peer | peer ms | speed | share of limit | error | held to | result |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    with torch.inference_mode(False):  # the backward rows need autograd
        for row in itertools.chain(fp32_rows(peaks, args.threads, repeats, args.quick),
                                   bf16_rows(peaks, args.threads, repeats, args.quick),
                                   fp16_rows(peaks, args.threads, repeats, args.quick, target),
                                   decode_rows(peaks, args.threads, 3 * repeats)):
            rows.append(row)
            print(row.markdown(), flush=True)
    verdicts = [row.result() for row in rows]
    print(f"\n{sum(v == 'PASS' for v in verdicts)} PASS, {sum(v.startswith('MISS') for v in verdicts)} MISS, "
          f"{sum(v == '—' for v in verdicts)} report only, {sum(v.startswith('?') for v in verdicts)} unjudged; "
          f"load at end {os.getloadavg()[0]:.2f}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="one table per count")
    parser.add_argument("--quick", action="store_true", help="N = 1024, 3 repeats: checks the script in minutes")
    parser.add_argument("--repeats", type=int, default=0, help="timed calls per row (default 5; quick 3)")
    parser.add_argument("--targets", nargs="+", default=None,
                        help="these targets only (default: native and every lower one but the fallbacks)")
    parser.add_argument("--build", default=os.path.join(HERE, "..", "build", "release", "bench"),
                        help="folder of qkv_fma_peak, qkv_dense_probe, qkv_decode_probe")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # the target of one worker
    parser.add_argument("--native", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.build = os.path.abspath(args.build)
    if not os.path.exists(os.path.join(args.build, "qkv_fma_peak")):
        parser.error(f"no qkv_fma_peak in {args.build}: build the probes or pass --build")
    if args.worker:
        if len(args.threads) != 1:
            parser.error("a worker takes one thread count")
        args.threads = args.threads[0]
        return worker(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
