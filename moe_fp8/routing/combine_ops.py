"""Combine: un-permute the expert outputs and sum each token's k rows weighted by the router.

``out[t] = sum_{j<k} w[t, j] * y[pair_to_row[t*k + j]]``, accumulated in fp32 in slot order and
rounded once to ``y.dtype``. Deterministic: every output element belongs to one program (no
atomics), so the same inputs give the same bits on every run. Differentiable in ``y`` and ``w``:

* ``grad_y[pair_to_row[t*k + j]] = w[t, j] * grad_out[t]`` (padding rows get 0);
* ``grad_w[t, j] = <grad_out[t], y[pair_to_row[t*k + j]]>`` (fp32 dot, fixed order).

Why a Triton kernel rather than ``y[rows].view(T, k, H)`` + a weighted sum in torch: the torch
form writes and re-reads the gathered ``(T, k, H)`` tensor (plus an fp32 copy for the weighted
sum): about 3x the bytes of the one-pass kernel, which reads the k rows once and writes the
token once. ``index_add_`` avoids the copy but uses float atomics, whose order (and bits) vary.

Exposed as the torch ops (``triton_op``) ``moe_fp8::routing_combine`` (autograd registered) and
``moe_fp8::routing_combine_backward``. The unweighted combine and the bf16 permute
(``moe_fp8::routing_permute``, and the bf16 rows of ``moe_fp8::routing_permute_both``) are each other's
backward: their autograd formulas are registered here.
"""

from __future__ import annotations

import torch

from ..checks import check_same_device, check_tensor
from ..launch import launch
from ..quant.formats import Float8Format, resolve_format
from ..quant.kernels.common import format_constexprs
from ..quant.reference import HIGH_PRECISION_DTYPES, quantize_rowwise
from ..kernel_backend import device_guard, eager_triton_op, use_triton
from ..launch_math import cdiv, next_power_of_2
from .combine_kernels import combine_backward_kernel, combine_kernel
from .permute_ops import _permute_both_op, _permute_op
from .plan import DispatchPlan
from .reference import combine_backward_reference, combine_reference, padding_scale

__all__ = ["combine", "combine_backward_rows"]

_FWD_BLOCK_H = 1024
_FWD_WARPS = 4
_BWD_TILE = 2048  # k x BLOCK_H elements per backward iteration (H200 sweep: 2048 > 4096 > 8192)
_BWD_QUANTIZE_TILE = 4096  # the same, quantizing grad_y too (H100, 8192 tokens: Qwen3 sizes 4096 > 8192 > 2048)
_BWD_WARPS = 4
_PAD_ROWS_PER_PROGRAM = 16


@torch.library.triton_op("moe_fp8::routing_combine", mutates_args=())
def _combine_op(
    y: torch.Tensor,
    pair_to_row: torch.Tensor,
    row_to_pair: torch.Tensor,
    pad_rows: torch.Tensor,
    weights: torch.Tensor | None,
    top_k: int,
) -> torch.Tensor:
    T, H = pair_to_row.shape[0] // top_k, y.shape[1]
    if not use_triton(combine_kernel, y):
        return combine_reference(y, pair_to_row, weights, top_k)
    out = torch.empty(T, H, dtype=y.dtype, device=y.device)
    if T == 0 or H == 0:
        return out
    block = min(next_power_of_2(H), _FWD_BLOCK_H)
    with device_guard(y):
        launch(combine_kernel)[(T, cdiv(H, block))](
            y, weights if weights is not None else y, out, pair_to_row, H,
            TOPK=top_k, HAS_WEIGHTS=weights is not None, BLOCK_H=block, num_warps=_FWD_WARPS,
        )
    return out


