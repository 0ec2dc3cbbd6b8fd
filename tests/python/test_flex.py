"""qkv.flex_attention (qkv/_flex.py): torch's FlexAttention signature on qkv's kernels,
forward and backward on the CPU. A BlockMask is read as qkv's block-sparse mask
(qkv/block_sparse.hpp): checked against SDPA with the same mask given densely (float64:
the exact reference backend) and against qkv's own dense-mask path (float32: the same
tiles masked alike, so bitwise), under torch.compile, and for what it must not do
(evaluate mask_mod twice for one mask, or over full and empty blocks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv

flex = pytest.importorskip("torch.nn.attention.flex_attention")

N, DIM = 200, 16
DOC = torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(3)).sort().values


def causal_document(b, h, q, kv):
    return (DOC[q] == DOC[kv]) & (q >= kv)


def head_window(b, h, q, kv):  # varies with the head and the batch entry
    return ((q - kv) <= (h + 1) * 20) & (q >= kv) & ((b == 0) | (kv % 3 != 0))


def _dense(mask_mod, batch, heads, n=N):
    i = torch.arange(n)
    return mask_mod(torch.arange(batch)[:, None, None, None],
                    torch.arange(heads)[None, :, None, None], i[:, None], i[None, :])


@pytest.mark.parametrize("mask_mod,batch,heads,block", [
    (causal_document, None, None, 128), (causal_document, None, None, 48),
    (head_window, 2, 4, 32)])
def test_block_masks_match_sdpa_with_the_dense_mask_forward_and_backward(mask_mod, batch,
                                                                         heads, block):
    mask = flex.create_block_mask(mask_mod, batch, heads, N, N, BLOCK_SIZE=block, device="cpu")
    q = torch.randn(2, 4, N, DIM, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, N, DIM, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = qkv.flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=_dense(mask_mod, 2, 4),
                                         enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for a, b in zip(torch.autograd.grad(out.pow(2).sum(), (q, k, v)),
                    torch.autograd.grad(ref.pow(2).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_float32_and_score_mods_equal_the_dense_mask_path_bitwise_also_compiled():
    """float32 cpu kernels: the block mask and the same mask given densely mask the same
    tiles alike (bitwise), with soft-cap and ALiBi (and the slopes' gradient); the
    fullgraph-compiled call gives the eager bits."""
    mask = flex.create_block_mask(head_window, 2, 4, N, N, BLOCK_SIZE=32, device="cpu")
    q, k, v = (torch.randn(2, 4, N, DIM, requires_grad=True) for _ in range(3))
    slopes = torch.rand(4, requires_grad=True)
    mods = [qkv.mods.softcap(3.0), qkv.mods.alibi(slopes)]

    def f(q, k, v):
        return qkv.flex_attention(q, k, v, block_mask=mask, score_mod=mods)

    out = f(q, k, v)
    ref = qkv.attention(q, k, v, mask=_dense(head_window, 2, 4), softcap=3.0, alibi_slopes=slopes)
    grads = torch.autograd.grad(out.pow(2).sum(), (q, k, v, slopes))
    assert torch.equal(out, ref)
    for a, b in zip(grads, torch.autograd.grad(ref.pow(2).sum(), (q, k, v, slopes))):
        assert torch.equal(a, b)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    traced = compiled(q, k, v)
    assert torch.equal(traced, out)
    for a, b in zip(grads, torch.autograd.grad(traced.pow(2).sum(), (q, k, v, slopes))):
        assert torch.equal(a, b)


def test_mask_mod_runs_once_per_mask_and_only_on_partial_blocks():
    calls = []

    def counted(b, h, q, kv):
        calls.append(tuple(q.shape))
        return causal_document(b, h, q, kv)

    mask = flex.create_block_mask(counted, None, None, N, N, BLOCK_SIZE=32, device="cpu")
    calls.clear()  # create_block_mask's own evaluation
    q, k, v = (torch.randn(1, 2, N, DIM) for _ in range(3))
    out = qkv.flex_attention(q, k, v, block_mask=mask)
    assert torch.equal(qkv.flex_attention(q, k, v, block_mask=mask), out)  # a second layer
    assert len(calls) == 1  # one vectorized call, for the first layer only
    state, slot, masks = qkv._flex.block_table(
        mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
        qkv._flex.mask_mod_handle(counted), 32, 32, N, N)
    partial = int((state == qkv._flex.PARTIAL).sum())
    assert calls[0] == (partial, 32, 1) and masks.shape[0] == partial  # partial blocks only
    assert partial < state.numel() // 2
    assert int((state == qkv._flex.FULL).sum()) > 0 and int((state == qkv._flex.EMPTY).sum()) > 0


def test_a_new_mask_over_new_data_is_not_taken_for_a_cached_one():
    """Training builds a BlockMask per batch, often with one mask_mod over new data; the
    cache must not hand back the last batch's table (a freed mask's memory is reused)."""
    documents = {"ids": DOC}

    def same_document(b, h, q, kv):
        return documents["ids"][q] == documents["ids"][kv]

    q, k, v = (torch.randn(1, 2, N, DIM) for _ in range(3))
    for split in (50, 120, 170):
        documents["ids"] = (torch.arange(N) >= split).long()
        mask = flex.create_block_mask(same_document, None, None, N, N, BLOCK_SIZE=32, device="cpu")
        out = qkv.flex_attention(q, k, v, block_mask=mask)
        assert torch.equal(out, qkv.attention(q, k, v, mask=_dense(same_document, 1, 1)))
        del mask


def test_lse_no_mask_and_rows_without_keys():
    """return_lse is the natural-log LSE qkv.attention gives; no block_mask is plain
    attention; a row whose blocks are all empty gives 0 and -inf, as torch's."""
    q, k, v = (torch.randn(1, 2, 64, DIM) for _ in range(3))
    out, lse = qkv.flex_attention(q, k, v, return_lse=True, scale=0.3)
    ref, ref_lse = qkv.attention(q, k, v, return_lse=True, scale=0.3)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    mask = flex.create_block_mask(lambda b, h, q, kv: q >= 32, None, None, 64, 64,
                                  BLOCK_SIZE=16, device="cpu")
    out, lse = qkv.flex_attention(q, k, v, block_mask=mask, return_lse=True)
    assert torch.equal(out[:, :, :32], torch.zeros_like(out[:, :, :32]))
    assert torch.isneginf(lse[:, :, :32]).all() and torch.isfinite(lse[:, :, 32:]).all()


