#!/usr/bin/env python3
"""End-to-end checks of the `qkv` program against NumPy.

    numpy_check.py run QKV WORKDIR           NumPy writes q, k, v (and masks, dout); `qkv run`
                                             computes; NumPy loads the outputs and compares
                                             them with its own float64 attention and gradients.
    numpy_check.py explain_json QKV WORKDIR  `qkv explain --json` is valid JSON with the
                                             promised fields and values.

Exits 77 (ctest: skipped) when NumPy is not installed.
"""
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import numpy as np
except ImportError:
    print("numpy is not installed: skipped")
    sys.exit(77)

# The fp32 kernels sum d- and Nk-long products of O(1) numbers: their error against a
# float64 computation is a few units of 2^-24·(d + Nk) ≈ 1e-6 here; 2e-5 leaves margin
# and still catches any wrong index, mask or scale (errors of O(0.1)).
TOLERANCE = 2e-5


def attention(q, k, v, dout, scale, keep, bias, causal):
    """float64 attention in [B, S, H, D] layout, forward and backward, with GQA."""
    q, k, v, dout = (x.astype(np.float64) for x in (q, k, v, dout))
    B, Nq, Hq, d = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    kh = np.repeat(k, group, axis=2)  # [B, Nk, Hq, d]
    vh = np.repeat(v, group, axis=2)
    s = scale * np.einsum("bihc,bjhc->bhij", q, kh)
    if bias is not None:
        s = s + bias.astype(np.float64)
    allowed = np.ones((B, Hq, Nq, Nk), bool)
    if keep is not None:
        allowed &= np.broadcast_to(keep.astype(bool), allowed.shape)
    i = np.arange(Nq)[:, None]
    j = np.arange(Nk)[None, :]
    if causal == "top_left":
        allowed &= j <= i
    elif causal == "bottom_right":
        allowed &= j <= i + (Nk - Nq)
    s = np.where(allowed, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    p = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
    lse = np.where(total[..., 0] > 0, m[..., 0] + np.log(np.where(total[..., 0] > 0, total[..., 0], 1.0)), -np.inf)
    out = np.einsum("bhij,bjhc->bihc", p, vh)
    # Backward: dP = dO·Vᵀ, dS = P ⊙ (dP − rowsum(P ⊙ dP)), dQ = scale·dS·K, dK = scale·dSᵀ·Q, dV = Pᵀ·dO.
    dp = np.einsum("bihc,bjhc->bhij", dout, vh)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    dq = scale * np.einsum("bhij,bjhc->bihc", ds, kh)
    dkh = scale * np.einsum("bhij,bihc->bjhc", ds, q)
    dvh = np.einsum("bhij,bihc->bjhc", p, dout)
    dk = dkh.reshape(B, Nk, Hkv, group, d).sum(axis=3)
    dv = dvh.reshape(B, Nk, Hkv, group, -1).sum(axis=3)
    return out, lse, p, dq, dk, dv


def run(qkv, *args):
    result = subprocess.run([qkv, *map(str, args)], capture_output=True, text=True)
    return result.returncode, result.stdout, result.stderr


def compare(name, got, want):
    assert got.dtype == np.float32, f"{name}: dtype {got.dtype}"
    assert got.flags.c_contiguous, f"{name}: not C order"
    assert got.shape == want.shape, f"{name}: shape {got.shape}, NumPy's {want.shape}"
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite), f"{name}: non-finite entries differ"
    assert np.array_equal(got[~finite], want[~finite]), f"{name}: infinities differ"
    error = float(np.max(np.abs(got[finite] - want[finite]), initial=0.0))
    assert error <= TOLERANCE, f"{name}: max |qkv - numpy| = {error:.3g} > {TOLERANCE}"
    print(f"  {name:8s} {str(got.shape):18s} max |qkv - numpy| = {error:.2e}")


