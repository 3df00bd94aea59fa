"""The expert MLP's two grouped GEMMs fused with the ops around them, for their gradients' sake.

``fp8_grouped_mm_swiglu``: ``h = x @ w[g].T`` then ``a = silu(gate) * up`` with ``a``'s rowwise FP8
(the first GEMM and the fused SwiGLU + quantization). ``fp8_grouped_mm_combine``: ``y = a @ w[g].T``
then the router-weighted combine of ``y`` into tokens. Forward they run the same kernels as
``fp8_grouped_mm`` followed by ``SwiGLUQuantize`` / ``combine``. Backward, the kernel that makes
the GEMM's output gradient (the SwiGLU backward, the combine backward) also writes its rowwise FP8
rows and scales, and the GEMM's dgrad takes them instead of quantizing the gradient again: one
launch and one read of the gradient fewer per GEMM (the same bits; on a GPU the router weights'
gradient, an fp32 dot product the combine backward also computes, may be summed in another order
than in the non-quantizing kernel: equal to within fp32 rounding). That holds where the GEMM's
backward takes upstream rows (``takes_grad_rows``: row scales and no per-group column amax of the
gradient wanted from its row quantization, so the ``rowwise_gw_hp`` recipe, or ``rowwise`` whose
forward reduces no group amax); elsewhere the separate ops run (``FP8GroupedMM`` then
``SwiGLUQuantize`` / ``combine``).

The GEMM and the op after it stay two autograd nodes either way, so the op's backward frees what
it saved (the SwiGLU's input ``h``, the combine's ``y``) and the gradient it received before the
GEMM's backward starts. The FP8 rows travel between them as gradients: the GEMM's Function also
returns two stand-ins (zero stride, no values: ``(M, N)`` fp8 and ``(M,)`` fp32) that only the op
after it takes, and that op's backward returns the rows and scales as their gradients.
"""

from __future__ import annotations

import torch

from ..quant.formats import resolve_format
from ..quant.swiglu import SwiGLUQuantize, swiglu_backward_quantize, swiglu_quantize
from ..routing.combine_ops import _combine_op, combine, combine_backward_rows
from ..routing.plan import DispatchPlan
from .autograd import NONE_GRADS, FP8GroupedMM, grouped_mm_backward, grouped_mm_forward, takes_grad_rows
from .op import grouped_mm_arguments

__all__ = ["fp8_grouped_mm_combine", "fp8_grouped_mm_swiglu"]


class _GroupedMMTakingRows(torch.autograd.Function):
    """``apply(*gemm_inputs) -> (out, q_in, scale_in)``: ``FP8GroupedMM`` whose dgrad takes
    grad_out's rowwise FP8 as the gradients of the stand-ins ``q_in (M, N)`` fp8 and
    ``scale_in (M,)`` fp32 (zero stride, never read). Only where ``takes_grad_rows``."""

    @staticmethod
    def forward(ctx, *inputs):
        out, saved = grouped_mm_forward(ctx, *inputs)
        ctx.save_for_backward(*saved)
        ctx.set_materialize_grads(False)  # the op after it gives all three gradients or none
        q_in = out.new_empty((), dtype=resolve_format(ctx.fmt).torch_dtype).expand(out.shape)
        scale_in = out.new_empty((), dtype=torch.float32).expand(out.shape[0])
        return out, q_in, scale_in

    @staticmethod
    def backward(ctx, grad_out, q, scale):
        if grad_out is None:  # out took no part in what is differentiated
            return None, None, *NONE_GRADS
        return (*grouped_mm_backward(ctx, ctx.saved_tensors, grad_out, (q, scale)), *NONE_GRADS)


class _SwiGLUGivingRows(torch.autograd.Function):
    """``apply(h, q_in, scale_in, fmt, pow2) -> (a, q, scale)``: ``SwiGLUQuantize`` whose backward
    also writes grad_h's rowwise FP8 (same launch) and returns it as the gradients of the
    stand-ins ``q_in``, ``scale_in`` from :class:`_GroupedMMTakingRows`."""

    @staticmethod
    def forward(ctx, h, q_in, scale_in, fmt, pow2):
        a, q, scale = swiglu_quantize(h, fmt, pow2=pow2)
        ctx.fmt, ctx.pow2 = fmt, pow2
        ctx.save_for_backward(h)
        ctx.mark_non_differentiable(q, scale)
        ctx.set_materialize_grads(False)  # no zero gradients made for q and scale
        return a, q, scale

    @staticmethod
    def backward(ctx, grad_a, _grad_q, _grad_scale):
        if grad_a is None:  # a took no part in what is differentiated
            return None, None, None, None, None
        (h,) = ctx.saved_tensors
        return *swiglu_backward_quantize(h, grad_a, ctx.fmt, pow2=ctx.pow2), None, None


