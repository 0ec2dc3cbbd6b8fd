"""The operator of BatchPlan.run with new tokens (qkv/_rotary.py), as torch.compile,
torch.export and fake tensors see it:

    torch.ops.qkv.batch_plan_run_appending(handle, q, k_cache!, v_cache!, k_scale!, v_scale!,
        k_new, v_new, rotary_cos, rotary_sin, positions, rotary_interleaved, rotary_dim,
        indices, k_rope_new, k_rope_cache!, v_dim) -> (out, lse)
    torch.ops.qkv.batch_plan_run_records_appending(handle, q, records!, k_new, k_rope_new,
        rotary_cos, rotary_sin, positions, rotary_interleaved, rotary_dim, power_of_two_scales,
        indices) -> (out, lse)

It writes the new tokens' rows into the caller's caches before attending them, so it
declares k_cache and v_cache mutated (and k_scale and v_scale, which an int8 cache's new
rows write; float8 reads them; k_rope_cache, MLA's second pool): a compiler then keeps every later read of the caches —
the next layer's step, a decode that follows — after it, and never replays it on a copy.
Its real implementation is the eager call; it has no backward. The plan is named by its
handle, as for torch.ops.qkv.batch_plan_run (qkv/_torch_ops_cache.py). With MLA's latent
values (v_cache None: the values are k_cache's first v_dim channels) the fake takes the
output's width from v_dim. The records operator declares FlashMLA's FP8 records mutated.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ._torch_ops_cache import _plan


@torch.library.custom_op("qkv::batch_plan_run_appending",
                         mutates_args=("k_cache", "v_cache", "k_scale", "v_scale", "k_rope_cache"))
def batch_plan_run_appending(
    handle: Tensor, q: Tensor, k_cache: Tensor, v_cache: Optional[Tensor], k_scale: Optional[Tensor],
    v_scale: Optional[Tensor], k_new: Optional[Tensor], v_new: Optional[Tensor], rotary_cos: Optional[Tensor],
    rotary_sin: Optional[Tensor], positions: Optional[Tensor], rotary_interleaved: bool, rotary_dim: Optional[int],
    indices: Optional[Tensor] = None, k_rope_new: Optional[Tensor] = None, k_rope_cache: Optional[Tensor] = None,
    v_dim: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    # The plan's own eager run (real tensors here: never traced), so this module needs no
    # import of qkv/_rotary.py, which imports it.
    return _plan(handle).run(q, k_cache, v_cache, k_scale=k_scale, v_scale=v_scale, return_lse=True, indices=indices,
                             k_new=k_new, v_new=v_new, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                             rotary_interleaved=rotary_interleaved, rotary_dim=rotary_dim, positions=positions,
                             k_rope_new=k_rope_new, k_rope_cache=k_rope_cache)


@batch_plan_run_appending.register_fake
def _(handle, q, k_cache, v_cache, k_scale, v_scale, k_new, v_new, rotary_cos, rotary_sin, positions,
      rotary_interleaved, rotary_dim, indices=None, k_rope_new=None, k_rope_cache=None, v_dim=None):
    total, heads = q.shape[0], q.shape[1]
    dtype = q.dtype if q.is_floating_point() else torch.float32
    width = v_cache.shape[-1] if v_cache is not None else v_dim
    return (q.new_empty((total, heads, width), dtype=dtype), q.new_empty((heads, total), dtype=torch.float32))


@torch.library.custom_op("qkv::batch_plan_run_records_appending", mutates_args=("records",))
def batch_plan_run_records_appending(
    handle: Tensor, q: Tensor, records: Tensor, k_new: Tensor, k_rope_new: Tensor, rotary_cos: Optional[Tensor],
    rotary_sin: Optional[Tensor], positions: Optional[Tensor], rotary_interleaved: bool, rotary_dim: Optional[int],
    power_of_two_scales: bool, indices: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    return _plan(handle).run(q, records, None, cache_format="fp8_ds_mla", return_lse=True, indices=indices,
                             k_new=k_new, k_rope_new=k_rope_new, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                             rotary_interleaved=rotary_interleaved, rotary_dim=rotary_dim, positions=positions,
                             power_of_two_scales=power_of_two_scales)


@batch_plan_run_records_appending.register_fake
def _(handle, q, records, k_new, k_rope_new, rotary_cos, rotary_sin, positions, rotary_interleaved, rotary_dim,
      power_of_two_scales, indices=None):
    total, heads, width = q.shape
    dc = 32 * (2 * width - records.shape[-1]) // 31  # as batch_plan_run_records' fake
    dtype = q.dtype if q.is_floating_point() else torch.float32
    return (q.new_empty((total, heads, dc), dtype=dtype), q.new_empty((heads, total), dtype=torch.float32))


__all__ = ["batch_plan_run_appending", "batch_plan_run_records_appending"]
