"""qkv.torch.scaled_dot_product_attention against torch's own, forward and gradients.

Rule for float32 (attention_math.assert_no_worse_than_torch): qkv's error against an
exact float64 computation is at most twice PyTorch's, on the same inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv
import qkv.torch as qt
from attention_math import assert_close_fp64, assert_no_worse_than_torch, math_attention

# (name, batch, q_heads, kv_heads, q_len, k_len, head_dim, v_dim)
SHAPES = [
    ("square", 2, 4, 4, 17, 17, 16, 16),
    ("gqa, dv != d", 2, 6, 2, 9, 13, 8, 5),
    ("mqa", 1, 4, 1, 11, 11, 32, 32),
    ("d=1", 1, 2, 2, 5, 6, 1, 1),
    ("d=3, Nq < Nk", 2, 1, 1, 7, 12, 3, 3),
    ("d=59, Nq > Nk", 1, 2, 2, 12, 7, 59, 59),
    ("decode", 3, 4, 2, 1, 40, 16, 16),
    ("longer", 1, 2, 2, 70, 70, 64, 64),
]


def make_qkv(batch, q_heads, kv_heads, q_len, k_len, head_dim, v_dim, dtype=torch.float32):
    q = torch.randn(batch, q_heads, q_len, head_dim, dtype=dtype)
    k = torch.randn(batch, kv_heads, k_len, head_dim, dtype=dtype)
    v = torch.randn(batch, kv_heads, k_len, v_dim, dtype=dtype)
    return q, k, v


def masks_for(batch, q_heads, q_len, k_len):
    """(name, mask, is_causal): every kind of mask PyTorch takes, with fully masked rows."""
    padding = torch.ones(batch, 1, 1, k_len, dtype=torch.bool)
    padding[-1, ..., k_len // 2:] = False
    full = torch.rand(batch, q_heads, q_len, k_len) > 0.3
    full[0, 0, 0] = False  # a fully masked row
    bias = torch.randn(1, q_heads, q_len, k_len)
    bias[..., 0, 1:] = float("-inf")  # every head's first row keeps only key 0
    bias2d = torch.randn(q_len, k_len)
    return [
        ("none", None, False),
        ("causal", None, True),
        ("bool key padding [B,1,1,Nk]", padding, False),
        ("bool full [B,H,Nq,Nk]", full, False),
        ("float [1,H,Nq,Nk] with -inf", bias, False),
        ("float [Nq,Nk]", bias2d, False),
    ]


def run_three(fn_ours, q, k, v, **kwargs):
    """out and grads of qkv (float32), torch SDPA (float32) and the float64 math."""
    def grads(fn, dtype):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        args = dict(kwargs)
        if isinstance(args.get("attn_mask"), torch.Tensor) and args["attn_mask"].is_floating_point():
            args["attn_mask"] = args["attn_mask"].to(dtype)
        out = fn(*leaves, **args)
        out.backward(weight.to(dtype))
        return [out.detach()] + [x.grad for x in leaves]

    weight = torch.randn(*F.scaled_dot_product_attention(q, k, v, **kwargs).shape,
                         dtype=torch.float64)
    return (grads(fn_ours, torch.float32), grads(F.scaled_dot_product_attention, torch.float32),
            grads(F.scaled_dot_product_attention, torch.float64))


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("mask_index", range(6),
                         ids=["none", "causal", "padding", "bool", "float", "float2d"])
def test_forward_and_gradients_match_torch(shape, mask_index):
    _, batch, q_heads, kv_heads, q_len, k_len, head_dim, v_dim = shape
    q, k, v = make_qkv(batch, q_heads, kv_heads, q_len, k_len, head_dim, v_dim)
    name, mask, is_causal = masks_for(batch, q_heads, q_len, k_len)[mask_index]
    kwargs = dict(attn_mask=mask, is_causal=is_causal, enable_gqa=kv_heads != q_heads)
    ours, theirs, exact = run_three(qt.scaled_dot_product_attention, q, k, v, **kwargs)
    for what, a, b, c in zip(("out", "dq", "dk", "dv"), ours, theirs, exact):
        assert a.shape == c.shape and a.dtype == torch.float32
        assert torch.isfinite(a).all(), f"{what} has non-finite values ({name})"
        assert_no_worse_than_torch(a, b, c, f"{what} ({name})")


@pytest.mark.parametrize("is_causal", [False, True])
def test_float64_matches_torch_math_exactly(is_causal):
    q, k, v = make_qkv(2, 4, 2, 9, 11, 8, 6, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ours = qt.scaled_dot_product_attention(*leaves, is_causal=is_causal, enable_gqa=True)
    ours.backward(torch.ones_like(ours))
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_leaves, is_causal=is_causal, enable_gqa=True)
    ref.backward(torch.ones_like(ref))
    assert_close_fp64(ours, ref, "out")
    for name, a, b in zip("qkv", leaves, ref_leaves):
        assert_close_fp64(a.grad, b.grad, f"d{name}")


@pytest.mark.parametrize("scale", [0.05, 1.0, 3.0])
def test_explicit_scale(scale):
    q, k, v = make_qkv(1, 2, 2, 6, 8, 4, 4)
    ours, theirs, exact = run_three(qt.scaled_dot_product_attention, q, k, v, scale=scale)
    for what, a, b, c in zip(("out", "dq", "dk", "dv"), ours, theirs, exact):
        assert_no_worse_than_torch(a, b, c, f"{what} (scale {scale})")


# Shapes PyTorch accepts through broadcasting and rank, all of which qkv must take too.
BROADCAST_CASES = [
    ("2-D", (5, 8), (6, 8), (6, 3), {}),
    ("3-D", (4, 5, 8), (4, 6, 8), (4, 6, 3), {}),
    ("5-D", (2, 3, 4, 5, 8), (2, 3, 4, 6, 8), (2, 3, 4, 6, 3), {}),
    ("5-D kv batch broadcast", (2, 3, 4, 5, 8), (1, 3, 4, 6, 8), (2, 1, 4, 6, 3), {}),
    ("key batch 1", (2, 4, 5, 8), (1, 4, 6, 8), (1, 4, 6, 3), {}),
    ("query batch 1", (1, 4, 5, 8), (2, 4, 6, 8), (2, 4, 6, 3), {}),
    ("query heads 1", (2, 1, 5, 8), (2, 4, 6, 8), (2, 4, 6, 3), {}),
    ("kv heads 1 without gqa", (2, 4, 5, 8), (2, 1, 6, 8), (2, 1, 6, 3), {}),
    ("k heads 1, v heads 4", (2, 4, 5, 8), (2, 1, 6, 8), (2, 4, 6, 3), {}),
    ("3-D query, 4-D key", (4, 5, 8), (2, 4, 6, 8), (2, 4, 6, 3), {}),
    ("gqa, k and v heads differ", (2, 4, 5, 8), (2, 2, 6, 8), (2, 1, 6, 3),
     dict(enable_gqa=True)),
    ("gqa 3-D", (4, 5, 8), (2, 6, 8), (2, 6, 3), dict(enable_gqa=True)),
    ("gqa batch broadcast", (2, 4, 5, 8), (1, 2, 6, 8), (1, 2, 6, 3), dict(enable_gqa=True)),
    ("mask broadcast over keys", (2, 4, 5, 8), (2, 4, 6, 8), (2, 4, 6, 3),
     dict(attn_mask=(5, 1))),
    ("3-D mask on 4-D inputs", (2, 4, 5, 8), (2, 4, 6, 8), (2, 4, 6, 3),
     dict(attn_mask=(4, 5, 6))),
    ("5-D mask", (2, 3, 4, 5, 8), (2, 3, 4, 6, 8), (2, 3, 4, 6, 3),
     dict(attn_mask=(2, 1, 4, 1, 6))),
    ("empty queries", (2, 4, 0, 8), (2, 4, 6, 8), (2, 4, 6, 3), {}),
    ("empty keys", (2, 4, 5, 8), (2, 4, 0, 8), (2, 4, 0, 3), {}),
    ("empty batch", (0, 4, 5, 8), (0, 4, 6, 8), (0, 4, 6, 3), {}),
    ("no heads", (2, 0, 5, 8), (2, 0, 6, 8), (2, 0, 6, 3), {}),
    ("value dim 0", (2, 4, 5, 8), (2, 4, 6, 8), (2, 4, 6, 0), {}),
    ("causal, Nq > Nk", (1, 2, 7, 4), (1, 2, 3, 4), (1, 2, 3, 4), dict(is_causal=True)),
]


@pytest.mark.parametrize("case", BROADCAST_CASES, ids=[c[0] for c in BROADCAST_CASES])
def test_shapes_torch_accepts(case):
    _, q_shape, k_shape, v_shape, kwargs = case
    kwargs = dict(kwargs)
    if "attn_mask" in kwargs:
        # Values exact in float32: qkv adds float masks in float32 (see the next test).
        kwargs["attn_mask"] = torch.randn(*kwargs["attn_mask"]).double()
    q, k, v = (torch.randn(*s, dtype=torch.float64, requires_grad=True)
               for s in (q_shape, k_shape, v_shape))
    ours = qt.scaled_dot_product_attention(q, k, v, **kwargs)
    ours_grads = torch.autograd.grad(ours.sum(), (q, k, v), allow_unused=True)
    ref = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert ours.shape == ref.shape
    assert_close_fp64(ours, ref, "out")
    if ref.requires_grad:  # PyTorch's empty results may carry no graph
        ref_grads = torch.autograd.grad(ref.sum(), (q, k, v), allow_unused=True)
        for name, a, b in zip("qkv", ours_grads, ref_grads):
            assert_close_fp64(a if a is not None else torch.zeros_like(b),
                              b if b is not None else torch.zeros_like(a), f"d{name}")


def test_float64_mask_is_added_in_float32():
    """Documented: qkv adds float masks in float32, so a float64 mask counts as its
    float32 rounding (exactly, for the 0/-inf masks models use)."""
    q, k, v = make_qkv(1, 2, 2, 4, 5, 8, 8, dtype=torch.float64)
    mask = torch.randn(4, 5, dtype=torch.float64)
    ours = qt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    rounded = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.float().double())
    assert_close_fp64(ours, rounded, "out with the float32-rounded mask")


def test_fully_masked_rows_give_zero_and_zero_gradients():
    q, k, v = (x.requires_grad_() for x in make_qkv(1, 2, 2, 4, 5, 8, 8))
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1] = False
    out = qt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.backward(torch.ones_like(out))
    assert torch.equal(out[:, :, 1], torch.zeros(1, 2, 8))
    assert torch.equal(q.grad[:, :, 1], torch.zeros(1, 2, 8))
    for t in (out, q.grad, k.grad, v.grad):
        assert torch.isfinite(t).all()


def test_huge_logits_do_not_overflow():
    q, k, v = make_qkv(1, 1, 1, 3, 4, 4, 4)
    q = q.requires_grad_()
    out = qt.scaled_dot_product_attention(q, k, v, scale=1e6)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
    # With logits ~1e6 apart the softmax is one-hot: each row copies one value row.
    picks = (q.detach() @ k.transpose(-1, -2)).argmax(-1)
    assert torch.equal(out.detach(), v[0, 0][picks[0, 0]][None, None])


def test_packed_projection_strides_give_the_same_result():
    """q, k, v as strided slices of one projection (the usual nn.Module pattern) give
    exactly what contiguous copies give: strides change where we read, not the math."""
    batch, seq, heads, head_dim = 2, 9, 3, 8
    packed = torch.randn(batch, seq, 3 * heads * head_dim)
    q, k, v = packed.view(batch, seq, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
    assert not q.is_contiguous()
    strided = qt.scaled_dot_product_attention(q, k, v, is_causal=True)
    contiguous = qt.scaled_dot_product_attention(q.contiguous(), k.contiguous(),
                                                 v.contiguous(), is_causal=True)
    assert torch.equal(strided, contiguous)


def test_results_do_not_depend_on_the_thread_count(backend):
    q, k, v = make_qkv(2, 4, 2, 33, 40, 16, 16)
    runs = [qkv.attention(q, k, v, causal="top_left", backend=backend, threads=threads)
            for threads in (1, 2, 3)]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


class TinyAttentionBlock(torch.nn.Module):
    """A causal self-attention block written the usual way, around any SDPA."""

    def __init__(self, sdpa, dim=32, heads=4):
        super().__init__()
        self.sdpa, self.heads = sdpa, heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, dim // self.heads).permute(
            2, 0, 3, 1, 4)
        y = self.sdpa(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, dim))


def test_nn_module_trains_like_torch():
    """Replace F.scaled_dot_product_attention by qkv's in a module, train it: the losses
    and the parameters after each SGD step follow PyTorch's within float32 noise."""
    ours = TinyAttentionBlock(qt.scaled_dot_product_attention)
    theirs = TinyAttentionBlock(F.scaled_dot_product_attention)
    theirs.load_state_dict(ours.state_dict())
    x, target = torch.randn(4, 12, 32), torch.randn(4, 12, 32)
    lr = 0.1
    losses = []
    for model in (ours, theirs):
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        history = []
        for _ in range(5):
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), target)
            loss.backward()
            optimizer.step()
            history.append(loss.item())
        losses.append(history)
    assert losses[0][-1] < losses[0][0]  # it learns
    # float32 forward/backward noise is ~1e-6 relative per step; five SGD steps with
    # lr 0.1 on O(1) gradients keep the two runs within 1e-5 of each other.
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]),
                               rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_custom_ops_pass_opcheck():
    """torch.library.opcheck: schema, fake (meta) implementations and autograd
    registration of qkv's operators are consistent with what they compute."""
    q, k, v = (x.requires_grad_() for x in make_qkv(1, 2, 1, 3, 4, 4, 4))
    args = (q, k, v, None, None, None, None, "top_left", "bhsd", "auto", 1, False)
    torch.library.opcheck(torch.ops.qkv.attention_forward.default, args)
    out, lse = torch.ops.qkv.attention_forward(*args)
    bargs = (q.detach(), k.detach(), v.detach(), out.detach(), lse, torch.randn_like(out),
             None, None, None, None, "top_left", "bhsd", "auto", 1, False)
    torch.library.opcheck(torch.ops.qkv.attention_backward.default, bargs)