@_combine_op.register_fake
def _(y, pair_to_row, row_to_pair, pad_rows, weights, top_k):
    return y.new_empty(pair_to_row.shape[0] // top_k, y.shape[1])


def _launch_combine_backward(
    grad_out: torch.Tensor, y: torch.Tensor, pair_to_row: torch.Tensor, pad_rows: torch.Tensor,
    weights: torch.Tensor, fmt: Float8Format | None, pow2: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(grad_y, grad_w, q, scale)`` from the backward kernel; ``fmt``: also ``grad_y``'s rowwise
    FP8 ``q (M, H)`` and ``scale (M,)`` (else both ``None``)."""
    T, k = weights.shape
    M, H = y.shape
    grad_y = torch.empty_like(y)
    grad_w = torch.empty_like(weights)
    quantize = fmt is not None
    q = torch.empty(M, H, dtype=fmt.torch_dtype, device=y.device) if quantize else None
    scale = torch.empty(M, dtype=torch.float32, device=y.device) if quantize else None
    num_pad = pad_rows.numel()
    grid = T + cdiv(num_pad, _PAD_ROWS_PER_PROGRAM)
    if H == 0 or grid == 0:
        if quantize:
            scale.fill_(padding_scale(fmt, pow2))  # rows of no element, or padding rows only: zero rows
        return grad_y, grad_w.zero_() if H == 0 else grad_w, q, scale
    k_pow2 = next_power_of_2(k)
    block = min(next_power_of_2(H), max(128, (_BWD_QUANTIZE_TILE if quantize else _BWD_TILE) // k_pow2))
    with device_guard(y):
        launch(combine_backward_kernel)[(grid,)](
            grad_out, y, weights, grad_y, grad_w, q if quantize else y, scale if quantize else y, pair_to_row,
            pad_rows, T, H, num_pad, padding_scale(fmt, pow2) if quantize else 0.0,
            TOPK=k, TOPK_POW2=k_pow2, BLOCK_H=block, PAD_ROWS=_PAD_ROWS_PER_PROGRAM, QUANTIZE=quantize, POW2=pow2,
            num_warps=_BWD_WARPS, **format_constexprs(fmt if quantize else resolve_format("e4m3fn"), y.device),
        )
    return grad_y, grad_w, q, scale


@eager_triton_op("moe_fp8::routing_combine_backward")
def _combine_backward_op(
    grad_out: torch.Tensor, y: torch.Tensor, pair_to_row: torch.Tensor, pad_rows: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(combine_backward_kernel, y):
        return combine_backward_reference(grad_out, y, pair_to_row, weights, weights.shape[1])
    return _launch_combine_backward(grad_out, y, pair_to_row, pad_rows, weights, None, False)[:2]


@_combine_backward_op.register_fake
def _(grad_out, y, pair_to_row, pad_rows, weights):
    return torch.empty_like(y), torch.empty_like(weights)


@eager_triton_op("moe_fp8::routing_combine_backward_quantize")
def _combine_backward_quantize_op(
    grad_out: torch.Tensor, y: torch.Tensor, pair_to_row: torch.Tensor, pad_rows: torch.Tensor,
    weights: torch.Tensor, fmt: str, pow2: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    f = resolve_format(fmt)
    if not use_triton(combine_backward_kernel, y):
        grad_y, grad_w = combine_backward_reference(grad_out, y, pair_to_row, weights, weights.shape[1])
        return grad_y, grad_w, *quantize_rowwise(grad_y, f, pow2=pow2)
    return _launch_combine_backward(grad_out, y, pair_to_row, pad_rows, weights, f, pow2)


@_combine_backward_quantize_op.register_fake
def _(grad_out, y, pair_to_row, pad_rows, weights, fmt, pow2):
    return (torch.empty_like(y), torch.empty_like(weights), y.new_empty(y.shape, dtype=resolve_format(fmt).torch_dtype),
            y.new_empty(y.shape[0], dtype=torch.float32))


def _combine_setup(ctx, inputs, output):
    y, pair_to_row, row_to_pair, pad_rows, weights, top_k = inputs
    ctx.save_for_backward(y if weights is not None else None, pair_to_row, row_to_pair, pad_rows, weights)
    ctx.top_k = top_k


def combine_backward_rows(
    grad_out: torch.Tensor, y: torch.Tensor | None, pair_to_row: torch.Tensor, row_to_pair: torch.Tensor,
    pad_rows: torch.Tensor, weights: torch.Tensor | None, top_k: int, fmt: Float8Format | None = None,
    pow2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The combine's backward on a plan's tensors: ``(grad_y, grad_w, q, scale)``; ``grad_w`` is
    ``None`` with unit weights (``weights=None``), ``q, scale`` (``grad_y``'s rowwise FP8, from the
    same launch) ``None`` without ``fmt``."""
    grad_out = grad_out.contiguous()
    if weights is None and fmt is None:
        return _permute_op(grad_out, pair_to_row, row_to_pair, pad_rows, top_k), None, None, None
    if weights is None:
        rows, q, scale = _permute_both_op(grad_out, pair_to_row, row_to_pair, pad_rows, top_k, fmt.name, pow2)
        return rows, None, q, scale
    if fmt is None:
        return (*_combine_backward_op(grad_out, y, pair_to_row, pad_rows, weights), None, None)
    return _combine_backward_quantize_op(grad_out, y, pair_to_row, pad_rows, weights, fmt.name, pow2)


def _combine_backward(ctx, grad_out):
    y, pair_to_row, row_to_pair, pad_rows, weights = ctx.saved_tensors
    grad_y, grad_w, _, _ = combine_backward_rows(grad_out, y, pair_to_row, row_to_pair, pad_rows, weights, ctx.top_k)
    return grad_y, None, None, None, grad_w, None


torch.library.register_autograd("moe_fp8::routing_combine", _combine_backward, setup_context=_combine_setup)


def _permute_setup(ctx, inputs, output):
    _, pair_to_row, row_to_pair, pad_rows, top_k = inputs
    ctx.save_for_backward(pair_to_row, row_to_pair, pad_rows)
    ctx.top_k = top_k


def _permute_backward(ctx, grad):
    plan_tensors = ctx.saved_tensors
    return _combine_op(grad.contiguous(), *plan_tensors, None, ctx.top_k), None, None, None, None


torch.library.register_autograd("moe_fp8::routing_permute", _permute_backward, setup_context=_permute_setup)


def _permute_both_setup(ctx, inputs, output):
    _, pair_to_row, row_to_pair, pad_rows, top_k, _, _ = inputs
    ctx.mark_non_differentiable(output[1], output[2])  # FP8 codes and scales carry no gradient
    ctx.set_materialize_grads(False)  # nor are zero gradients made for them
    ctx.save_for_backward(pair_to_row, row_to_pair, pad_rows)
    ctx.top_k = top_k


def _permute_both_backward(ctx, grad_rows, grad_q, grad_scale):
    grad_x = None if grad_rows is None else _permute_backward(ctx, grad_rows)[0]
    return grad_x, None, None, None, None, None, None


torch.library.register_autograd("moe_fp8::routing_permute_both", _permute_both_backward,
                                setup_context=_permute_both_setup)


def combine(y: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Un-permute and weight-sum the expert outputs (deterministic, differentiable in ``y`` and ``weights``).

    Args:
        y: ``(M, H)`` expert outputs in the plan's row layout (``M = plan.num_rows``),
            bf16/fp16/fp32, row-major. Padding rows are never read.
        plan: the :class:`DispatchPlan` the rows were permuted with.
        weights: ``(T, k)`` router weights (fp32/bf16/fp16), or ``None`` for unit weights
            (Llama 4, whose weights scaled the inputs; or the backward of :func:`permute`).
    Returns:
        ``(T, H)`` in ``y.dtype``.
    """
    check_tensor("y", y, dtypes=HIGH_PRECISION_DTYPES, ndim=2)
    if not isinstance(plan, DispatchPlan):
        raise TypeError(f"plan: expected DispatchPlan, got {type(plan).__name__}")
    # shapes read off the plan's tensors, not its properties: Dynamo in torch 2.9 cannot evaluate
    # a NamedTuple property (fullgraph compile fails there)
    M, k = plan.row_to_pair.shape[0], plan.top_k
    if y.shape[0] != M:
        raise ValueError(f"y: expected {M} rows (plan.num_rows), got shape {tuple(y.shape)}")
    T = plan.pair_to_row.shape[0] // k
    if weights is not None:
        check_tensor("weights", weights, dtypes=HIGH_PRECISION_DTYPES, shape=(T, k))
        check_same_device(y=y, weights=weights, plan=plan.pair_to_row)
        weights = weights.contiguous()
    else:
        check_same_device(y=y, plan=plan.pair_to_row)
    return _combine_op(y.contiguous(), plan.pair_to_row, plan.row_to_pair, plan.pad_rows, weights, k)

