"""Routers, the sync-free dispatch plan, permute / fused permute+quantize and combine (see DESIGN.md).

Typical forward of an MoE layer::

    r = router(x)                                           # RouterOutput
    plan = make_dispatch_plan(r.topk_ids, E, pad_multiple=16)
    x_q, x_scale = permute_quantize(x, plan, fmt)           # (M, H) fp8, (M,) fp32
    y = experts(x_q, x_scale, plan.offsets)                 # (M, H) bf16
    out = combine(y, plan, r.topk_weights)                  # (T, H)
"""

from .combine_ops import combine
from .config import RouterConfig, RouterOutput
from .losses import expert_counts, load_balancing_loss, router_z_loss, update_correction_bias_
from .permute_ops import permute, permute_quantize, permute_with_fp8
from .plan import DispatchPlan, make_dispatch_plan, padded_num_rows
from .reference import padding_scale
from .router import Router
from .scoring import group_limited_mask, route
from .stand_in import permute_stand_in

__all__ = [
    "DispatchPlan",
    "Router",
    "RouterConfig",
    "RouterOutput",
    "combine",
    "expert_counts",
    "group_limited_mask",
    "load_balancing_loss",
    "make_dispatch_plan",
    "padded_num_rows",
    "padding_scale",
    "permute",
    "permute_quantize",
    "permute_stand_in",
    "permute_with_fp8",
    "route",
    "router_z_loss",
    "update_correction_bias_",
]
