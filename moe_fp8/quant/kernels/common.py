"""Pieces shared by the kernel families: the final FP8 cast, format constexprs, device facts.

The cast. ``fp8_quantize`` (:mod:`moe_fp8.quant.triton_helpers`) pre-rounds ``x * inv_scale`` onto
the FP8 grid in fp32 so that the final cast is exact everywhere, the CPU interpreter included
(whose own cast is wrong). That costs ~20 integer/float instructions per element, which is about
what the SMs can execute while HBM streams 3 bytes per element: it makes the kernels ALU-bound.
On NVIDIA GPUs of compute capability >= 8.9 Triton lowers the fp32 -> e4m3/e5m2 cast to
``cvt.rn.satfinite`` (IEEE round to nearest even, subnormals kept, -0 kept), the very rounding
torch applies, so there the kernels cast the clamped product directly (``HW_CAST``); the GPU tests
check both paths byte for byte against the reference. Everywhere else (the interpreter, ROCm,
older GPUs) they pre-round.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...kernel_backend import launch_target
from ..formats import Float8Format
from ..triton_helpers import fp8_constexprs, fp8_quantize

__all__ = ["to_fp8", "max_combine", "group_ends", "hardware_cast_is_exact", "format_constexprs",
           "multiprocessor_count"]


@triton.jit
def max_combine(a, b):
    """``tl.associative_scan``'s combine for a running maximum (group end offsets)."""
    return tl.maximum(a, b)


@triton.jit
def group_ends(offs, rows):
    """The int32 end offsets ``offs`` (lanes past the groups loaded as 0) clamped to ``[0, rows]`` and
    made non-decreasing: their running maximum, so lanes past the groups repeat the last end. Every
    kernel that splits rows into jagged groups uses these ends, so bad offsets move rows between
    groups the same way everywhere and never address rows outside ``[0, rows)``. The caller loads
    ``offs``: torch's analysis of a traced launch counts a pointer handed to a helper as written."""
    return tl.associative_scan(tl.minimum(tl.maximum(offs, 0), rows), 0, max_combine)


@triton.jit
def to_fp8(
    x,
    inv_scale,
    OUT_DTYPE: tl.constexpr,
    HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):
    """``clamp(x * inv_scale, +-max)`` rounded to nearest even, as ``OUT_DTYPE`` (see the module docstring)."""
    if HW_CAST:
        y = x.to(tl.float32) * inv_scale
        return tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX).to(OUT_DTYPE)
    else:
        q = fp8_quantize(x, inv_scale, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)
        return q.to(OUT_DTYPE)


def hardware_cast_is_exact(device: torch.device) -> bool:
    """Whether Triton's fp32 -> fp8 cast on ``device`` is the reference's rounding (NVIDIA sm89+)."""
    target = launch_target(device)
    return target.kind == "cuda" and target.arch >= (8, 9)


def format_constexprs(fmt: Float8Format, device: torch.device, hw_cast: bool | None = None) -> dict:
    """``OUT_DTYPE``, ``HW_CAST`` and the rounding constexprs of ``fmt`` (``**`` them into a launch).

    ``hw_cast=None`` picks the direct cast where it is exact (:func:`hardware_cast_is_exact`).
    """
    if hw_cast is None:
        hw_cast = hardware_cast_is_exact(device)
    return dict(OUT_DTYPE=fmt.triton_dtype, HW_CAST=bool(hw_cast), **fp8_constexprs(fmt))


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors (CUs on ROCm) of ``device``; a small constant on the CPU."""
    return launch_target(device).multiprocessors
