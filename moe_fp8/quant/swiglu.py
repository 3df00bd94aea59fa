"""Fused SwiGLU + rowwise FP8 quantization (forward) and the SwiGLU backward, in Triton.

The expert MLP computes ``a = silu(gate) * up`` from the gate/up projection ``h = [gate | up]``
``(M, 2I)`` and feeds ``a`` to the down projection, whose FP8 GEMM wants ``a`` quantized per
row. One launch reads ``h`` once and writes ``a`` in bf16 (kept for the down projection's
weight gradient), its FP8 rows and their scales. The backward kernel reads ``h`` and ``grad_a``
once and writes ``grad_h``; its quantizing form also writes ``grad_h``'s FP8 rows and scales,
which the gate/up projection's dgrad takes (the bf16 ``grad_h`` feeds its BF16 weight gradient).

Numerics: ``a`` is computed in fp32 and rounded once to ``h``'s dtype; its FP8 rows follow
``moe_fp8.quant.reference.quantize_rowwise`` exactly (same bytes and scales as quantizing the
returned ``a``); so do ``grad_h``'s. ``silu`` uses the hardware ``exp``, so ``a`` may differ from
torch's in the last bit. Rows are independent: ``M`` may be anything, including 0. On a CPU
without the Triton interpreter the functions run the same math in plain torch. All are
``torch.library.triton_op`` s (``moe_fp8::swiglu_quantize``, ``moe_fp8::swiglu_backward``,
``moe_fp8::swiglu_backward_quantize``) with fake kernels, so ``torch.compile`` traces them down
to their kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_tensor
from ..kernel_backend import device_guard, eager_triton_op, use_triton
from ..launch import launch
from ..launch_math import cdiv, next_power_of_2
from .formats import resolve_format
from .reference import HIGH_PRECISION_DTYPES, quantize_rowwise
from .kernels.common import format_constexprs, to_fp8
from .triton_helpers import fp8_scales

__all__ = [
    "SwiGLUQuantize", "swiglu_quantize", "swiglu_backward", "swiglu_backward_quantize", "swiglu_reference",
    "swiglu_backward_reference",
]


def swiglu_reference(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in fp32, rounded to ``h``'s dtype; ``h`` is ``(M, 2I)`` = ``[gate | up]``."""
    gate, up = h.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(h.dtype)


def swiglu_backward_reference(h: torch.Tensor, grad_a: torch.Tensor) -> torch.Tensor:
    """``(M, 2I)`` gradient of ``silu(gate) * up`` w.r.t. ``h = [gate | up]`` given ``grad_a (M, I)``, in
    fp32, rounded to ``h``'s dtype."""
    gate, up = h.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    g = grad_a.float()
    return torch.cat([g * up * sig * (1 + gate * (1 - sig)), g * gate * sig], dim=-1).to(h.dtype)


