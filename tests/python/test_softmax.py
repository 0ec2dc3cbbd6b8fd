"""qkv.softmax, log_softmax, softmax_jacobian, softmax_backward: the textbook math."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv


def test_huge_logits_are_exactly_one_hot():
    s = qkv.softmax([1.0, 2.0, 3.0, 1e6])
    assert s.dtype == np.float64
    assert s.tolist() == [0.0, 0.0, 0.0, 1.0]
    assert qkv.softmax(np.array([1, 2, 3, 1e6], np.float32)).tolist() == [0, 0, 0, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_torch_along_the_last_axis(dtype):
    x = torch.randn(3, 4, 7, dtype=dtype) * 5
    s, log_s = qkv.softmax(x), qkv.log_softmax(x)
    assert isinstance(s, torch.Tensor) and s.dtype == dtype and s.shape == x.shape
    exact = torch.softmax(x.double(), dim=-1)
    # float64 sums rounded once to the dtype: within an ulp or two of the exact value.
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(s.double(), exact, rtol=2 * eps, atol=2 * eps)
    torch.testing.assert_close(log_s.double(), torch.log_softmax(x.double(), dim=-1),
                               rtol=4 * eps, atol=4 * eps * 10)


def test_minus_inf_entries_take_no_part():
    x = np.array([[0.0, -np.inf, 0.0], [-np.inf, -np.inf, -np.inf]])
    np.testing.assert_array_equal(qkv.softmax(x), [[0.5, 0.0, 0.5], [0.0, 0.0, 0.0]])
    log_s = qkv.log_softmax(x)
    assert log_s[0, 1] == -np.inf and np.all(log_s[1] == -np.inf)
    np.testing.assert_allclose(log_s[0, [0, 2]], np.log(0.5), rtol=1e-15)


def test_jacobian_is_diag_minus_outer_and_matches_autograd():
    x = torch.randn(2, 5, dtype=torch.float64)
    s = qkv.softmax(x)
    jacobian = qkv.softmax_jacobian(s)
    assert jacobian.shape == (2, 5, 5)
    for row in range(2):
        expected = torch.autograd.functional.jacobian(lambda t: torch.softmax(t, -1), x[row])
        torch.testing.assert_close(jacobian[row], expected, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(jacobian[row],
                                   torch.diag(s[row]) - torch.outer(s[row], s[row]),
                                   rtol=0, atol=0)
    torch.testing.assert_close(jacobian, jacobian.transpose(-1, -2), rtol=0, atol=0)
    torch.testing.assert_close(jacobian.sum(-1), torch.zeros(2, 5, dtype=torch.float64),
                               rtol=0, atol=1e-15)


def test_backward_is_the_jacobian_times_g_without_building_it():
    rng = np.random.default_rng(3)
    s = qkv.softmax(rng.standard_normal((4, 6)))
    g = rng.standard_normal((4, 6))
    dx = qkv.softmax_backward(s, g)
    expected = np.einsum("rij,rj->ri", qkv.softmax_jacobian(s), g)
    np.testing.assert_allclose(dx, expected, rtol=1e-12, atol=1e-15)
    # and it is the gradient autograd finds through torch.softmax
    x = torch.tensor(rng.standard_normal(6), requires_grad=True)
    s_t = torch.softmax(x, -1)
    s_t.backward(torch.tensor(g[0]))
    np.testing.assert_allclose(qkv.softmax_backward(s_t.detach().numpy(), g[0]), x.grad,
                               rtol=1e-12, atol=1e-15)


def test_strided_and_empty_inputs():
    x = np.random.default_rng(4).standard_normal((6, 8))[::2, ::2]  # not C-order
    np.testing.assert_allclose(qkv.softmax(x), qkv.softmax(np.ascontiguousarray(x)))
    assert qkv.softmax(np.zeros((3, 0))).shape == (3, 0)
    assert qkv.softmax_jacobian(np.zeros((0, 4))).shape == (0, 4, 4)


def test_errors():
    with pytest.raises(ValueError, match=r"g.shape: expected \(3,\) \(as s\), got \(4,\)"):
        qkv.softmax_backward(np.ones(3) / 3, np.ones(4))
    with pytest.raises(TypeError, match="g: expected dtype float32 \\(the dtype of s\\)"):
        qkv.softmax_backward(np.ones(3, np.float32) / 3, np.ones(3))
    with pytest.raises(TypeError, match="real numbers"):
        qkv.softmax(["a", "b"])
    with pytest.raises(ValueError, match="at least 1 dimension"):
        qkv.softmax(np.float64(1.0))
    with pytest.raises(TypeError, match="one array type"):
        qkv.softmax_backward(torch.ones(3), np.ones(3))
