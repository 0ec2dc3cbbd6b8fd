"""No qkv._qkv instance is left for nanobind to report as leaked when the interpreter exits
(issue 43, 5). nanobind prints "leaked instance ... of type qkv._qkv.KVCache" (and its
types and functions, dozens of lines) for every instance alive after finalization; each
scenario below printed that before the fix. Each runs in its own interpreter, checks its
own result (so the objects were really used) and prints it; the test reads stderr.

- globals of a module that registers a torch.library operator: PyTorch keeps the
  operator's function in C++, and with it the module's globals, which finalization then
  never clears (qkv/_exit.py releases caches and plans in an atexit hook);
- the same through transformers: a tiny Llama whose attention appends to and attends
  from per-layer KVCaches kept on the model, its attention an operator of the script;
- an autograd graph alive at exit that saved a view of a cache's memory
  (KVCache.torch_storage() attended by qkv.attention with q requiring grad): PyTorch
  does not free a graph at finalization, so what holds the memory must not be the
  qkv._qkv instance (python/src/decode.cpp: the views hold the C++ cache itself).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

_OPERATOR_GLOBALS = """
import numpy as np, torch, qkv
torch.manual_seed(0)

@torch.library.custom_op("leaktest::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:  # any operator: PyTorch now holds this module's globals
    return 2 * x

cache = qkv.KVCache(2, 32, 2, 16)
paged = qkv.KVCache(2, 32, 2, 16, dtype="int4", paged=True, block_size=16, group_size=16)
k, v = torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
cache.append(k, v)
paged.append(k, v)
q = torch.randn(2, 4, 3, 16)
out = cache.attend(q)
approx = paged.attend(q)
plan = qkv.BatchPlan([0, 3, 6], [7, 7], num_heads=4, num_kv_heads=2, head_dim=16)
packed = q.transpose(1, 2).reshape(6, 4, 16)
planned = plan.run(packed, cache, None)
ref = torch.nn.functional.scaled_dot_product_attention(
    q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
    attn_mask=torch.ones(3, 7, dtype=torch.bool).tril(4))
assert (out - ref).abs().max() < 1e-5 and (approx - ref).abs().max() < 0.5
assert (planned - ref.transpose(1, 2).reshape(6, 4, 16)).abs().max() < 1e-5
print("ok", double(out).sum().item())
"""

_TRANSFORMERS = """
import torch, transformers, qkv
from transformers import AttentionInterface
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
model = transformers.LlamaForCausalLM(config).eval()
model.qkv_caches = [qkv.KVCache(1, 64, 2, 16) for _ in range(config.num_hidden_layers)]

@torch.library.custom_op("leaktest::cache_attend", mutates_args=())
def cache_attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    cache = model.qkv_caches[layer]
    cache.append(k, v)
    return cache.attend(q, scale=scale)

def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    new = query.shape[2]  # transformers passes every key so far: the cache takes the new ones
    out = cache_attend(module.layer_idx, query, key[:, :, -new:].contiguous(), value[:, :, -new:].contiguous(),
                       scaling)
    return out.transpose(1, 2).contiguous(), None

AttentionInterface.register("leaktest_cache", attention)
ids = torch.tensor([[1, 5, 7, 9, 11]])
with torch.no_grad():
    model.set_attn_implementation("sdpa")
    expected = model.generate(ids, max_new_tokens=6, do_sample=False).tolist()
    model.set_attn_implementation("leaktest_cache")
    got = model.generate(ids, max_new_tokens=6, do_sample=False).tolist()
assert got == expected, (got, expected)
assert model.qkv_caches[0].lengths == [10], model.qkv_caches[0].lengths
print("ok", got)
"""

_GRAPH_OVER_STORAGE = """
import torch, qkv
torch.manual_seed(0)
cache = qkv.KVCache(1, 16, 2, 8, layout="bshd")
kv = torch.randn(1, 5, 2, 8)
cache.append(kv, kv)
k, v = cache.torch_storage()
q = torch.randn(1, 3, 2, 8, requires_grad=True)
out = qkv.attention(q, k[:, :5], v[:, :5], layout="bshd", causal="bottom_right")  # saves the views
ref = cache.attend(q.detach())
assert (out.detach() - ref).abs().max() < 1e-5
print("ok", out.detach().sum().item())
"""


@pytest.mark.parametrize("script", [
    pytest.param(_OPERATOR_GLOBALS, id="operator-module-globals"),
    pytest.param(_TRANSFORMERS, id="transformers-model-caches"),
    pytest.param(_GRAPH_OVER_STORAGE, id="graph-over-cache-storage"),
])
def test_no_leak_report_at_exit(script):
    if "transformers" in script:
        pytest.importorskip("transformers")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok "), result.stdout  # the objects were used, and right
    assert "leaked" not in result.stderr, result.stderr


_USE_AFTER_RELEASE = """
import atexit, qkv
cache = qkv.KVCache(1, 4, 1, 8)
def late():  # registered after qkv's hook, so it runs before it
    print("lengths at exit", cache.lengths)
atexit.register(late)
"""


def test_a_hook_registered_after_import_still_sees_the_cache():
    """atexit runs hooks last-registered first: a program's own exit hook runs before qkv
    releases its caches."""
    result = subprocess.run([sys.executable, "-c", _USE_AFTER_RELEASE], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "lengths at exit [0]\n", result.stdout
    assert "leaked" not in result.stderr, result.stderr


def test_a_released_cache_says_so():
    import qkv
    from qkv import _exit

    cache = qkv.KVCache(1, 4, 1, 8)
    plan = qkv.BatchPlan([0, 1], [1], num_heads=1, num_kv_heads=1, head_dim=8)
    cache._release()
    plan._release()
    with pytest.raises(qkv.Error, match="qkv.KVCache: used after the interpreter began to exit"):
        cache.lengths
    with pytest.raises(qkv.Error, match="qkv.BatchPlan: used after the interpreter began to exit"):
        plan.sequences
    assert isinstance(cache._cache, _exit.Released)


def test_views_keep_the_memory_not_the_object():
    """A view of a cache's memory holds the C++ cache (python/src/decode.cpp), not the
    qkv._qkv object: the memory stays valid after the KVCache is released and gone."""
    import gc

    import numpy as np

    import qkv

    cache = qkv.KVCache(1, 4, 1, 8, dtype="int8")
    cache.append(np.ones((1, 1, 2, 8), np.float32), np.full((1, 1, 2, 8), 2.0, np.float32))
    keys, values = cache.storage()
    scales = cache.scales()
    torch_keys, _ = cache.torch_storage()
    cache._release()
    del cache
    gc.collect()
    assert keys[0, :2].tolist() == [[[127] * 8]] * 2 and values[0, :2].tolist() == [[[127] * 8]] * 2
    assert np.allclose(scales[0][0, :2], 1 / 127) and np.allclose(scales[1][0, :2], 2 / 127)
    assert torch_keys[0, :2].tolist() == [[[127] * 8]] * 2
