"""No copies: the library reads the caller's memory and writes the returned arrays.

qkv._qkv._debug_last_views() reports, for the last call on this thread, the address,
logical [B, N, H, d] shape and element strides of every view handed to the C++ library,
while recording is on (qkv._qkv._debug_record_views(True): off by default, so ordinary
calls record nothing). A copy anywhere on the way would show up as another address or
other strides."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import qkv
import qkv.torch as qt
from qkv import _qkv


@pytest.fixture(autouse=True)
def record_views():
    _qkv._debug_record_views(True)
    yield
    _qkv._debug_record_views(False)


def test_nothing_is_recorded_unless_asked():
    """The recording is a test hook: off, a call leaves no trace (and costs nothing)."""
    _qkv._debug_record_views(False)
    q = np.zeros((1, 2, 3, 4), np.float32)
    qkv.attention(q, q, q)
    assert _qkv._debug_last_views() == {}


def address(x) -> int:
    return x.data_ptr() if isinstance(x, torch.Tensor) else x.ctypes.data


def logical_strides(x, layout="bhsd"):
    """The element strides of x seen as [B, N, H, d] (what a no-copy view must have)."""
    s = x.stride() if isinstance(x, torch.Tensor) else tuple(n // x.itemsize for n in x.strides)
    return (s[0], s[2], s[1], s[3]) if layout == "bhsd" else tuple(s)


def assert_seen_in_place(name, x, layout="bhsd"):
    seen_address, _, seen_strides = _qkv._debug_last_views()[name]
    assert seen_address == address(x), f"{name} was copied"
    assert seen_strides == logical_strides(x, layout), f"{name} strides changed"


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_contiguous_inputs_are_read_in_place(kind, layout):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((2, 3, 4, 5)).astype(np.float32) for _ in range(3)]
    if kind == "torch":
        arrays = [torch.from_numpy(a) for a in arrays]
    q, k, v = arrays
    out, lse = qkv.attention(q, k, v, layout=layout, return_lse=True)
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        assert_seen_in_place(name, x, layout)
    assert _qkv._debug_last_views()["lse"][0] == address(lse)
    dout = out * 2
    dq, dk, dv = qkv.attention_backward(q, k, v, out, lse, dout, layout=layout)
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("dq", dq),
                    ("dk", dk), ("dv", dv)):
        assert_seen_in_place(name, x, layout)


def test_pytorch_strided_projection_is_read_in_place():
    """q, k, v sliced out of one packed projection, [B, H, N, d] with the strides that
    .view(B, N, 3, H, d).permute(2, 0, 3, 1, 4) gives, through the SDPA drop-in."""
    batch, seq, heads, head_dim = 2, 7, 3, 8
    packed = torch.randn(batch, seq, 3 * heads * head_dim, requires_grad=True)
    q, k, v = packed.view(batch, seq, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
    assert not q.is_contiguous()
    out = qt.scaled_dot_product_attention(q, k, v, is_causal=True)
    for name, x in (("q", q), ("k", k), ("v", v)):
        assert_seen_in_place(name, x)
    out.sum().backward()  # the backward reads the same memory again
    for name, x in (("q", q), ("k", k), ("v", v)):
        assert_seen_in_place(name, x)


def test_numpy_transposed_views_are_read_in_place():
    """A [B, N, H, d] buffer passed as its [B, H, N, d] transpose (and vice versa)."""
    buffer = np.random.default_rng(1).standard_normal((2, 6, 3, 4)).astype(np.float32)
    q = buffer.transpose(0, 2, 1, 3)  # bhsd view of bshd memory
    qkv.attention(q, q, q)
    assert_seen_in_place("q", q)
    seen = _qkv._debug_last_views()["q"]
    assert seen[2] == (72, 12, 4, 1)  # exactly the buffer's own C-order strides


def test_masks_and_key_lengths_are_read_in_place():
    q = torch.randn(2, 3, 4, 5)
    keep = torch.rand(2, 1, 1, 4) > 0.3  # key padding: broadcast, never materialized
    qkv.attention(q, q, q, mask=keep)
    seen_address, seen_shape, _ = _qkv._debug_last_views()["mask.keep"]
    assert seen_address == keep.data_ptr() and seen_shape == (2, 1, 1, 4)
    bias = np.zeros((4, 4), np.float32)
    lengths = np.array([4, 2], np.int64)
    qkv.attention(q.numpy(), q.numpy(), q.numpy(), mask=bias, key_lengths=lengths)
    views = _qkv._debug_last_views()
    assert views["mask.bias"][0] == bias.ctypes.data and views["mask.bias"][1] == (1, 1, 4, 4)
    assert views["key_lengths"][0] == lengths.ctypes.data


def test_sdpa_mask_is_read_in_place():
    q = torch.randn(2, 3, 4, 5)
    mask = torch.randn(2, 1, 4, 4)
    qt.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert _qkv._debug_last_views()["mask.bias"][0] == mask.data_ptr()


def test_the_gil_is_released_while_computing():
    """While one thread is inside a long library call, another runs Python code. With
    the GIL held it could not run at all between the call's start and end."""
    q = np.random.default_rng(2).standard_normal((1, 4, 192, 32))
    lse = None
    out, lse = qkv.attention(q, q, q, return_lse=True)
    window = {}

    def call():
        window["start"] = time.perf_counter()
        # The reference backward builds an Nk×Nk Jacobian per row: ~0.1 s or more here.
        qkv.attention_backward(q, q, q, out, lse, out, backend="reference")
        window["end"] = time.perf_counter()

    worker = threading.Thread(target=call)
    stamps = []
    worker.start()
    while worker.is_alive():
        stamps.append(time.perf_counter())
    worker.join()
    margin = 0.005  # one GIL switch interval on either side of the call
    inside = [t for t in stamps if window["start"] + margin < t < window["end"] - margin]
    assert window["end"] - window["start"] > 4 * margin, "the call was too short to tell"
    assert len(inside) > 100, f"only {len(inside)} Python steps ran during the call"