def test_torch_compile_traces_the_operators():
    """Under torch.compile (aot_eager: dynamo and AOTAutograd, no C++ code generation)
    the call becomes torch.ops.qkv.attention_forward / attention_backward, and forward
    and gradients equal the eager ones."""
    torch._dynamo.reset()
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    def f(q, k, v, mask):
        return qt.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()

    q, k, v = (x.requires_grad_() for x in make_qkv(2, 4, 4, 5, 6, 8, 8))
    mask = torch.rand(5, 6) > 0.2
    eager = torch.autograd.grad(f(q, k, v, mask), (q, k, v))
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    traced = torch.autograd.grad(compiled(q, k, v, mask), (q, k, v))
    for a, b in zip(eager, traced):
        assert torch.equal(a, b)
    dynamo_graph = torch.compile(f, backend=backend, fullgraph=True)
    dynamo_graph(q, k, v, mask)
    assert any("qkv.attention_forward" in target for target in seen), seen


def test_math_reference_agrees_with_torch():
    """The tests' own plain-math oracle is checked against PyTorch once."""
    q, k, v = make_qkv(2, 4, 2, 6, 7, 5, 3, dtype=torch.float64)
    mask = torch.rand(2, 1, 6, 7) > 0.2
    ours, _ = math_attention(q, k, v, keep=mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    ref = torch.nan_to_num(ref)  # (fully masked rows, if any, are NaN in some versions)
    assert_close_fp64(ours, ref, "math_attention")