def check_run(qkv, work):
    rng = np.random.default_rng(7)
    B, Nq, Nk, Hq, Hkv, d, dv = 2, 5, 9, 4, 2, 16, 12
    cases = [
        # layout, causal, mask kind, scale, --weights (which needs the reference backend;
        # without it the forward runs on the fastest backend)
        ("bshd", "none", None, None, True),
        ("bshd", "bottom_right", "bool", None, False),
        ("bhsd", "top_left", "bias", 0.25, True),
        ("bhsd", "none", "uint8", 1.0, False),
    ]
    for layout, causal, mask_kind, scale, with_weights in cases:
        print(f"case: layout {layout}, causal {causal}, mask {mask_kind}, scale {scale}")
        q = rng.standard_normal((B, Nq, Hq, d), dtype=np.float32)
        k = rng.standard_normal((B, Nk, Hkv, d), dtype=np.float32)
        v = rng.standard_normal((B, Nk, Hkv, dv), dtype=np.float32)
        dout = rng.standard_normal((B, Nq, Hq, dv), dtype=np.float32)
        files = {"q": q, "k": k, "v": v, "dout": dout}
        if layout == "bhsd":  # PyTorch's [B, H, S, D], written as such by NumPy
            files = {name: np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for name, x in files.items()}
        for name, x in files.items():
            np.save(work / f"{name}.npy", x)
        keep = bias = None
        args = []
        if mask_kind == "bool":  # key padding [B, 1, 1, Nk]: the second batch entry drops 3 keys
            keep = np.ones((B, 1, 1, Nk), bool)
            keep[1, ..., -3:] = False
            np.save(work / "mask.npy", keep)
        elif mask_kind == "uint8":  # [Nq, Nk], broadcast over batch and heads
            keep = (rng.random((Nq, Nk)) < 0.7).astype(np.uint8)
            keep[:, 0] = 1
            np.save(work / "mask.npy", keep)
        elif mask_kind == "bias":  # [Hq, Nq, Nk] additive, with -inf entries
            bias = rng.standard_normal((Hq, Nq, Nk)).astype(np.float32)
            bias[:, :, 1] = -np.inf
            np.save(work / "mask.npy", bias)
        if mask_kind:
            args += ["--mask", work / "mask.npy"]
        if scale is not None:
            args += ["--scale", repr(scale)]
        outputs = ["out", "lse", "weights", "dq", "dk", "dv"]
        for name in outputs:
            (work / f"{name}.npy").unlink(missing_ok=True)
        if with_weights:
            args += ["--weights", work / "weights.npy"]
        code, stdout, stderr = run(
            qkv, "run", "--layout", layout, "--causal", causal, "--q", work / "q.npy", "--k", work / "k.npy",
            "--v", work / "v.npy", "-o", work / "out.npy", "--lse", work / "lse.npy",
            "--grad", work / "dout.npy", "--dq", work / "dq.npy",
            "--dk", work / "dk.npy", "--dv", work / "dv.npy", *args)
        assert code == 0, f"qkv run failed ({code}): {stderr}"
        want = attention(q, k, v, dout, 1 / math.sqrt(d) if scale is None else scale,
                         keep if keep is None or keep.ndim == 4 else keep.reshape(1, 1, Nq, Nk),
                         bias, causal)
        assert (work / "weights.npy").exists() == with_weights
        got = {name: np.load(work / f"{name}.npy") for name in outputs if (work / f"{name}.npy").exists()}
        if layout == "bhsd":  # outputs come back in the inputs' layout
            for name in ("out", "dq", "dk", "dv"):
                got[name] = np.ascontiguousarray(got[name].transpose(0, 2, 1, 3))
        for name, reference in zip(outputs, want):
            if name in got:
                compare(name, got[name], reference.astype(np.float32))

    # 3-D inputs [seq, heads, dim] give 3-D outputs; lse is [heads, Nq].
    q3 = rng.standard_normal((Nq, Hq, d), dtype=np.float32)
    k3 = rng.standard_normal((Nk, Hq, d), dtype=np.float32)
    v3 = rng.standard_normal((Nk, Hq, dv), dtype=np.float32)
    for name, x in (("q", q3), ("k", k3), ("v", v3)):
        np.save(work / f"{name}.npy", x)
    code, _, stderr = run(qkv, "run", "--q", work / "q.npy", "--k", work / "k.npy", "--v", work / "v.npy",
                          "-o", work / "out.npy", "--lse", work / "lse.npy")
    assert code == 0, stderr
    zero = np.zeros((1, Nq, Hq, dv), np.float32)
    out, lse, *_ = attention(q3[None], k3[None], v3[None], zero, 1 / math.sqrt(d), None, None, "none")
    print("case: 3-D inputs")
    compare("out", np.load(work / "out.npy"), out[0].astype(np.float32))
    compare("lse", np.load(work / "lse.npy"), lse[0].astype(np.float32))

    # A float64 input is refused, naming the file, and nothing is written.
    np.save(work / "q64.npy", q3.astype(np.float64))
    (work / "out.npy").unlink()
    code, _, stderr = run(qkv, "run", "--q", work / "q64.npy", "--k", work / "k.npy", "--v", work / "v.npy",
                          "-o", work / "out.npy")
    assert code == 1 and "q64.npy" in stderr and "float32" in stderr, stderr
    assert not (work / "out.npy").exists()
    print("float64 input refused:", stderr.strip())


def check_explain_json(qkv, work):
    code, stdout, stderr = run(qkv, "explain", "--json", "--samples", "256", "--keys", "16", "--dims", "4,64")
    assert code == 0, stderr
    data = json.loads(stdout)
    assert data["samples"] == 256 and data["keys"] == 16 and data["dims"] == [4, 64]
    for row in data["variance"]:
        se = row["relative_std_error"]
        assert abs(se - math.sqrt((2 + 6 / row["d"]) / 256)) < 1e-12
        # 5 standard errors: a correct program fails this with probability < 1e-6.
        assert abs(row["unscaled"] / row["d"] - 1) < 5 * se, row
        assert abs(row["scaled"] - 1) < 5 * se, row
    for row in data["rows"]:
        for scaling in ("unscaled", "scaled"):
            stats = row[scaling]
            for name in ("max_weight", "entropy", "jacobian_norm", "grad_norm", "query_grad_norm", "dead"):
                assert set(stats[name]) == {"mean", "std_error", "median"}, name
            assert 1 / 16 <= stats["max_weight"]["mean"] <= 1
    huge = data["softmax"][0]
    assert huge["x"] == [1, 2, 3, 1e6] and huge["s"] == [0, 0, 0, 1]
    assert huge["jacobian"] == [[0] * 4] * 4 and huge["attention_lse"] == 1e6
    moderate = np.array(data["softmax"][1]["s"])
    x = np.array([1.0, 2, 3, 4])
    assert np.allclose(moderate, np.exp(x - 4) / np.exp(x - 4).sum(), rtol=1e-15, atol=0)
    jac = np.array(data["softmax"][1]["jacobian"])
    assert np.allclose(jac, np.diag(moderate) - np.outer(moderate, moderate), rtol=0, atol=1e-16)
    print("explain --json: valid, consistent with NumPy")


def main():
    check, qkv, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    {"run": check_run, "explain_json": check_explain_json}[check](qkv, work)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
