"""QKV_SIMD_TARGET: the kernels run on the SIMD target it names (for measuring a lower
target on a newer CPU), and a name the build or CPU lacks is a clear error.

Each case runs in a fresh interpreter: the variable is read once per process."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

SCRIPT = r"""
import json, sys
import numpy as np
import qkv
rng = np.random.default_rng(3)
# [B, H, N, d]: 70 queries (the tiled kernel), then 1 query (the decode kernel).
q, k, v = (rng.standard_normal((2, 3, 70, 64)).astype(np.float32) for _ in range(3))
try:
    out = qkv.attention(q, k, v, causal="top_left")
    step = qkv.attention(q[:, :, :1], k, v)
except Exception as error:
    print(json.dumps({"error": f"{type(error).__name__}: {error}"}))
    sys.exit(0)
wide = [x.astype(np.float64) for x in (q, k, v)]
ref = qkv.attention(*wide, causal="top_left")
ref_step = qkv.attention(wide[0][:, :, :1], wide[1], wide[2])
print(json.dumps({"out": out.ravel()[:8].tolist() + step.ravel()[:8].tolist(),
                  "err": max(float(np.abs(out - ref).max()), float(np.abs(step - ref_step).max()))}))
"""


def run_with(target):
    env = dict(os.environ)
    env.pop("QKV_SIMD_TARGET", None)
    if target is not None:
        env["QKV_SIMD_TARGET"] = target
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_unknown_target_is_a_clear_error():
    result = run_with("NOT_A_TARGET")
    assert "error" in result
    assert "QKV_SIMD_TARGET=NOT_A_TARGET" in result["error"]
    assert "choose one of" in result["error"]


@pytest.mark.parametrize("target", ["AVX2", "avx2"])
def test_the_portable_target_can_be_forced_and_stays_within_the_contract(target):
    # AVX2: every x86 build compiles it; CPUs without it (none in this project) skip.
    forced = run_with(target)
    if "error" in forced and "choose one of" in forced["error"]:
        pytest.skip(forced["error"])
    best = run_with(None)
    assert "error" not in forced, forced
    # fp32 against fp64 at d = 64, N = 70: the fused kernels' usual bound.
    assert forced["err"] < 2e-6
    assert best["err"] < 2e-6
    np.testing.assert_allclose(forced["out"], best["out"], rtol=0, atol=2e-6)
