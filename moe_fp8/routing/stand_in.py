"""A differentiable permute that moves no data: for GEMMs that read FP8 rows and never the BF16 ones."""

from __future__ import annotations

import torch

from .combine_ops import combine
from .plan import DispatchPlan

__all__ = ["permute_stand_in"]


class _PermuteStandIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan):
        ctx.plan = plan
        return x.new_empty(()).expand(plan.num_rows, x.shape[1])  # one element, never read: no fill

    @staticmethod
    def backward(ctx, grad):
        return combine(grad.contiguous(), ctx.plan, None), None


def permute_stand_in(x: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """``(M, H)`` zero-stride stand-in for ``permute(x, plan)``: it holds no values (one uninitialised
    element broadcast), and its backward is the permute's (each token's rows summed, the unweighted
    combine). For a grouped GEMM that reads the rows' FP8 copy only (``fp8_grouped_mm`` with
    ``x_fp8`` and ``save_x_fp8``), so the BF16 permuted rows are never written."""
    return _PermuteStandIn.apply(x, plan)
