"""qkv.sparse_attention and qkv.sparse_attention_backward: attention over the keys each
query lists (DeepSeek Sparse Attention's top-k), on NumPy arrays or PyTorch tensors,
without copies. With torch tensors the call is the operator
``torch.ops.qkv.sparse_attention`` (autograd, torch.compile; _torch_ops_sparse)."""

from __future__ import annotations

from ._arrays import Torch, check_layout, check_rank4, framework_of
from ._core import sparse_backward as backward, sparse_forward as forward
from ._options import make_options

_DOC = """
    q ``[B, Hq, Nq, d]`` (``layout="bhsd"``, PyTorch's) or ``[B, Nq, Hq, d]``
    (``"bshd"``); k ``[B, Hkv, Nk, d]`` and v ``[B, Hkv, Nk, dv]`` in the same layout,
    Hq a multiple of Hkv. Read in place, any strides with a contiguous last dimension.

    indices: int32 or int64, ``[B, Nq, topk]`` (one list per query, shared by every
        head: DeepSeek's MQA/MLA mode) or ``[B, Hkv, Nq, topk]`` (one list per kv head);
        -1 = no key. Key j takes part in row i iff it is listed and ``causal`` keeps it;
        a repeated index counts once (the set a scattered boolean mask gives). An index
        outside [-1, Nk) raises qkv.Error naming its batch entry and row.
    scale: multiplies q·kᵀ; default 1/sqrt(d).
    causal: None, ``"top_left"`` (j <= i) or ``"bottom_right"`` (j <= i + Nk - Nq).
    sinks: one float per query head, a logit in every row's softmax without a value
        (gpt-oss); differentiable for torch tensors.
    softcap: c > 0 turns each scaled logit s into ``c·tanh(s/c)``.
    threads: None = every hardware thread; results never depend on it.
    backend: ``"auto"``, ``"reference"`` (fp64, float64 inputs always) or ``"cpu"``.
    precision: None or ``"fast"`` (the default) or ``"exact"``. With bfloat16 inputs and
        groups of >= 16 query heads per kv head, ``"fast"`` runs the forward's dot products
        on AVX512-BF16 or the AMX tiles where the CPU has them (each weight P rounded
        to bfloat16 once, as every peer does: within 2x PyTorch's bf16 error);
        ``"exact"`` keeps float32 arithmetic. Every other call, and the backward, is float32 either way.

    Cost O(Nq·topk·d); nothing Nq × Nk is built. A row with no key taking part gives
    out 0, lse -inf and zero gradients. float32, float64, float16, bfloat16 (16-bit
    inputs widened exactly, float32 arithmetic but as ``precision`` says, rounded once;
    lse float32).
"""


def _checked(fn, layout, **arrays):
    fw = framework_of(fn, **arrays)
    check_layout(fn, layout)
    check_rank4(fn, layout, **{name: x for name, x in arrays.items() if name != "indices"})
    return fw


def sparse_attention(q, k, v, indices, *, scale=None, causal=None, sinks=None, softcap=None,
                     return_lse=False, layout="bhsd", threads=None, backend="auto", precision=None):
    fn = "qkv.sparse_attention"
    fw = _checked(fn, layout, q=q, k=k, v=v, indices=indices)
    if fw is Torch:
        from . import _torch_ops_sparse

        out, lse = _torch_ops_sparse.call(fn, q, k, v, indices, scale=scale, causal=causal,
                                          sinks=sinks, softcap=softcap, layout=layout,
                                          threads=threads, backend=backend, precision=precision)
    else:
        options = make_options(fn, fw, scale=scale, causal=causal, backend=backend,
                               threads=threads, softcap=softcap, sinks=sinks, precision=precision)
        out, lse = forward(fw, q, k, v, indices, layout=layout, options=options,
                           want_lse=return_lse)
    return (out, lse) if return_lse else out


sparse_attention.__doc__ = """Attention over the keys each query lists:
    ``softmax over {listed keys} ∩ causal of scale·q·kᵀ, times v``.

    Returns ``out`` (q's array type, dtype and layout, v's head dim), or ``(out, lse)``
    with ``return_lse=True`` (lse ``[B, Hq, Nq]``). With torch tensors, differentiable
    in q, k, v and sinks (``torch.ops.qkv.sparse_attention``).
""" + _DOC


def sparse_attention_backward(q, k, v, indices, out, lse, dout, *, scale=None, causal=None,
                              sinks=None, softcap=None, layout="bhsd", threads=None,
                              backend="auto", precision=None):
    fn = "qkv.sparse_attention_backward"
    fw = _checked(fn, layout, q=q, k=k, v=v, indices=indices, out=out, dout=dout)
    options = make_options(fn, fw, scale=scale, causal=causal, backend=backend,
                           threads=threads, softcap=softcap, sinks=sinks, precision=precision)
    if options.sinks is None:
        return backward(fw, q, k, v, indices, out, lse, dout, layout=layout, options=options)
    dsinks = fw.empty(tuple(options.sinks.shape), options.sinks)
    return (*backward(fw, q, k, v, indices, out, lse, dout, layout=layout, options=options,
                      dsinks=dsinks), dsinks)


sparse_attention_backward.__doc__ = """Gradients of sparse_attention: ``(dq, dk, dv)``
    (and dsinks with sinks) given the forward's out, lse and ``dout = ∂L/∂out``, with the
    forward's indices and options. dk and dv sum over every query (and head of the GQA
    group) that attends the key, in a fixed order: bitwise the same for any thread count.
""" + _DOC

__all__ = ["sparse_attention", "sparse_attention_backward"]
