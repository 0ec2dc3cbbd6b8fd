"""The one bound options object (qkv._qkv.Options) a call hands to the library, its
enums named by the library's one name table (shared with the `qkv` command line), and
the OpenMP wait policy qkv chooses when it is imported."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import qkv
import qkv.torch as qt
from qkv import _qkv


def test_enums_carry_the_name_tables_printed_names():
    assert [m.name for m in _qkv.Causal] == ["none", "top_left", "bottom_right"]
    assert [m.name for m in _qkv.Backend] == ["auto", "reference", "cpu"]


def test_options_defaults_and_fields():
    o = _qkv.Options()
    assert (o.causal, o.backend, o.scale, o.threads, o.check_finite) == (
        _qkv.Causal.none, _qkv.Backend.auto, None, 0, False)
    assert (o.causal_name, o.backend_name) == ("none", "auto")
    assert (o.keep, o.bias, o.key_lengths, o.alibi_slopes, o.sinks) == (None,) * 5
    assert o.window == (-1, -1) and o.softcap == 0.0 and o.dropout_p == 0.0 and o.seed == 0
    assert not o.has_variants()
    o = _qkv.Options("f", "bottom_right", 0.5, "reference", 3, True)
    assert (o.causal, o.backend, o.scale, o.threads, o.check_finite) == (
        _qkv.Causal.bottom_right, _qkv.Backend.reference, 0.5, 3, True)
    # The enums themselves are accepted too, and None threads means 0 (all threads).
    o = _qkv.Options("f", _qkv.Causal.top_left, None, _qkv.Backend.cpu, None)
    assert (o.causal_name, o.backend_name, o.threads) == ("top_left", "cpu", 0)


def test_options_are_immutable_and_replace_copies():
    sinks = np.zeros(2, np.float32)
    o = _qkv.Options("f", "top_left")
    with pytest.raises(AttributeError):
        o.threads = 3
    changed = o.replace(threads=4, sinks=sinks, window=(2, 0))
    assert (o.threads, o.sinks, o.window) == (0, None, (-1, -1))
    assert changed.threads == 4 and changed.sinks is sinks and changed.window == (2, 0)
    assert changed.causal_name == "top_left" and changed.has_variants()
    assert changed.replace(sinks=None, window=(-1, -1)).has_variants() is False
    with pytest.raises(TypeError, match="unexpected option 'colour'"):
        o.replace(colour="red")


@pytest.mark.parametrize("causal", ["top_left", _qkv.Causal.top_left])
def test_a_call_takes_names_or_enums_alike(causal):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 5, 4)).astype(np.float32) for _ in range(3))
    assert np.array_equal(qkv.attention(q, k, v, causal=causal),
                          qkv.attention(q, k, v, causal="top_left"))
    assert np.array_equal(qkv.attention(q, k, v, backend=_qkv.Backend.reference),
                          qkv.attention(q, k, v, backend="reference"))


def test_scalar_types_are_checked_once_in_cpp():
    """The Python layer passes causal, scale, backend and threads through untouched; the
    binding refuses wrong types (TypeError) and unknown names (qkv.Error) by name."""
    q = np.zeros((1, 1, 2, 4), np.float32)
    with pytest.raises(TypeError, match=r"^qkv\.attention: scale: expected None or a number, got '1'$"):
        qkv.attention(q, q, q, scale="1")
    with pytest.raises(TypeError, match=r"^qkv\.attention: threads: expected None or an int, got True$"):
        qkv.attention(q, q, q, threads=True)
    with pytest.raises(qkv.Error, match=r"^qkv\.attention: backend: expected one of"):
        qkv.attention(q, q, q, backend="automatically")
    # NumPy scalars are numbers.
    qkv.attention(q, q, q, scale=np.float32(0.5), threads=np.int64(1))


def test_torch_tensors_on_another_device_are_refused_by_name():
    q = torch.zeros(1, 1, 2, 4, device="meta")
    with pytest.raises(TypeError, match=r"q: expected an array in CPU memory"):
        qkv.attention(q, q, q)


def test_sdpa_fast_and_general_paths_agree():
    """[B, H, L, E] inputs skip the reshaping; 3-D and broadcast inputs take the general
    path; both give what PyTorch gives."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g) for _ in range(3))
    for args in ((q, k, v), (q[0], k[0], v[0]), (q, k[:1], v[:1]), (q[:, :1], k, v)):
        expected = torch.nn.functional.scaled_dot_product_attention(*args)
        torch.testing.assert_close(qt.scaled_dot_product_attention(*args), expected,
                                   rtol=1e-5, atol=1e-6)


def _import_decision(code: str, **env) -> str:
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    environment.update(env)
    result = subprocess.run([sys.executable, "-c", code], env=environment, check=True,
                            capture_output=True, text=True)
    return result.stdout.strip()


def test_workers_wait_passively_when_qkv_loads_libgomp():
    """qkv chooses the passive OpenMP wait policy for the moment it loads libgomp, and
    leaves no variable behind for child processes."""
    report = "import os, qkv; print(qkv._threads.decision, os.environ.get('OMP_WAIT_POLICY'))"
    assert _import_decision(report) == "passive None"
    # The user's choice wins ...
    assert _import_decision(report, OMP_WAIT_POLICY="active") == "environment active"
    assert _import_decision(report, GOMP_SPINCOUNT="1000") == "environment None"
    # ... and a libgomp loaded before qkv (torch's) keeps the policy it was loaded with.
    torch_first = "import torch, os, qkv; print(qkv._threads.decision, os.environ.get('OMP_WAIT_POLICY'))"
    assert _import_decision(torch_first) == "already loaded None"


def test_small_decode_calls_know_whether_idle_workers_spin():
    """qkv tells its library whether libgomp's idle workers spin (they then start a region
    at once, and a small decode call takes a second thread from 128 KiB of cache instead of
    1 MiB: qkv/threads.hpp), from the policy libgomp was loaded with."""
    report = "import qkv; print(qkv._qkv.idle_workers_spin())"
    torch_first = "import torch, qkv; print(qkv._qkv.idle_workers_spin())"
    assert _import_decision(report) == "False"  # qkv chose passive
    assert _import_decision(torch_first) == "True"  # libgomp's default: spin 300 000 times
    assert _import_decision(torch_first, OMP_WAIT_POLICY="passive") == "False"
    assert _import_decision(report, OMP_WAIT_POLICY="ACTIVE") == "True"
    assert _import_decision(report, GOMP_SPINCOUNT="1000") == "False"
    assert _import_decision(report, OMP_WAIT_POLICY="passive", GOMP_SPINCOUNT="300k") == "True"
    assert _import_decision(report, GOMP_SPINCOUNT="infinite") == "True"
    assert _import_decision(torch_first, GOMP_SPINCOUNT="lots") == "True"  # ignored, as libgomp does
    assert _import_decision(torch_first, OMP_WAIT_POLICY="passive", GOMP_SPINCOUNT="lots") == "False"
