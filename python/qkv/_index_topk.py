"""qkv.index_topk: DeepSeek Sparse Attention's "lightning indexer" (qkv/index_topk.hpp)."""

from __future__ import annotations

from ._arrays import Torch, framework_of
from ._core import eager_index_topk, topk_count as _topk_count


def index_topk(q, k, weights, topk, *, scale=None, causal="bottom_right", key_lengths=None,
               threads=None, precision=None):
    fn = "qkv.index_topk"
    fw = framework_of(fn, q=q, k=k, weights=weights)
    if fw is Torch:
        from . import _torch_ops

        if _torch_ops.traced(q, k, weights):  # torch.compile, fake tensors: the operator
            from . import _torch_ops_index  # noqa: F401  (registers torch.ops.qkv.index_topk)
            from ._torch_ops import refuse_precision_when_traced

            refuse_precision_when_traced(precision)
            from ._options import key_lengths_array

            lengths = None if key_lengths is None else key_lengths_array(fn, Torch, key_lengths)
            import torch

            return torch.ops.qkv.index_topk(q, k, weights, _topk_count(fn, topk),
                                            None if scale is None else float(scale), causal, lengths,
                                            threads)
    return eager_index_topk(q, k, weights, topk, scale=scale, causal=causal,
                            key_lengths=key_lengths, threads=threads, fw=fw, precision=precision)


index_topk.__doc__ = """The top-k keys of every query by DeepSeek-V3.2's indexer score,

        score[b, i, j] = Σ_h weights[b, i, h] · relu(scale · q[b, i, h, :] · k[b, j, :])

    as transformers' ``DeepseekV32Indexer`` computes it (pass its weights, which already
    carry its ``n_heads**-0.5``). Returns int32 ``[B, Nq, topk]``: each row's allowed keys by
    descending score, ties to the lower index, then -1 where a row is allowed fewer than
    topk keys (transformers' ``torch.topk`` would list masked positions there instead).

    q ``[B, Nq, Hi, di]``, k ``[B, Nk, di]``, weights ``[B, Nq, Hi]``: NumPy arrays or CPU
    torch tensors (never copied; last dimension contiguous), q and k float32, float16,
    bfloat16 or float64 (one dtype), weights any float (used as float32; float64 with
    float64 q). scale: default ``1/sqrt(di)``, finite and > 0. causal: ``"bottom_right"``
    (the default: query i sees keys j <= i + Nk - Nq, Nk being key_lengths[b] when given),
    ``"top_left"`` (j <= i) or None. key_lengths: one int per batch entry; only keys
    [0, key_lengths[b]) may be picked. threads: None = every hardware thread; the result
    is the same for any count. precision: ``"fast"`` (the default) or ``"exact"``, as in
    ``qkv.attention``: with bfloat16 q and k, "fast" on a CPU with a bf16 unit
    (AVX512-BF16's vdpbf16ps on AMD Zen 4/5, the AMX tiles on Intel Xeons) sums each head's
    exact products there, keys read in place (the same scores up to float32 summation
    order); "exact" keeps the float32 FMAs, bit for bit on every machine. Under
    torch.compile only the default.

    Computed in float32 (float64 for float64 inputs) over blocks of keys with a running
    top-k per row: memory O(threads·topk) beside the output, never the Nq×Nk scores. A NaN
    score ranks above every number (torch.topk's order). Raises TypeError for a wrong array
    type or dtype and qkv.Error (a ValueError) naming the argument otherwise.
"""

__all__ = ["index_topk"]