class _CombineGivingRows(torch.autograd.Function):
    """``apply(y, q_in, scale_in, pair_to_row, row_to_pair, pad_rows, weights, top_k, fmt, pow2) ->
    (T, H)``: the combine, whose backward also writes grad_y's rowwise FP8 (same launch) and
    returns it as the gradients of the stand-ins ``q_in``, ``scale_in`` from
    :class:`_GroupedMMTakingRows`."""

    @staticmethod
    def forward(ctx, y, q_in, scale_in, pair_to_row, row_to_pair, pad_rows, weights, top_k, fmt, pow2):
        ctx.top_k, ctx.fmt, ctx.pow2 = top_k, fmt, pow2
        ctx.save_for_backward(y if weights is not None else None, pair_to_row, row_to_pair, pad_rows, weights)
        return _combine_op(y, pair_to_row, row_to_pair, pad_rows, weights, top_k)

    @staticmethod
    def backward(ctx, grad_out):
        y, pair_to_row, row_to_pair, pad_rows, weights = ctx.saved_tensors
        grad_y, grad_w, q, scale = combine_backward_rows(grad_out, y, pair_to_row, row_to_pair, pad_rows, weights,
                                                         ctx.top_k, resolve_format(ctx.fmt), ctx.pow2)
        return grad_y, q, scale, None, None, None, grad_w, None, None, None


def fp8_grouped_mm_swiglu(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, **kwargs
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``silu(gate) * up`` of ``[gate | up] = fp8_grouped_mm(x, w, offs, **kwargs)`` and its rowwise FP8.

    Takes :func:`fp8_grouped_mm`'s arguments, with a row-scaled FP8 recipe (``rowwise``,
    ``rowwise_gw_hp``); ``w``: ``(E, 2I, K)``. Returns ``a (M, I)`` (differentiable, the GEMM's
    dtype), ``q (M, I)`` fp8 and ``scale (M,)`` fp32, exactly ``quantize_rowwise(a)`` in the GEMM's
    format and ``pow2`` setting (what the next ``fp8_grouped_mm`` takes as ``x_fp8``).
    """
    args = grouped_mm_arguments(x, w, offs, **kwargs)
    _check_row_scales(args)  # N: a multiple of 16, so gate and up halves
    fmt, pow2 = resolve_format(args[8]), args[9]
    if not takes_grad_rows(args):
        return SwiGLUQuantize.apply(FP8GroupedMM.apply(*args), fmt, pow2)
    return _SwiGLUGivingRows.apply(*_GroupedMMTakingRows.apply(*args), fmt, pow2)


def fp8_grouped_mm_combine(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, plan: DispatchPlan,
                           weights: torch.Tensor | None, **kwargs) -> torch.Tensor:
    """``combine(fp8_grouped_mm(x, w, offs, **kwargs), plan, weights)``: ``(T, N)`` in the GEMM's dtype.

    Takes :func:`fp8_grouped_mm`'s arguments, with a row-scaled FP8 recipe, ``offs`` the plan's
    offsets and ``x`` in the plan's row layout; ``weights``: ``(T, k)`` router weights or ``None``
    (unit weights). Differentiable in ``x``, ``w`` and ``weights``.
    """
    if not isinstance(plan, DispatchPlan):
        raise TypeError(f"plan: expected DispatchPlan, got {type(plan).__name__}")
    if x.shape[0] != plan.row_to_pair.shape[0]:
        raise ValueError(f"x: expected {plan.row_to_pair.shape[0]} rows (plan.num_rows), got shape {tuple(x.shape)}")
    args = grouped_mm_arguments(x, w, offs, **kwargs)
    _check_row_scales(args)
    T, k = plan.pair_to_row.shape[0] // plan.top_k, plan.top_k
    if weights is not None:
        if weights.shape != (T, k):
            raise ValueError(f"weights: expected shape {(T, k)}, got {tuple(weights.shape)}")
        weights = weights.contiguous()
    if not takes_grad_rows(args):
        return combine(FP8GroupedMM.apply(*args), plan, weights)
    return _CombineGivingRows.apply(*_GroupedMMTakingRows.apply(*args), plan.pair_to_row, plan.row_to_pair,
                                    plan.pad_rows, weights, k, resolve_format(args[8]), args[9])


def _check_row_scales(args: tuple) -> None:
    if args[5] != "rowwise":
        raise ValueError(f"recipe: expected a recipe with row scales (rowwise, rowwise_gw_hp), got scaling {args[5]!r}")
