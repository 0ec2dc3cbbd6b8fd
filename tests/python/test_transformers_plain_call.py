"""The transformers backend's short path for a plain eager call (issue 42 item 4): no
mask, variant, statistics or gradient — a decode step's usual call — goes to the library
with Options made once per (causal, scale, threads) (qkv._attention.plain_torch_forward)
instead of through qkv.attention's per-call argument handling. It must give the same
bits as the full call, fall back wherever that call does more, raise the same errors,
and leave nothing for nanobind to report at exit.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import qkv  # noqa: E402
import qkv.transformers  # noqa: E402  (registers "qkv")
from qkv import _attention  # noqa: E402


class _Layer(torch.nn.Module):
    is_causal = True


def _full_call(query, key, value, causal, scale, **variants):
    """What the backend made of the call before the short path: qkv.attention."""
    return qkv.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                         layout="bshd", causal=causal, scale=scale,
                         threads=torch.get_num_threads(), **variants)


def _inputs(dtype, q_len, k_len, q_heads=9, kv_heads=3, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, q_heads, q_len, d, generator=g).to(dtype)
    k = torch.randn(2, kv_heads, k_len, d, generator=g).to(dtype)
    v = torch.randn(2, kv_heads, k_len, d, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_len,k_len", [(1, 540), (1, 7), (5, 5), (3, 40)])
def test_plain_calls_take_the_short_path_and_give_the_full_calls_bits(dtype, q_len, k_len):
    q, k, v = _inputs(dtype, q_len, k_len)
    _attention._PLAIN_OPTIONS.clear()
    with torch.no_grad():
        out, weights = qkv.transformers.attention_forward(_Layer(), q, k, v, None, scaling=0.125)
    assert weights is None and out.dtype == dtype and out.shape == (2, q_len, 9, 64)
    # No mask and several queries: transformers left the causal mask out (top-left).
    causal = "top_left" if q_len > 1 else None
    assert list(_attention._PLAIN_OPTIONS) == [(causal, 0.125, torch.get_num_threads())]
    expected = _full_call(q, k, v, causal, 0.125)
    assert torch.equal(out, expected)
    if q_len > 1:  # the causal mask really applied: not the bidirectional result
        assert not torch.equal(out, _full_call(q, k, v, None, 0.125))


def test_options_follow_the_thread_count_and_stay_few():
    q, k, v = _inputs(torch.float32, 1, 64)
    before = torch.get_num_threads()
    _attention._PLAIN_OPTIONS.clear()
    try:
        with torch.no_grad():
            for threads in (1, 2, 1):
                torch.set_num_threads(threads)
                out, _ = qkv.transformers.attention_forward(_Layer(), q, k, v, None, scaling=0.125)
                assert torch.equal(out, _full_call(q, k, v, None, 0.125))
            assert sorted(key[2] for key in _attention._PLAIN_OPTIONS) == [1, 2]
            for i in range(200):  # every scale a new entry: the dict is cleared, never grows past 64
                qkv.transformers.attention_forward(_Layer(), q, k, v, None, scaling=0.01 + i / 1000)
            assert 0 < len(_attention._PLAIN_OPTIONS) <= 64
    finally:
        torch.set_num_threads(before)


def test_calls_that_need_more_take_the_full_path():
    q, k, v = _inputs(torch.float32, 1, 32)
    layer = _Layer()

    def short_path_used(*args, **kwargs):
        _attention._PLAIN_OPTIONS.clear()
        qkv.transformers.attention_forward(layer, *args, **kwargs)
        return bool(_attention._PLAIN_OPTIONS)

    with torch.no_grad():
        assert short_path_used(q, k, v, None, scaling=0.125)
        assert not short_path_used(q.double(), k.double(), v.double(), None, scaling=0.125)
        assert not short_path_used(q, k, v, None, scaling=0.125, softcap=30.0)
        mask = torch.ones(2, 1, 1, 32, dtype=torch.bool)
        mask[1, ..., 20:] = False  # padding: key lengths, not a plain call
        assert not short_path_used(q, k, v, mask, scaling=0.125)
    # Gradients wanted: autograd's path, and the gradients are qkv's.
    q_grad = q.clone().requires_grad_()
    assert not short_path_used(q_grad, k, v, None, scaling=0.125)
    out, _ = qkv.transformers.attention_forward(layer, q_grad, k, v, None, scaling=0.125)
    out.sum().backward()
    reference = q.clone().requires_grad_()
    _full_call(reference, k, v, None, 0.125).sum().backward()
    assert q_grad.grad is not None and torch.equal(q_grad.grad, reference.grad)


def test_bad_inputs_get_the_full_calls_error():
    q, k, v = _inputs(torch.float32, 1, 32)
    cases = [
        (q, k[..., :48], v),              # head dims differ
        (q, k, v[:, :, :31]),             # keys and values differ in count
        (q[:, :8], k, v),                 # 8 query heads over 3 kv heads
    ]
    for case in cases:
        with pytest.raises(qkv.Error) as full:
            _full_call(*case, None, 0.125)
        with torch.no_grad(), pytest.raises(qkv.Error) as short:
            qkv.transformers.attention_forward(_Layer(), *case, None, scaling=0.125)
        assert str(short.value) == str(full.value)
    with torch.no_grad(), pytest.raises(qkv.Error, match="scale"):
        qkv.transformers.attention_forward(_Layer(), q, k, v, None, scaling=float("nan"))


def test_nothing_reported_leaked_at_exit():
    script = (
        "import torch, qkv, qkv.transformers\n"
        "q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)\n"
        "class L(torch.nn.Module): is_causal = True\n"
        "with torch.no_grad():\n"
        "    out, _ = qkv.transformers.attention_forward(L(), q, k, v, None, scaling=0.25)\n"
        "from qkv import _attention\n"
        "assert _attention._PLAIN_OPTIONS, 'the short path was not taken'\n"
        "print('ok', out.shape)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "ok" in done.stdout
    assert "leaked" not in done.stderr, done.stderr
