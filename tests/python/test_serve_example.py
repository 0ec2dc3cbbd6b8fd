"""examples/serve_step.py runs: continuous batching over paged caches with qkv.BatchPlan,
every step checked inside against per-sequence attention (it exits non-zero past 1e-5)."""

import os
import subprocess
import sys

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "serve_step.py")


def test_serve_step_example_matches_per_sequence_attention():
    done = subprocess.run([sys.executable, EXAMPLE, "--steps", "6", "--layers", "2"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every step matched per-sequence attention" in done.stdout
    assert done.stdout.count("step ") >= 6