def test_python_score_mods_and_mismatched_masks_are_clear_errors():
    q = torch.randn(1, 2, 64, DIM)
    with pytest.raises(TypeError, match=r"score_mod: expected None, qkv.mods.softcap.*runs no "
                                        r"Python inside its kernels"):
        qkv.flex_attention(q, q, q, score_mod=lambda s, b, h, i, j: s)
    mask = flex.create_block_mask(causal_document, None, None, N, N, device="cpu")
    with pytest.raises(qkv.Error, match=r"block_mask: made for \(Q_LEN, KV_LEN\) = \(200, 200\)"):
        qkv.flex_attention(q, q, q, block_mask=mask)
    with pytest.raises(qkv.Error, match=r"key.shape\[1\] \(heads\): expected 4 .* enable_gqa"):
        qkv.flex_attention(torch.randn(1, 4, 8, DIM), q[:, :, :8], q[:, :, :8])


def test_a_bias_score_mod_and_its_gradient_match_sdpa_with_a_float_mask():
    q = torch.randn(2, 4, 40, DIM, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 40, DIM, dtype=torch.float64, requires_grad=True) for _ in range(2))
    bias = torch.randn(1, 4, 40, 40, dtype=torch.float64).masked_fill(
        torch.rand(40, 40) < 0.2, float("-inf")).requires_grad_()
    out = qkv.flex_attention(q, k, v, score_mod=qkv.mods.bias(bias), enable_gqa=True)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    torch.testing.assert_close(out, ref.to(out.dtype), rtol=0, atol=1e-6)  # float32 mask
    grads = torch.autograd.grad(out.pow(2).sum(), (q, k, v, bias))
    for a, b in zip(grads, torch.autograd.grad(ref.pow(2).sum(), (q, k, v, bias))):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=0, atol=1e-5)
    with torch.no_grad():  # no gradient wanted: qkv alone, the mask read in float32
        assert torch.equal(qkv.flex_attention(q, k, v, score_mod=qkv.mods.bias(bias), enable_gqa=True),
                           out.detach())
    mask = flex.create_block_mask(causal_document, None, None, 40, 40, device="cpu")
    with pytest.raises(qkv.Error, match="takes no block_mask"):
        qkv.flex_attention(q, k, v, score_mod=qkv.mods.bias(bias), block_mask=mask, enable_gqa=True)
