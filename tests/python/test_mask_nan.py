"""A NaN in a float mask, as PyTorch treats it: the query row whose bias holds the NaN comes
out NaN (its output and its gradient dq), every other row as without it, on every backend
— against torch's SDPA (which adds the mask to the logits) and across qkv's backends."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("q_len, k_len", [(5, 9), (3, 40), (130, 150)], ids=["one_tile", "decode_shaped", "tiles"])
def test_nan_in_a_float_mask_makes_its_row_nan_like_sdpa(backend, q_len, k_len):
    if backend not in qkv.available_backends():
        pytest.skip(f"backend {backend!r} not built")
    torch.manual_seed(3)
    q = torch.randn(2, 2, q_len, 16, requires_grad=True)
    k = torch.randn(2, 2, k_len, 16, requires_grad=True)
    v = torch.randn(2, 2, k_len, 16, requires_grad=True)
    mask = torch.randn(1, 2, q_len, k_len)
    nan_rows = [(0, 1), (1, q_len - 1)]  # (head, query)
    for head, query in nan_rows:
        mask[0, head, query, (query * 7) % k_len] = float("nan")
    ours = qkv.attention(q, k, v, mask=mask, backend=backend)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    nan_ours, nan_theirs = ours.isnan().all(-1), theirs.isnan().all(-1)
    for head, query in nan_rows:
        assert nan_theirs[:, head, query].all(), "SDPA itself gives a NaN row"
    torch.testing.assert_close(nan_ours, nan_theirs, msg="NaN rows differ from SDPA's")
    finite = ~nan_theirs
    assert not ours.isnan()[finite].any(), "a NaN leaked into another row"
    torch.testing.assert_close(ours[finite], theirs[finite], rtol=2e-5, atol=2e-5)
    # Backward: the NaN row's dq is NaN, the other rows' dq as SDPA's.
    grad = torch.randn_like(theirs)
    dq_ours, = torch.autograd.grad(ours, q, grad)
    dq_theirs, = torch.autograd.grad(theirs, q, grad)
    assert dq_ours.isnan().all(-1)[~finite].all(), "the NaN row's dq is not NaN"
    assert dq_theirs.isnan().all(-1)[~finite].all()
    torch.testing.assert_close(dq_ours[finite], dq_theirs[finite], rtol=1e-4, atol=1e-4)
