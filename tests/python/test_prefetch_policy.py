"""QKV_PREFETCH (src/cpu/prefetch_policy.hpp): whether the forward requests the next key
block's K and V ahead is a speed choice only. Forced on and off (each in its own process:
the variable is read once), the forward gives the same bits, in float32, bfloat16 and
float16, on [B, H, N, d] and [B, N, H, d] rows with d + dv >= 256 (where the request is
made), on the native SIMD target and AVX2 forced through Highway, with the bf16 dot
products on (where the CPU has them) and off; another word is a qkv.Error naming the
variable and the words it takes."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

DIGEST = """
import hashlib, torch, qkv
torch.manual_seed(0)
digest = hashlib.sha256()
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for layout in ("bhsd", "bshd"):
        shape = (1, 3, 200, 128) if layout == "bhsd" else (1, 200, 3, 128)
        q, k, v = (torch.randn(shape).to(dtype) for _ in range(3))
        for causal in (None, "top_left"):
            out = qkv.attention(q, k, v, layout=layout, causal=causal)
            digest.update(out.float().numpy().tobytes())
print(digest.hexdigest())
"""


def run_with(word, script=DIGEST, **paths):
    env = dict(os.environ, QKV_PREFETCH=word, **paths)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)


def cpu_has(flag):
    with open("/proc/cpuinfo") as cpuinfo:
        return f" {flag}" in cpuinfo.read()


PATHS = {
    "native": {},
    "avx2_forced": {"QKV_SIMD_TARGET": "AVX2"},
    "dot_products_off": {"QKV_DOT_PRODUCTS": "off"},
    "vdpbf16ps": {"QKV_DOT_PRODUCTS": "on", "QKV_AMX": "off"},
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_prefetching_changes_no_bit(path):
    if path == "avx2_forced" and not (cpu_has("avx2") and cpu_has("fma")):
        pytest.skip("no AVX2 on this CPU")
    if path == "vdpbf16ps" and not cpu_has("avx512_bf16"):
        pytest.skip("no AVX512-BF16 on this CPU")
    digests = {}
    for word in ("on", "off", "auto"):
        run = run_with(word, **PATHS[path])
        assert run.returncode == 0, run.stderr
        digests[word] = run.stdout.strip()
    assert len(digests["on"]) == 64
    assert digests["on"] == digests["off"] == digests["auto"]


@pytest.mark.parametrize("word", ["sometimes", "1"])
def test_another_word_is_an_error_naming_the_variable(word):
    run = run_with(word, "import torch, qkv\nqkv.attention(*(torch.randn(1, 1, 70, 128) for _ in range(3)))")
    assert run.returncode != 0
    assert f"QKV_PREFETCH={word}: expected auto, on or off" in run.stderr
