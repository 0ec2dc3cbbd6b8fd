"""The operator torch.ops.qkv.index_topk: qkv.index_topk as torch.compile, torch.export and
fake tensors see it (int32 indices, no gradient: a selection is not differentiable)."""

from __future__ import annotations

import torch

from ._core import eager_index_topk


@torch.library.custom_op(
    "qkv::index_topk", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor weights, int topk, float? scale, str? causal, "
           "Tensor? key_lengths, int? threads) -> Tensor")
def index_topk(q, k, weights, topk, scale, causal, key_lengths, threads):
    return eager_index_topk(q, k, weights, topk, scale=scale, causal=causal,
                            key_lengths=key_lengths, threads=threads)


@index_topk.register_fake
def _(q, k, weights, topk, scale, causal, key_lengths, threads):
    return q.new_empty((q.shape[0], q.shape[1], topk), dtype=torch.int32)
