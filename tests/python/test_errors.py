"""Every bad call raises TypeError or ValueError (qkv.Error) with a message naming the
argument, the expected and the actual value; the library's own checks come through with
the C++ message unchanged. Nothing crashes, and shapes PyTorch rejects we reject."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import qkv
import qkv.torch as qt


def arrays(*shapes, dtype=np.float32):
    return [np.zeros(s, dtype) for s in shapes]


Q, K, V = arrays((2, 4, 5, 8), (2, 2, 6, 8), (2, 2, 6, 3))

# (id, call, exception type, message regex). Messages starting "qkv::" are the C++
# library's, unchanged.
CASES = [
    ("batch mismatch", lambda: qkv.attention(Q, K[:1], V), ValueError,
     r"^qkv::attention_forward: k\.shape\[0\] \(batch\): expected 2 \(as q\.shape\[0\]\), got 1$"),
    ("head dim mismatch", lambda: qkv.attention(Q, K[..., :7], V), ValueError,
     r"qkv::attention_forward: k\.shape\[3\] \(head_dim\): expected 8 \(as q\.shape\[3\]\), got 7"),
    ("k/v seq mismatch", lambda: qkv.attention(Q, K, V[:, :, :5]), ValueError,
     r"qkv::attention_forward: v\.shape\[1\] \(seq\): expected 6 \(as k\.shape\[1\]\), got 5"),
    ("heads not a multiple", lambda: qkv.attention(Q[:, :3], K, V), ValueError,
     r"q\.shape\[2\] \(heads\): expected a multiple of k\.shape\[2\] \(key/value heads\) = 2"),
    ("k/v heads mismatch", lambda: qkv.attention(Q, K, V[:, :1]), ValueError,
     r"v\.shape\[2\] \(heads\): expected 2 \(as k\.shape\[2\]\), got 1"),
    ("3-D input", lambda: qkv.attention(Q[0], K, V), ValueError,
     r"qkv\.attention: q: expected 4 dimensions \[batch, heads, seq, dim\] \(layout='bhsd'\), "
     r"got shape \(4, 5, 8\)"),
    ("dtype mismatch", lambda: qkv.attention(Q, K.astype(np.float64), V), TypeError,
     r"k: expected dtype float32 \(the dtype of q\), got float64"),
    ("integer inputs", lambda: qkv.attention(*(x.astype(np.int64) for x in (Q, K, V))),
     TypeError, r"q: expected dtype float32, float64, bfloat16 or float16, got int64"),
    ("float16 with float32", lambda: qkv.attention(Q.astype(np.float16), K, V.astype(np.float16)),
     TypeError, r"k: expected dtype float16 \(the dtype of q\), got float32"),
    ("list input", lambda: qkv.attention([[1.0]], K, V), TypeError,
     r"qkv\.attention: q: expected a numpy\.ndarray or a torch\.Tensor, got builtins\.list"),
    ("numpy and torch mixed", lambda: qkv.attention(Q, torch.from_numpy(K), V), TypeError,
     r"every array must be of one type \(q is numpy, k is torch, v is numpy\)"),
    ("bad layout", lambda: qkv.attention(Q, K, V, layout="nhwc"), ValueError,
     r"layout: expected 'bhsd' or 'bshd', got 'nhwc'"),
    ("bad causal", lambda: qkv.attention(Q, K, V, causal="lower"), ValueError,
     r"causal: expected None, 'top_left' or 'bottom_right', got 'lower'"),
    ("causal not a string", lambda: qkv.attention(Q, K, V, causal=True), TypeError,
     r"causal: expected None, 'top_left' or 'bottom_right', got bool True"),
    ("bad backend", lambda: qkv.attention(Q, K, V, backend="gpu"), ValueError,
     r"backend: expected one of \('auto', 'reference', 'cpu'\), got 'gpu'"),
    ("negative threads", lambda: qkv.attention(Q, K, V, threads=-1), ValueError,
     r"qkv::attention_forward: options\.execution\.threads: expected >= 0"),
    ("threads not an int", lambda: qkv.attention(Q, K, V, threads=1.5), TypeError,
     r"threads: expected None or an int, got 1\.5"),
    ("zero scale", lambda: qkv.attention(Q, K, V, scale=0.0), ValueError,
     r"qkv::attention_forward: options\.scale: expected a finite value > 0, got 0"),
    ("nan scale", lambda: qkv.attention(Q, K, V, scale=float("nan")), ValueError,
     r"options\.scale: expected a finite value > 0, got nan"),
    ("scale not a number", lambda: qkv.attention(Q, K, V, scale="1"), TypeError,
     r"scale: expected None or a number"),
    ("mask wrong keys", lambda: qkv.attention(Q, K, V, mask=np.ones((5, 5), bool)), ValueError,
     r"mask\.keep\.shape\[3\] \(keys\): expected 6 \(k\.shape\[1\]\), got 5"),
    ("mask wrong batch", lambda: qkv.attention(Q, K, V, mask=np.zeros((3, 1, 5, 6), np.float32)),
     ValueError, r"mask\.bias\.shape\[0\] \(batch\): expected 2 \(q\.shape\[0\]\) or 1 to broadcast"),
    ("mask 5-D", lambda: qkv.attention(Q, K, V, mask=np.ones((1, 2, 4, 5, 6), bool)),
     ValueError, r"mask: expected 1 to 4 dimensions"),
    ("mask int dtype", lambda: qkv.attention(Q, K, V, mask=np.ones((5, 6), np.int32)),
     TypeError, r"mask: expected dtype bool or uint8 \(True = attend\) or float32, float64, "
                r"float16 or bfloat16"),
    ("mask other type", lambda: qkv.attention(Q, K, V, mask=torch.ones(5, 6)), TypeError,
     r"every array must be of one type"),
    ("key_lengths too few", lambda: qkv.attention(Q, K, V, key_lengths=[6]), ValueError,
     r"options\.key_lengths: expected one length per batch entry \(2\), got 1"),
    ("key_lengths too long", lambda: qkv.attention(Q, K, V, key_lengths=[6, 7]), ValueError,
     r"options\.key_lengths\[1\]: expected 0\.\.6 \(the key length\), got 7"),
    ("key_lengths negative", lambda: qkv.attention(Q, K, V, key_lengths=[-1, 2]), ValueError,
     r"options\.key_lengths\[0\]: expected 0\.\.6"),
    ("key_lengths floats", lambda: qkv.attention(Q, K, V, key_lengths=[1.5, 2]), TypeError,
     r"key_lengths: expected integers"),
    ("negative strides", lambda: qkv.attention(Q[:, :, ::-1], K, V), ValueError,
     r"q\.strides\[1\]: expected >= 0, got -8"),
    ("strided last axis", lambda: qkv.attention(np.zeros((2, 4, 5, 16), np.float32)[..., ::2],
                                                K, V), ValueError,
     r"q\.strides\[3\]: expected 1 \(the innermost dimension must be contiguous\), got 2"),
    ("cpu backend on float64", lambda: qkv.attention(*(x.astype(np.float64) for x in (Q, K, V)),
                                                     backend="cpu"), ValueError,
     r"options\.execution\.backend: cpu computes in float; double inputs need"),
    ("backward without a matching lse",
     lambda: qkv.attention_backward(Q, K, V, np.zeros((2, 4, 5, 3), np.float32),
                                    np.zeros((2, 4, 4), np.float32),
                                    np.zeros((2, 4, 5, 3), np.float32)), ValueError,
     r"qkv::attention_backward: lse\.shape\[2\] \(seq\): expected 5 \(as q\.shape\[1\]\), got 4"),
    ("backward dout shape",
     lambda: qkv.attention_backward(Q, K, V, np.zeros((2, 4, 5, 3), np.float32),
                                    np.zeros((2, 4, 5), np.float32),
                                    np.zeros((2, 4, 5, 2), np.float32)), ValueError,
     r"dout\.shape\[3\] \(head_dim\): expected 3 \(as out\.shape\[3\]\), got 2"),
    ("backward lse rank",
     lambda: qkv.attention_backward(Q, K, V, np.zeros((2, 4, 5, 3), np.float32),
                                    np.zeros((2, 4, 5, 1), np.float32),
                                    np.zeros((2, 4, 5, 3), np.float32)), ValueError,
     r"lse: expected 3 dimensions, got 4"),
    ("weights with bad mask", lambda: qkv.attention_weights(Q, K, V, mask=np.ones(7, bool)),
     ValueError, r"mask\.keep\.shape\[3\] \(keys\): expected 6"),
    ("no heads", lambda: qkv.attention(Q[:, :0], K, V), ValueError,
     r"q\.shape\[2\] \(heads\): expected >= 1, got 0"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_calls_raise_with_a_clear_message(case):
    _, call, error, pattern = case
    with pytest.raises(error) as info:
        call()
    assert re.search(pattern, str(info.value)), str(info.value)


def test_library_errors_are_qkv_error_a_value_error():
    with pytest.raises(qkv.Error) as info:
        qkv.attention(Q, K[:1], V)
    assert isinstance(info.value, ValueError) and type(info.value).__module__ == "qkv"


def test_nothing_is_written_when_a_call_fails():
    """The backward's outputs are fresh arrays; a failing forward must also leave the
    process healthy: the next good call works and gives the same answer as before."""
    q, k, v = (np.random.default_rng(5).standard_normal(s).astype(np.float32)
               for s in ((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4)))
    before = qkv.attention(q, k, v)
    for _ in range(3):
        with pytest.raises(ValueError):
            qkv.attention(q, k, v, mask=np.ones((3, 4), bool))
    np.testing.assert_array_equal(qkv.attention(q, k, v), before)


# ---- the SDPA drop-in ---------------------------------------------------------------

q4, k4, v4 = torch.zeros(2, 4, 5, 8), torch.zeros(2, 4, 6, 8), torch.zeros(2, 4, 6, 3)

# Calls PyTorch rejects; qkv must reject each one too (with TypeError or ValueError).
TORCH_REJECTS = [
    ("1-D inputs", (q4[0, 0, 0], k4[0, 0, 0], v4[0, 0, 0]), {}),
    ("head dim mismatch", (q4, k4[..., :7], v4), {}),
    ("k/v length mismatch", (q4, k4, v4[:, :, :5]), {}),
    ("heads 4 vs 2 without gqa", (q4, k4[:, :2], v4[:, :2]), {}),
    ("heads 4 vs 3 with gqa", (q4, k4[:, :3], v4[:, :3]), dict(enable_gqa=True)),
    ("gqa with 2-D inputs", (q4[0, 0], k4[0, 0], v4[0, 0]), dict(enable_gqa=True)),
    ("q heads 1, kv heads 4 with gqa", (q4[:, :1], k4, v4), dict(enable_gqa=True)),
    ("batch 2 vs 3", (q4, torch.zeros(3, 4, 6, 8), torch.zeros(3, 4, 6, 3)), {}),
    ("mask wrong keys", (q4, k4, v4), dict(attn_mask=torch.zeros(5, 7))),
    ("mask wrong batch", (q4, k4, v4), dict(attn_mask=torch.zeros(3, 1, 5, 6))),
    ("mask 5-D for 4-D inputs", (q4, k4, v4), dict(attn_mask=torch.zeros(1, 2, 4, 5, 6))),
    ("mask 1-D", (q4, k4, v4), dict(attn_mask=torch.zeros(6))),
    ("mask int64", (q4, k4, v4), dict(attn_mask=torch.ones(5, 6, dtype=torch.int64))),
    ("mask uint8", (q4, k4, v4), dict(attn_mask=torch.ones(5, 6, dtype=torch.uint8))),
    ("mask float64 on float32", (q4, k4, v4), dict(attn_mask=torch.zeros(5, 6).double())),
    ("mask float16", (q4, k4, v4), dict(attn_mask=torch.zeros(5, 6).half())),
    ("mask and is_causal", (q4, k4, v4),
     dict(attn_mask=torch.ones(5, 6, dtype=torch.bool), is_causal=True)),
    ("mixed dtypes", (q4, k4.double(), v4), {}),
    ("integer inputs", (q4.long(), k4.long(), v4.long()), {}),
]


@pytest.mark.parametrize("case", TORCH_REJECTS, ids=[c[0] for c in TORCH_REJECTS])
def test_sdpa_rejects_what_torch_rejects(case):
    _, args, kwargs = case
    with pytest.raises(Exception):
        F.scaled_dot_product_attention(*args, **kwargs)
    with pytest.raises((TypeError, ValueError)) as info:
        qt.scaled_dot_product_attention(*args, **kwargs)
    assert "qkv" in str(info.value)


SDPA_ERRORS = [
    ("dropout out of range", dict(dropout_p=1.5), ValueError,
     r"dropout_p: expected a probability in \[0, 1\), got 1\.5"),
    ("dropout 1", dict(dropout_p=1.0), ValueError,
     r"dropout_p: expected a probability in \[0, 1\), got 1\.0"),
    ("negative scale", dict(scale=-1.0), ValueError,
     r"options\.scale: expected a finite value > 0, got -1"),
    ("mask not a tensor", dict(attn_mask=np.ones((5, 6), bool)), TypeError,
     r"attn_mask: expected a torch\.Tensor or None, got numpy\.ndarray"),
]


@pytest.mark.parametrize("case", SDPA_ERRORS, ids=[c[0] for c in SDPA_ERRORS])
def test_sdpa_errors(case):
    _, kwargs, error, pattern = case
    with pytest.raises(error, match=pattern):
        qt.scaled_dot_product_attention(q4, k4, v4, **kwargs)


def test_sdpa_unsupported_dtype_is_a_type_error():
    with pytest.raises(TypeError, match=r"qkv takes torch\.float32, torch\.float64, "
                                        r"torch\.bfloat16 or torch\.float16, got torch\.int32"):
        qt.scaled_dot_product_attention(*(x.int() for x in (q4, k4, v4)))


def test_sdpa_trainable_float_mask_is_not_implemented():
    bias = torch.zeros(5, 6, requires_grad=True)
    with pytest.raises(NotImplementedError, match="gradient with respect to a float attention"):
        qt.scaled_dot_product_attention(q4, k4, v4, attn_mask=bias)
    with torch.no_grad():  # no graph recorded: fine
        qt.scaled_dot_product_attention(q4, k4, v4, attn_mask=bias)
    qt.scaled_dot_product_attention(q4, k4, v4, attn_mask=bias.detach())


def test_sdpa_non_tensor_input():
    with pytest.raises(TypeError, match=r"query: expected a torch\.Tensor, got numpy\.ndarray"):
        qt.scaled_dot_product_attention(np.zeros((2, 3)), k4, v4)


def test_sdpa_double_backward_is_refused():
    q = torch.randn(1, 1, 3, 4, dtype=torch.float64, requires_grad=True)
    out = qt.scaled_dot_product_attention(q, q, q)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        dq.sum().backward()
