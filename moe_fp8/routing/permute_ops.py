"""Permute token rows into the expert-sorted layout: bf16 (baseline), fused with rowwise FP8 quantization,
or both from one read of the token rows.

All three are ``torch.library.triton_op`` s (``moe_fp8::routing_permute``, ``moe_fp8::routing_permute_quantize``,
``moe_fp8::routing_permute_both``) with fake kernels, so ``torch.compile`` traces them down to the kernel
and they capture in CUDA graphs. The bf16 rows are differentiable: their backward is the unweighted
combine, so the autograd of ``routing_permute`` and ``routing_permute_both`` is registered in
``combine_ops`` (which imports this module; ``moe_fp8.routing`` imports both). FP8 codes and scales are
non-differentiable (they feed a GEMM whose autograd op owns the backward).
"""

from __future__ import annotations

import torch

from ..checks import check_tensor
from ..launch import launch
from ..quant.formats import Float8Format, resolve_format
from ..quant.reference import HIGH_PRECISION_DTYPES
from ..quant.kernels.common import format_constexprs
from ..kernel_backend import device_guard, use_triton
from ..launch_math import cdiv, next_power_of_2
from .permute_kernels import permute_rows_kernel
from .plan import DispatchPlan
from .reference import padding_scale, permute_quantize_reference, permute_reference

__all__ = ["permute", "permute_quantize", "permute_with_fp8", "launch_permute"]

_MAX_SINGLE_BLOCK = 8192  # widest row kept whole in registers; wider rows take two passes
_CHUNK = 4096
_PAD_ROWS_PER_PROGRAM = 16


def _num_warps(block: int) -> int:
    return 8 if block >= 4096 else 4


def _row_blocking(H: int) -> tuple[int, int]:
    """``(BLOCK_H, NUM_CHUNKS)`` for rows of ``H`` elements (module constants: tests shrink them)."""
    block = next_power_of_2(max(H, 1))
    if block <= _MAX_SINGLE_BLOCK:
        return block, 1
    return _CHUNK, cdiv(H, _CHUNK)


