"""precision= on every entry point (qkv/options.hpp's Precision; docs/numerics.md): one
option through the one options table, the same error for a bad value everywhere; "exact"
is the float32 arithmetic bit for bit on every machine. Where the CPU runs bf16 dot
products (QKV_DOT_PRODUCTS=on forces them; a subprocess here), the default "fast" forward
and backward on bfloat16 meet the contract of docs/numerics.md: out, lse and every
gradient within 2× PyTorch's bf16 error against fp64 (FlashAttention's own test rule; P
and dS are rounded to bfloat16 once, as PyTorch rounds them)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv._options import Options
import qkv.torch as qt


def bf16_case(seed=0, shape=(1, 4, 130, 40), kv_heads=2):
    g = torch.Generator().manual_seed(seed)
    b, h, n, d = shape
    q = torch.randn(b, h, n, d, generator=g).to(torch.bfloat16)
    k = torch.randn(b, kv_heads, n, d, generator=g).to(torch.bfloat16)
    v = torch.randn(b, kv_heads, n, d, generator=g).to(torch.bfloat16)
    return q, k, v


def entry_points(precision):
    """Every way to run attention, each with precision=."""
    q, k, v = bf16_case()
    cu = torch.tensor([0, 50, 130], dtype=torch.int32)
    packed = [x[0].transpose(0, 1).contiguous() for x in (q, k, v)]
    cache = qkv.KVCache(1, 200, 2, 40, dtype="bfloat16")
    cache.append(k.float(), v.float())
    out, lse = qkv.attention(q, k, v, return_lse=True)
    lists = torch.randint(-1, 130, (1, 130, 16), generator=torch.Generator().manual_seed(3))
    s_out, s_lse = qkv.sparse_attention(q, k, v, lists, return_lse=True)
    return {
        "sparse_attention": lambda: qkv.sparse_attention(q, k, v, lists, precision=precision),
        "BatchPlan": lambda: qkv.BatchPlan([0, 1], [130], num_heads=4, num_kv_heads=2, head_dim=40,
                                           precision=precision).run(q[0, :, -1:].transpose(0, 1).float(),
                                                                    k.transpose(1, 2).float(),
                                                                    v.transpose(1, 2).float()),
        "sparse_attention (NumPy)": lambda: qkv.sparse_attention(
            *(x.float().numpy() for x in (q, k, v)), lists.numpy(), precision=precision),
        "sparse_attention_backward": lambda: qkv.sparse_attention_backward(
            q, k, v, lists, s_out, s_lse, torch.ones_like(s_out), precision=precision),
        "attention": lambda: qkv.attention(q, k, v, precision=precision),
        "attention_backward": lambda: qkv.attention_backward(q, k, v, out, lse, torch.ones_like(out),
                                                             precision=precision),
        "varlen_attention": lambda: qkv.varlen_attention(*packed, cu, cu, precision=precision),
        "decode": lambda: qkv.decode(q[:, :, -1:].float(), k.float(), v.float(), [130], precision=precision),
        "KVCache.attend": lambda: cache.attend(q[:, :, -1:].float(), precision=precision),
        "qkv.torch": lambda: qt.scaled_dot_product_attention(q, k, v, enable_gqa=True, precision=precision),
    }


@pytest.mark.parametrize("precision", [None, "fast", "exact"])
def test_every_entry_point_takes_precision(precision):
    for name, call in entry_points(precision).items():
        assert call() is not None, name


def test_bad_precision_names_the_option_everywhere():
    for name, call in entry_points("fastest").items():
        with pytest.raises(qkv.Error, match=r"precision: expected None, 'fast' or 'exact', got 'fastest'"):
            call()
    with pytest.raises(TypeError, match="precision: expected None, 'fast' or 'exact', got int 1"):
        qkv.attention(*bf16_case(), precision=1)


def test_options_keep_precision():
    o = Options("qkv", precision="exact")
    assert o.precision_name == "exact" and o.fields()["precision"] == "exact"
    assert Options("qkv").precision_name == "fast"
    assert Options("qkv", **o.fields()).precision_name == "exact"


def test_exact_is_the_float32_kernels_rounded_once():
    q, k, v = bf16_case(1)
    out = qkv.attention(q, k, v, causal="top_left", precision="exact")
    out32 = qkv.attention(q.float(), k.float(), v.float(), causal="top_left")
    assert torch.equal(out, out32.to(torch.bfloat16))


def test_sparse_exact_is_the_float32_kernel_rounded_once():
    """Groups of 16 heads in bfloat16 take the dot products in "fast" where the CPU has
    them (sparse_forward.cpp's latent step); "exact" is the float32 step, bit for bit."""
    q, k, v = bf16_case(2, shape=(1, 32, 70, 64), kv_heads=2)
    lists = torch.randint(-1, 70, (1, 70, 40), generator=torch.Generator().manual_seed(4))
    out, lse = qkv.sparse_attention(q, k, v, lists, causal="bottom_right", precision="exact", return_lse=True)
    out32, lse32 = qkv.sparse_attention(q.float(), k.float(), v.float(), lists, causal="bottom_right",
                                        return_lse=True)
    assert torch.equal(out, out32.to(torch.bfloat16)) and torch.equal(lse, lse32)


FORCED = """
import torch, torch.nn.functional as F, qkv
torch.manual_seed(0)
for h, hkv, n, d, causal in ((8, 8, 300, 64, False), (8, 2, 257, 127, True), (4, 4, 200, 128, False)):
    q = torch.randn(1, h, n, d).to(torch.bfloat16)
    k, v = (torch.randn(1, hkv, n, d).to(torch.bfloat16) for _ in range(2))
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal, enable_gqa=True)
    logits = (q.double() @ k.double().repeat_interleave(h // hkv, 1).transpose(-1, -2)) * d ** -0.5
    if causal:
        logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    exact_lse = logits.logsumexp(-1)
    err = lambda x, ref: (x.double() - ref).abs().max().item()
    fast, fast_lse = qkv.attention(q, k, v, causal="top_left" if causal else None, return_lse=True)
    ours_exact = qkv.attention(q, k, v, causal="top_left" if causal else None, precision="exact")
    # PyTorch's bf16 flash kernel (what F.scaled_dot_product_attention runs here), with its lse.
    kr, vr = (x.repeat_interleave(h // hkv, 1) for x in (k, v))
    torch_out, torch_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kr, vr, 0.0, causal)[:2]
    assert not torch.equal(fast, ours_exact), "the dot products never ran"
    floor = 8 * 2**-23  # float32 noise, relative to the largest value
    assert err(fast, exact) <= 2 * err(torch_out, exact) + floor * exact.abs().max().item(), \
        ("out", err(fast, exact), err(torch_out, exact))
    assert err(fast_lse, exact_lse) <= 2 * err(torch_lse, exact_lse) + floor * exact_lse.abs().max().item(), \
        ("lse", err(fast_lse, exact_lse), err(torch_lse, exact_lse))
print("ok")
"""


def run_forced(script, cpu_flag, unit):
    """Runs `script` in a subprocess with QKV_DOT_PRODUCTS=on (read once per process),
    skipped where /proc/cpuinfo lacks `cpu_flag`; the script prints "ok"."""
    with open("/proc/cpuinfo") as cpuinfo:
        if cpu_flag not in cpuinfo.read():
            pytest.skip(f"no {unit} on this CPU")
    env = dict(os.environ, QKV_DOT_PRODUCTS="on")
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_forced_bf16_dot_products_within_twice_torch_error():
    run_forced(FORCED, "avx512_bf16", "AVX512-BF16")


FORCED_BACKWARD = """
import torch, torch.nn.functional as F, qkv.torch as qt
torch.manual_seed(1)
def grads(fn, q, k, v, dout):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    fn(q, k, v).backward(dout)
    return q.grad, k.grad, v.grad
for h, hkv, n, d, causal in ((8, 8, 300, 64, False), (8, 2, 257, 127, True), (4, 4, 200, 128, True)):
    q = torch.randn(1, h, n, d).to(torch.bfloat16)
    k, v = (torch.randn(1, hkv, n, d).to(torch.bfloat16) for _ in range(2))
    dout = torch.randn(1, h, n, d).to(torch.bfloat16)
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    exact = grads(sdpa, q.double(), k.double(), v.double(), dout.double())
    theirs = grads(sdpa, q, k, v, dout)
    ours = grads(lambda q, k, v: qt.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True),
                 q, k, v, dout)
    ours_exact = grads(lambda q, k, v: qt.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True,
                                                                       precision="exact"), q, k, v, dout)
    assert not torch.equal(ours[1], ours_exact[1]), "dk: the backward's dot products never ran"
    for name, a, b, e in zip("qkv", ours, theirs, exact):
        err = lambda g: (g.double() - e).abs().max().item()
        assert err(a) <= 2 * err(b) + 8 * 2**-23 * e.abs().max().item(), ("d" + name, err(a), err(b))
print("ok")
"""


def test_forced_bf16_dot_products_backward_within_twice_torch_error():
    """The backward on AVX512-BF16 (cpu/backward.cpp: all five products, P and dS as one
    bf16 term each): dq, dk, dv each within 2× PyTorch bf16's distance from float64."""
    run_forced(FORCED_BACKWARD, "avx512_bf16", "AVX512-BF16")


FORCED_INT8 = r"""
import numpy as np, torch, qkv
torch.manual_seed(3)
batch, hq, hkv, d, n, t = 2, 8, 2, 128, 300, 2
cache = qkv.KVCache(batch, 320, hkv, d, dtype="int8", paged=True, block_size=16)
cache.append(torch.randn(batch, hkv, n, d), torch.randn(batch, hkv, n, d))
q = torch.randn(batch, hq, t, d)
fast = cache.attend(q, causal="none").double()
exact = cache.attend(q, causal="none", precision="exact").double()
assert not torch.equal(fast, exact), "the int8 dot products never ran"
scale = d ** -0.5
for seq in range(batch):
    ks, vs = (torch.from_numpy(x).double() for x in cache.stored(seq))  # [Hkv, n, d]
    kq, vq = ks.repeat_interleave(hq // hkv, 0), vs.repeat_interleave(hq // hkv, 0)
    logits = scale * q[seq].double() @ kq.transpose(1, 2)  # each query sees every key here
    ref = torch.softmax(logits, -1) @ vq
    # tests/cpp/test_int8_dot.cpp's bound: the query split moves each logit by at most
    # (max|scale·q|/127/508)·Σ|k|, the weights' split the output by max|v|·64/(255·510).
    step = (scale * q[seq].double()).abs().amax(-1, keepdim=True) / 127
    delta = (step / 508 * kq.abs().sum(-1).unsqueeze(1)).max().item()
    max_v = vs.abs().max().item()
    bound = (np.exp(2 * delta) - 1) * max_v + max_v * 64 / (255 * 510) + 1e-5 * max(1.0, ref.abs().max().item())
    torch_err = (torch.softmax(logits.float(), -1) @ vq.float()).double().sub(ref).abs().max().item()
    assert (fast[seq] - ref).abs().max().item() <= torch_err + bound, ((fast[seq] - ref).abs().max(), torch_err, bound)
    assert (exact[seq] - ref).abs().max().item() <= 4 * torch_err + 1e-6
print("ok")
"""


def test_forced_int8_dot_products_within_their_bound():
    """Decode over an int8 cache on VNNI (forced: Precision.fast does not take it on any
    CPU yet, docs/platforms-and-performance.md): against float64 attention over the cache's stored
    values, within PyTorch's float32 error plus the two-term split's derived bound."""
    run_forced(FORCED_INT8, "avx512_vnni", "AVX512-VNNI")
