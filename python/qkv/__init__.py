"""qkv — exact, fast scaled dot-product attention for NumPy and PyTorch.

    out = softmax(scale·q·kᵀ + mask)·v          scale defaults to 1/sqrt(d)

Functions (NumPy arrays or torch tensors, float32 or float64, CPU, never copied):

    attention(q, k, v, ...)            forward; differentiable for torch tensors
                                       (return_stats=True: softmax saturation and
                                       entropy per head, from the same pass)
    attention_backward(q, k, v, out, lse, dout, ...)   dq, dk, dv
    attention_weights(q, k, v, ...)    the weights P of the exact reference backend
    varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, ...)   packed sequences, no padding
    varlen_attention_backward(...)     its dq, dk, dv
    sparse_attention(q, k, v, indices, ...)   attention over the keys each query lists
                                       (DeepSeek's top-k); differentiable for torch tensors
    sparse_attention_backward(...)     its dq, dk, dv
    softmax, log_softmax, softmax_jacobian, softmax_backward   the textbook math
    available_backends()               which backends this build runs
    KVCache(batch, capacity, kv_heads, head_dim, dtype=..., paged=...)   a key/value
                                       cache for generation: append(k, v), attend(q)
    decode(q, k_cache, v_cache, cache_lengths, block_table=None)   attention against
                                       caller-owned caches (contiguous or paged), in place
    mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, cache_lengths, scale=...)   absorbed
                                       latent attention (DeepSeek MLA) over latent caches
                                       (cache_format="fp8_ds_mla": FlashMLA's FP8 records,
                                       written by pack_mla_records(c_kv, k_pe))
    index_topk(q, k, weights, topk, ...)   DeepSeek sparse attention's indexer: the top-k
                                       keys of every query, never the Nq×Nk scores

and ``qkv.torch.scaled_dot_product_attention``, a drop-in for
``torch.nn.functional.scaled_dot_product_attention``; ``qkv.flex_attention``, torch's
FlexAttention signature (BlockMask, qkv.mods score_mods) with a CPU backward. Every bad call raises TypeError
(array type, dtype, device) or qkv.Error, a ValueError carrying the C++ library's
message.

Threads: qkv's OpenMP workers wait passively (asleep) between calls, so they do not
spin through the Python that follows; when libgomp was loaded before qkv (``import
torch`` first), set OMP_WAIT_POLICY=PASSIVE in the environment for the same (qkv/_threads.py).
"""

from . import _threads

# OpenMP workers sleep between parallel regions instead of spinning through the caller's
# next Python statements (decided before the library loads libgomp: see _threads).
_passive = _threads.before_load()
try:
    from ._qkv import Error, __version__
finally:
    _threads.after_load(_passive)
del _passive
from ._qkv import set_idle_workers_spin as _set_idle_workers_spin

_set_idle_workers_spin(_threads.workers_spin())  # sizes small decode calls' threads
from ._attention import attention, attention_backward, attention_weights, available_backends
from ._decode import KVCache, decode, mla_decode
from ._batch_plan import BatchPlan
from ._softmax import log_softmax, softmax, softmax_backward, softmax_jacobian
from ._varlen import varlen_attention, varlen_attention_backward
from ._sparse import sparse_attention, sparse_attention_backward
from ._attention import dropout_mask
from ._index_topk import index_topk
from ._mla_records import pack_mla_records

Error.__module__ = "qkv"  # raised as qkv.Error (a ValueError), however deep it came from

__all__ = [
    "BatchPlan",
    "Error",
    "KVCache",
    "__version__",
    "attention",
    "attention_backward",
    "attention_weights",
    "available_backends",
    "dropout_mask",
    "index_topk",
    "decode",
    "log_softmax",
    "mla_decode",
    "pack_mla_records",
    "softmax",
    "softmax_backward",
    "softmax_jacobian",
    "sparse_attention",
    "sparse_attention_backward",
    "varlen_attention",
    "varlen_attention_backward",
]


def __getattr__(name):
    # `import qkv; qkv.torch...` works without importing torch for NumPy-only users.
    if name in ("torch", "mods"):
        import importlib

        return importlib.import_module("." + name, __name__)
    if name == "flex_attention":  # needs torch: imported on first use
        from ._flex import flex_attention

        return flex_attention
    raise AttributeError(f"module 'qkv' has no attribute {name!r}")
