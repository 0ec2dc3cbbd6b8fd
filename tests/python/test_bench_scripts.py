"""Every bench/*.py script imports: its module-level imports name things that exist (a
helper removed from bench/bench_timing.py once left three benchmarks failing at their first
line, unnoticed until they were next run). One fresh interpreter imports them all, from
bench/ as the scripts run; main() is not called (the scripts guard it)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


def test_every_bench_script_imports():
    scripts = sorted(p.stem for p in BENCH.glob("*.py"))
    assert len(scripts) > 20  # the folder was found
    code = ("import importlib, sys\nfailed = []\nfor name in sys.argv[1:]:\n    try:\n"
            "        importlib.import_module(name)\n    except Exception as error:\n"
            "        failed.append(f'{name}: {type(error).__name__}: {error}')\n"
            "print('\\n'.join(failed))\nsys.exit(1 if failed else 0)\n")
    result = subprocess.run([sys.executable, "-c", code, *scripts], cwd=BENCH, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