@triton.jit
def _silu_mul(gate, up):
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _quantize_written_rows(
    src_row, q_row, row_ok, width, inv_scale, BLOCK: tl.constexpr, OUT_DTYPE: tl.constexpr, HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):
    """Columns ``[0, width)`` of the rows ``src_row`` (pointers ``(BLOCK_M, 1)``, just written by this
    program, so in L2) quantized with ``inv_scale (BLOCK_M,)`` into the rows ``q_row``."""
    for c0 in range(0, width, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = row_ok[:, None] & (cols < width)[None, :]
        v = tl.load(src_row + cols[None, :], mask=mask, other=0.0)
        q = to_fp8(v, inv_scale[:, None], OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE,
                   FP8_NEG_ZERO)
        tl.store(q_row + cols[None, :], q, mask=mask)


@triton.jit
def _swiglu_quant_kernel(
    h_ptr, a_ptr, q_ptr, scale_ptr, M, I, stride_h, stride_a, stride_q,
    POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
    OUT_DTYPE: tl.constexpr, HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr, FP8_NEG_ZERO: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Pass 1: a = silu(gate) * up, written in the output dtype; amax over the rounded values.
    for i0 in range(0, I, BLOCK_I):
        cols = i0 + tl.arange(0, BLOCK_I)
        mask = row_ok[:, None] & (cols < I)[None, :]
        h_row = h_ptr + rows64[:, None] * stride_h + cols[None, :]
        gate = tl.load(h_row, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_row + I, mask=mask, other=0.0).to(tl.float32)
        a = _silu_mul(gate, up).to(a_ptr.dtype.element_ty)
        tl.store(a_ptr + rows64[:, None] * stride_a + cols[None, :], a, mask=mask)
        amax = tl.maximum(amax, tl.max(tl.abs(a.to(tl.float32)), axis=1))
    inv_scale, scale = fp8_scales(amax, FP8_MAX, POW2)
    tl.store(scale_ptr + rows64, scale, mask=row_ok)
    # Pass 2: re-read the rounded a (just written, in L2) and quantize it.
    _quantize_written_rows(a_ptr + rows64[:, None] * stride_a, q_ptr + rows64[:, None] * stride_q, row_ok, I,
                           inv_scale, BLOCK_I, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE,
                           FP8_NEG_ZERO)


@triton.jit
def _swiglu_grads(h_row, grad_a_row, cols, mask, I):
    """fp32 ``(d gate, d up)`` of ``silu(gate) * up`` at the columns ``cols`` of rows ``h_row``."""
    gate = tl.load(h_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_row + I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    grad_a = tl.load(grad_a_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    silu = gate * sig
    return grad_a * up * (sig + silu * (1.0 - sig)), grad_a * silu


@triton.jit
def _swiglu_bwd_kernel(
    h_ptr, grad_a_ptr, grad_h_ptr, M, I, stride_h, stride_ga, stride_gh,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < M)[:, None] & (cols < I)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    grad_gate, grad_up = _swiglu_grads(h_ptr + rows64 * stride_h, grad_a_ptr + rows64 * stride_ga, cols, mask, I)
    out = grad_h_ptr + rows64 * stride_gh + cols[None, :]
    tl.store(out, grad_gate.to(grad_h_ptr.dtype.element_ty), mask=mask)
    tl.store(out + I, grad_up.to(grad_h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_quant_kernel(
    h_ptr, grad_a_ptr, grad_h_ptr, q_ptr, scale_ptr, M, I, stride_h, stride_ga, stride_gh, stride_q,
    POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
    OUT_DTYPE: tl.constexpr, HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr, FP8_NEG_ZERO: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)[:, None]
    h_row, grad_a_row = h_ptr + rows64 * stride_h, grad_a_ptr + rows64 * stride_ga
    gh_row, q_row = grad_h_ptr + rows64 * stride_gh, q_ptr + rows64 * stride_q
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Pass 1: grad_h = [d gate | d up], written in h's dtype; amax over the rounded values.
    for i0 in range(0, I, BLOCK_I):
        cols = i0 + tl.arange(0, BLOCK_I)
        mask = row_ok[:, None] & (cols < I)[None, :]
        grad_gate, grad_up = _swiglu_grads(h_row, grad_a_row, cols, mask, I)
        grad_gate = grad_gate.to(grad_h_ptr.dtype.element_ty)
        grad_up = grad_up.to(grad_h_ptr.dtype.element_ty)
        tl.store(gh_row + cols[None, :], grad_gate, mask=mask)
        tl.store(gh_row + I + cols[None, :], grad_up, mask=mask)
        amax = tl.maximum(amax, tl.max(tl.abs(grad_gate.to(tl.float32)), axis=1))
        amax = tl.maximum(amax, tl.max(tl.abs(grad_up.to(tl.float32)), axis=1))
    inv_scale, scale = fp8_scales(amax, FP8_MAX, POW2)
    tl.store(scale_ptr + rows, scale, mask=row_ok)
    # Pass 2: re-read the rounded grad_h (just written, in L2) and quantize it, both halves.
    _quantize_written_rows(gh_row, q_row, row_ok, 2 * I, inv_scale, BLOCK_I, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT,
                           FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)


def _check_h(h: torch.Tensor) -> int:
    check_tensor("h", h, dtypes=HIGH_PRECISION_DTYPES, ndim=2)
    if h.shape[1] % 2:
        raise ValueError(f"h: expected an even last dim (gate and up halves), got shape {tuple(h.shape)}")
    if h.stride(1) != 1:
        raise ValueError("h: expected unit stride along the last dim")
    return h.shape[1] // 2


def _blocks(I: int) -> tuple[int, int]:
    block_i = min(next_power_of_2(max(I, 16)), 1024)
    return max(1, 2048 // block_i), block_i


@eager_triton_op("moe_fp8::swiglu_quantize")
def _swiglu_quantize_op(h: torch.Tensor, fmt: str, pow2: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    f = resolve_format(fmt)
    I = h.shape[1] // 2
    M = h.shape[0]
    if not use_triton(_swiglu_quant_kernel, h):
        a = swiglu_reference(h)
        return (a, *quantize_rowwise(a, f, pow2=pow2))
    a = torch.empty(M, I, device=h.device, dtype=h.dtype)
    q = torch.empty(M, I, device=h.device, dtype=f.torch_dtype)
    scale = torch.empty(M, device=h.device, dtype=torch.float32)
    if M:
        block_m, block_i = _blocks(I)
        with device_guard(h):
            launch(_swiglu_quant_kernel)[(cdiv(M, block_m),)](
                h, a, q, scale, M, I, h.stride(0), a.stride(0), q.stride(0),
                POW2=pow2, BLOCK_M=block_m, BLOCK_I=block_i, **format_constexprs(f, h.device),
            )
    return a, q, scale


@_swiglu_quantize_op.register_fake
def _(h, fmt, pow2):
    M, I = h.shape[0], h.shape[1] // 2
    return h.new_empty(M, I), h.new_empty(M, I, dtype=resolve_format(fmt).torch_dtype), h.new_empty(M, dtype=torch.float32)


@eager_triton_op("moe_fp8::swiglu_backward")
def _swiglu_backward_op(h: torch.Tensor, grad_a: torch.Tensor) -> torch.Tensor:
    M, I = h.shape[0], h.shape[1] // 2
    if not use_triton(_swiglu_bwd_kernel, h):
        return swiglu_backward_reference(h, grad_a)
    grad_h = torch.empty_like(h)
    if M:
        block_m, block_i = _blocks(min(I, 128))
        grid = (cdiv(M, block_m), cdiv(I, block_i))
        with device_guard(h):
            launch(_swiglu_bwd_kernel)[grid](h, grad_a, grad_h, M, I, h.stride(0), grad_a.stride(0), grad_h.stride(0),
                                     BLOCK_M=block_m, BLOCK_I=block_i)
    return grad_h


@_swiglu_backward_op.register_fake
def _(h, grad_a):
    return torch.empty_like(h)


@eager_triton_op("moe_fp8::swiglu_backward_quantize")
def _swiglu_backward_quantize_op(
    h: torch.Tensor, grad_a: torch.Tensor, fmt: str, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    f = resolve_format(fmt)
    M, I = h.shape[0], h.shape[1] // 2
    if not use_triton(_swiglu_bwd_quant_kernel, h):
        grad_h = swiglu_backward_reference(h, grad_a)
        return (grad_h, *quantize_rowwise(grad_h, f, pow2=pow2))
    grad_h = torch.empty_like(h)
    q = torch.empty(M, 2 * I, device=h.device, dtype=f.torch_dtype)
    scale = torch.empty(M, device=h.device, dtype=torch.float32)
    if M:
        block_m, block_i = _blocks(I)
        with device_guard(h):
            launch(_swiglu_bwd_quant_kernel)[(cdiv(M, block_m),)](
                h, grad_a, grad_h, q, scale, M, I, h.stride(0), grad_a.stride(0), grad_h.stride(0), q.stride(0),
                POW2=pow2, BLOCK_M=block_m, BLOCK_I=block_i, **format_constexprs(f, h.device),
            )
    return grad_h, q, scale


@_swiglu_backward_quantize_op.register_fake
def _(h, grad_a, fmt, pow2):
    return torch.empty_like(h), h.new_empty(h.shape, dtype=resolve_format(fmt).torch_dtype), \
        h.new_empty(h.shape[0], dtype=torch.float32)


def swiglu_quantize(h: torch.Tensor, fmt=None, *, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused ``a = silu(gate) * up`` and rowwise FP8 quantization of ``a``.

    Args:
        h: ``(M, 2I)`` bf16/fp16/fp32, ``[gate | up]`` along the last dim, unit last stride.
        fmt: FP8 format (default: detected for ``h``'s device).
    Returns:
        ``a`` ``(M, I)`` in ``h``'s dtype, ``q`` ``(M, I)`` row-major fp8, ``scale`` ``(M,)`` fp32.
    """
    _check_h(h)
    return _swiglu_quantize_op(h, resolve_format(fmt, h.device).name, pow2)


def _checked_grad_a(h: torch.Tensor, grad_a: torch.Tensor) -> torch.Tensor:
    check_tensor("grad_a", grad_a, dtypes=HIGH_PRECISION_DTYPES, shape=(h.shape[0], _check_h(h)))
    return grad_a if grad_a.stride(1) == 1 else grad_a.contiguous()


def swiglu_backward(h: torch.Tensor, grad_a: torch.Tensor) -> torch.Tensor:
    """Gradient of ``silu(gate) * up`` w.r.t. ``h = [gate | up]``: ``(M, 2I)`` in ``h``'s dtype."""
    return _swiglu_backward_op(h, _checked_grad_a(h, grad_a))


def swiglu_backward_quantize(
    h: torch.Tensor, grad_a: torch.Tensor, fmt=None, *, pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`swiglu_backward` and the rowwise FP8 quantization of its result, in one launch.

    Args:
        h: ``(M, 2I)`` bf16/fp16/fp32, ``[gate | up]``, unit last stride; ``grad_a``: ``(M, I)``.
        fmt: FP8 format (default: detected for ``h``'s device).
    Returns:
        ``grad_h`` ``(M, 2I)`` in ``h``'s dtype (the same bits as :func:`swiglu_backward`),
        ``q`` ``(M, 2I)`` row-major fp8 and ``scale`` ``(M,)`` fp32: exactly
        ``quantize_rowwise(grad_h)``.
    """
    grad_a = _checked_grad_a(h, grad_a)
    return _swiglu_backward_quantize_op(h, grad_a, resolve_format(fmt, h.device).name, pow2)


class SwiGLUQuantize(torch.autograd.Function):
    """``apply(h, fmt, pow2) -> (a, q, scale)``: :func:`swiglu_quantize` with autograd through ``a``.

    ``q`` and ``scale`` (the FP8 rows of ``a``) are non-differentiable outputs for the next FP8
    GEMM; the gradient reaches ``h`` through ``a`` only (via :func:`swiglu_backward`). ``h`` is
    saved for backward, as eager PyTorch's SwiGLU does.
    """

    @staticmethod
    def forward(ctx, h, fmt, pow2):
        a, q, scale = swiglu_quantize(h, fmt, pow2=pow2)
        ctx.save_for_backward(h)
        ctx.mark_non_differentiable(q, scale)
        ctx.set_materialize_grads(False)  # no zero gradients made for q and scale
        return a, q, scale

    @staticmethod
    def backward(ctx, grad_a, _grad_q, _grad_scale):
        if grad_a is None:  # a took no part in what is differentiated
            return None, None, None
        (h,) = ctx.saved_tensors
        return swiglu_backward(h, grad_a), None, None
