"""qkv.BatchPlan.run as torch.compile, torch.export and fake tensors see it:

    torch.ops.qkv.batch_plan_run(handle, q, k_cache, v_cache, k_scale, v_scale) -> (out, lse)

It runs the eager plan.run (qkv/_batch_plan.py) when it executes, so a traced call is the
eager call; not differentiable (serving is forward only). A plan is made once per step,
outside the graph (its layout is data the engine has, not tensors of the model): the
operator names it by a handle, an int64 scalar tensor the plan holds (qkv/_handles.py),
which the graph takes as an input, so one compiled function serves every step's new plan
without recompiling. The fake needs no plan: out's head dim is v_cache's last (the plan
checks that it is its v_dim).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ._handles import Handles

_PLANS = Handles("qkv.BatchPlan")  # handle -> BatchPlan, for the operator
register = _PLANS.register
_plan = _PLANS.get


@torch.library.custom_op("qkv::batch_plan_run", mutates_args=())
def batch_plan_run(handle: Tensor, q: Tensor, k_cache: Tensor, v_cache: Tensor, k_scale: Optional[Tensor],
                   v_scale: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    return _plan(handle).eager_run(q, k_cache, v_cache, k_scale=k_scale, v_scale=v_scale, return_lse=True)


@batch_plan_run.register_fake
def _(handle, q, k_cache, v_cache, k_scale, v_scale):
    total, heads = q.shape[0], q.shape[1]
    dtype = q.dtype if q.is_floating_point() else torch.float32
    return (q.new_empty((total, heads, v_cache.shape[-1]), dtype=dtype),
            q.new_empty((heads, total), dtype=torch.float32))


def traced(x) -> bool:
    """Whether a call on torch tensors is traced (torch.compile, fake tensors)."""
    return torch.compiler.is_compiling() or type(x) is not Tensor


__all__ = ["batch_plan_run", "register", "traced"]
