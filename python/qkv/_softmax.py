"""The softmax and its derivative as the textbook writes them (qkv/softmax.hpp), along
the last axis of NumPy arrays or PyTorch tensors:

    s = softmax(x),  s_i = exp(x_i − m) / Σ_j exp(x_j − m),  m = max_j x_j
    log_softmax(x)_i = x_i − m − log Σ_j exp(x_j − m)
    J(s) = ∂s/∂x = diag(s) − s·sᵀ               (symmetric, rows sum to 0)
    softmax_backward(s, g) = Jᵀ·g = s ⊙ (g − ⟨s, g⟩)

Sums are accumulated in float64 and the max is subtracted first, so nothing overflows:
softmax([1, 2, 3, 1e6]) is exactly [0, 0, 0, 1]. Entries equal to -inf take no part;
an all -inf row gives all zeros (log_softmax: all -inf), as a fully masked attention
row does. float32 and float64 keep their dtype; lists and integer arrays become
float64 NumPy arrays. Not differentiable through torch autograd (they are the math
itself: use softmax_backward).
"""

from __future__ import annotations

import math

import numpy as np

from . import _qkv
from ._arrays import NumPy, Torch


def _as_array(fn: str, name: str, x):
    """(framework, x) with lists and non-float NumPy arrays promoted to float64."""
    if Torch.owns(x):
        return Torch, x
    if isinstance(x, np.ndarray) and x.dtype in (np.float32, np.float64):
        return NumPy, x
    array = np.asarray(x)
    if array.dtype.kind not in "biuf":
        raise TypeError(f"{fn}: {name}: expected real numbers, got dtype {array.dtype}")
    return NumPy, array.astype(np.float64)


def _rows(fn: str, name: str, fw, x):
    """x as a [rows, n] array with C-order rows (a copy only when x is not C-order)."""
    if x.ndim == 0:
        raise _qkv.Error(f"{fn}: {name}: expected at least 1 dimension (the softmax axis), got a scalar")
    shape = (math.prod(x.shape[:-1]), x.shape[-1])
    if fw is Torch:
        return x.detach().contiguous().reshape(shape)
    return np.ascontiguousarray(x).reshape(shape)


def _empty(fw, shape, like):
    return fw.empty(shape, like)


def softmax(x):
    """softmax along the last axis, computed as qkv::softmax (float64 sums)."""
    fw, x = _as_array("qkv.softmax", "x", x)
    rows = _rows("qkv.softmax", "x", fw, x)
    out = _empty(fw, tuple(rows.shape), rows)
    _qkv.softmax_rows(rows, out)
    return out.reshape(tuple(x.shape))


def log_softmax(x):
    """log_softmax along the last axis: x − max − log Σ exp(x − max)."""
    fw, x = _as_array("qkv.log_softmax", "x", x)
    rows = _rows("qkv.log_softmax", "x", fw, x)
    out = _empty(fw, tuple(rows.shape), rows)
    _qkv.log_softmax_rows(rows, out)
    return out.reshape(tuple(x.shape))


def softmax_jacobian(s):
    """J = diag(s) − s·sᵀ for each softmax vector s along the last axis: shape
    ``s.shape + (n,)``. J[..., i, j] = ∂s_i/∂x_j."""
    fw, s = _as_array("qkv.softmax_jacobian", "s", s)
    rows = _rows("qkv.softmax_jacobian", "s", fw, s)
    n = rows.shape[1]
    jacobian = _empty(fw, (rows.shape[0], n, n), rows)
    _qkv.softmax_jacobian_rows(rows, jacobian)
    return jacobian.reshape(tuple(s.shape) + (n,))


def softmax_backward(s, g):
    """∂L/∂x = Jᵀ·g = s ⊙ (g − ⟨s, g⟩) for s = softmax(x) and g = ∂L/∂s, along the last
    axis, without building J."""
    fn = "qkv.softmax_backward"
    fw, s = _as_array(fn, "s", s)
    fw_g, g = _as_array(fn, "g", g)
    if fw_g is not fw:
        raise TypeError("qkv.softmax_backward: s and g must be of one array type")
    if tuple(g.shape) != tuple(s.shape):
        raise _qkv.Error(
            f"qkv.softmax_backward: g.shape: expected {tuple(s.shape)} (as s), "
            f"got {tuple(g.shape)}"
        )
    s_rows, g_rows = _rows(fn, "s", fw, s), _rows(fn, "g", fw, g)
    dx = _empty(fw, tuple(s_rows.shape), s_rows)
    _qkv.softmax_backward_rows(s_rows, g_rows, dx)
    return dx.reshape(tuple(s.shape))


__all__ = ["softmax", "log_softmax", "softmax_jacobian", "softmax_backward"]