def launch_permute(
    x: torch.Tensor,
    pair_to_row: torch.Tensor,
    pad_rows: torch.Tensor,
    top_k: int,
    num_rows: int,
    fmt: Float8Format | None,
    pow2: bool = False,
    with_copy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Run the permute kernel (``fmt=None``: copy in ``x.dtype``; else quantize; ``with_copy`` (with
    ``fmt``): also copy in ``x.dtype``): ``(out, scale | None, copy | None)``."""
    T, H = x.shape
    quantize = fmt is not None
    out = torch.empty(num_rows, H, dtype=fmt.torch_dtype if quantize else x.dtype, device=x.device)
    scale = torch.empty(num_rows, dtype=torch.float32, device=x.device) if quantize else None
    copy = torch.empty(num_rows, H, dtype=x.dtype, device=x.device) if with_copy else None
    num_pad = pad_rows.numel()
    grid = T + cdiv(num_pad, _PAD_ROWS_PER_PROGRAM)
    if grid == 0 or H == 0:
        if quantize and num_rows:
            scale.fill_(padding_scale(fmt, pow2))
        return out, scale, copy
    block, chunks = _row_blocking(H)
    consts = format_constexprs(fmt if quantize else resolve_format("e4m3fn"), x.device)
    with device_guard(x):
        launch(permute_rows_kernel)[(grid,)](
            x, out, scale if quantize else x, copy if with_copy else x, pair_to_row, pad_rows,
            T, H, x.stride(0), num_pad, padding_scale(fmt, pow2) if quantize else 0.0,
            TOPK=top_k, BLOCK_H=block, NUM_CHUNKS=chunks, PAD_ROWS=_PAD_ROWS_PER_PROGRAM,
            QUANTIZE=quantize, WRITE_COPY=with_copy, POW2=pow2, num_warps=_num_warps(block), **consts,
        )
    return out, scale, copy


# --- bf16 permute (its autograd is registered in combine_ops) ---------------------------------
@torch.library.triton_op("moe_fp8::routing_permute", mutates_args=())
def _permute_op(
    x: torch.Tensor, pair_to_row: torch.Tensor, row_to_pair: torch.Tensor, pad_rows: torch.Tensor, top_k: int
) -> torch.Tensor:
    if not use_triton(permute_rows_kernel, x):
        return permute_reference(x, row_to_pair, top_k)
    return launch_permute(x, pair_to_row, pad_rows, top_k, row_to_pair.shape[0], None)[0]


@_permute_op.register_fake
def _(x, pair_to_row, row_to_pair, pad_rows, top_k):
    return x.new_empty(row_to_pair.shape[0], x.shape[1])


# --- fused permute + rowwise FP8 quantization ----------------------------------------------------
@torch.library.triton_op("moe_fp8::routing_permute_quantize", mutates_args=())
def _permute_quantize_op(
    x: torch.Tensor,
    pair_to_row: torch.Tensor,
    row_to_pair: torch.Tensor,
    pad_rows: torch.Tensor,
    top_k: int,
    fmt: str,
    pow2: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    f = resolve_format(fmt)
    if not use_triton(permute_rows_kernel, x):
        return permute_quantize_reference(x, row_to_pair, top_k, f, pow2)
    return launch_permute(x, pair_to_row, pad_rows, top_k, row_to_pair.shape[0], f, pow2)[:2]


@_permute_quantize_op.register_fake
def _(x, pair_to_row, row_to_pair, pad_rows, top_k, fmt, pow2):
    M = row_to_pair.shape[0]
    return x.new_empty(M, x.shape[1], dtype=resolve_format(fmt).torch_dtype), x.new_empty(M, dtype=torch.float32)


def _permute_quantize_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(*output)  # FP8 codes and scales carry no gradient


def _permute_quantize_backward(ctx, grad_q, grad_scale):
    return None, None, None, None, None, None, None


torch.library.register_autograd(
    "moe_fp8::routing_permute_quantize", _permute_quantize_backward, setup_context=_permute_quantize_setup
)


# --- both: the bf16 rows and their FP8 quantization from one read (autograd in combine_ops) ------
@torch.library.triton_op("moe_fp8::routing_permute_both", mutates_args=())
def _permute_both_op(
    x: torch.Tensor,
    pair_to_row: torch.Tensor,
    row_to_pair: torch.Tensor,
    pad_rows: torch.Tensor,
    top_k: int,
    fmt: str,
    pow2: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    f = resolve_format(fmt)
    if not use_triton(permute_rows_kernel, x):
        return permute_reference(x, row_to_pair, top_k), *permute_quantize_reference(x, row_to_pair, top_k, f, pow2)
    q, scale, rows = launch_permute(x, pair_to_row, pad_rows, top_k, row_to_pair.shape[0], f, pow2, with_copy=True)
    return rows, q, scale


@_permute_both_op.register_fake
def _(x, pair_to_row, row_to_pair, pad_rows, top_k, fmt, pow2):
    M = row_to_pair.shape[0]
    return (x.new_empty(M, x.shape[1]), x.new_empty(M, x.shape[1], dtype=resolve_format(fmt).torch_dtype),
            x.new_empty(M, dtype=torch.float32))


# --- public API ---------------------------------------------------------------------------------
def _checked(x: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """``x`` after checking it against ``plan``, with unit stride along H (the kernel's layout)."""
    check_tensor("x", x, dtypes=HIGH_PRECISION_DTYPES, ndim=2)
    if not isinstance(plan, DispatchPlan):
        raise TypeError(f"plan: expected DispatchPlan, got {type(plan).__name__}")
    if plan.pair_to_row.numel() != x.shape[0] * plan.top_k:
        raise ValueError(
            f"x: expected {plan.pair_to_row.numel() // plan.top_k} tokens (the plan's T), got shape {tuple(x.shape)}"
        )
    if plan.pair_to_row.device != x.device:
        raise ValueError(f"plan: expected tensors on {x.device} like x, got {plan.pair_to_row.device}")
    return x if x.stride(-1) == 1 else x.contiguous()


def permute(x: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Expert-sorted copy of the token rows (differentiable).

    Args:
        x: ``(T, H)`` bf16/fp16/fp32 (unit stride along H).
        plan: from :func:`make_dispatch_plan` for these ``T`` tokens.
    Returns:
        ``(M, H)`` in ``x.dtype``: row ``r`` is ``x[plan.row_to_pair[r] // k]``; padding rows 0.
    """
    x = _checked(x, plan)
    return _permute_op(x, plan.pair_to_row, plan.row_to_pair, plan.pad_rows, plan.top_k)


def permute_quantize(
    x: torch.Tensor, plan: DispatchPlan, fmt: Float8Format | str | torch.dtype | None = None, *, pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused permute + rowwise FP8 quantization (one launch; reads each token row once).

    Bit-identical to ``quantize_rowwise(permute(x, plan), fmt, pow2=pow2)``.

    Args:
        x: ``(T, H)`` bf16/fp16/fp32, finite.
        plan: from :func:`make_dispatch_plan`.
        fmt: FP8 format (``None``: detected for ``x``'s device).
    Returns:
        ``q`` ``(M, H)`` fp8 row-major and ``scale`` ``(M,)`` fp32 dequantization scales; padding
        rows are 0 with ``scale = padding_scale(fmt, pow2)`` (the scale of an all-zero row).
    """
    x = _checked(x, plan)
    f = resolve_format(fmt, x.device)
    return _permute_quantize_op(x, plan.pair_to_row, plan.row_to_pair, plan.pad_rows, plan.top_k, f.name, pow2)


def permute_with_fp8(
    x: torch.Tensor, plan: DispatchPlan, fmt: Float8Format | str | torch.dtype | None = None, *, pow2: bool = False
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``(permute(x, plan), permute_quantize(x, plan, fmt, pow2=pow2))`` from one launch that reads each
    token row once; the first is differentiable (as :func:`permute`), the FP8 pair is not. Same
    arguments and bytes as the two calls."""
    x = _checked(x, plan)
    f = resolve_format(fmt, x.device)
    rows, q, scale = _permute_both_op(x, plan.pair_to_row, plan.row_to_pair, plan.pad_rows, plan.top_k, f.name, pow2)
    return rows, (q, scale)
