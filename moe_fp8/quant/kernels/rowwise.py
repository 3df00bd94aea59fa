"""Row-wise FP8 quantization: one scale per row, amax over the last dim, in one launch.

Serves ``quantize_rowwise`` (``(M, K)``: activations, grad_output) and the forward expert layout
of ``quantize_expert_colwise`` (``(E, N, K)`` seen as ``E * N`` rows of ``K``). Row ``r`` of the
input lives at ``(r // rows_per_group) * stride_g + (r % rows_per_group) * stride_r``, so 3D
weights need no copy; the output is always row-major contiguous.

When a whole row fits in registers (``K <= 16384``) each program loads its rows once, reduces,
and writes: one HBM read and one write per element. Longer rows take two passes over ``K`` (the
second pass re-reads the program's rows, which are still in L2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...launch_math import cdiv, next_power_of_2
from ..formats import Float8Format
from ..triton_helpers import fp8_scales
from .common import format_constexprs, to_fp8

__all__ = ["rowwise_block", "rowwise_config", "launch_rowwise"]

# Largest row held in registers in one piece; longer rows loop over K twice.
MAX_SINGLE_PASS_K = 16384
# Elements per program tile (rows x padded K) and per loop step of the two-pass path. Measured on
# one H200 (2026-11): 4096 with 4 warps ties 8192 with 8 warps on K = 7168 and beats it on K = 5120.
TILE_ELEMENTS = 4096


@triton.jit
def rowwise_block(
    x_ptr,
    q_ptr,
    s_ptr,
    pid,
    M,
    K,
    rows_per_group,
    stride_g,
    stride_r,
    stride_k,
    POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):
    """Quantize rows ``[pid * BLOCK_M, (pid + 1) * BLOCK_M)``: q row-major ``(M, K)``, scale ``(M,)``."""
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    in_row = (rows // rows_per_group).to(tl.int64) * stride_g + (rows % rows_per_group).to(tl.int64) * stride_r
    out_row = rows.to(tl.int64) * K
    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + in_row[:, None] + cols.to(tl.int64)[None, :] * stride_k, mask=mask, other=0.0)
        x = x.to(tl.float32)
        inv_scale, scale = fp8_scales(tl.max(tl.abs(x), axis=1), FP8_MAX, POW2)
        q = to_fp8(x, inv_scale[:, None], OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE,
                   FP8_NEG_ZERO)
        tl.store(q_ptr + out_row[:, None] + cols[None, :], q, mask=mask)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = row_ok[:, None] & (cols < K)[None, :]
            x = tl.load(x_ptr + in_row[:, None] + cols.to(tl.int64)[None, :] * stride_k, mask=mask, other=0.0)
            acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
        inv_scale, scale = fp8_scales(tl.max(acc, axis=1), FP8_MAX, POW2)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = row_ok[:, None] & (cols < K)[None, :]
            x = tl.load(x_ptr + in_row[:, None] + cols.to(tl.int64)[None, :] * stride_k, mask=mask, other=0.0)
            q = to_fp8(x, inv_scale[:, None], OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE,
                   FP8_NEG_ZERO)
            tl.store(q_ptr + out_row[:, None] + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows, scale, mask=row_ok)


@triton.jit
def _rowwise_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    rows_per_group,
    stride_g,
    stride_r,
    stride_k,
    POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):
    rowwise_block(x_ptr, q_ptr, s_ptr, tl.program_id(0), M, K, rows_per_group, stride_g, stride_r, stride_k,
                  POW2, BLOCK_M, BLOCK_K, SINGLE_PASS, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL,
                  FP8_SUB_SCALE, FP8_NEG_ZERO)


def rowwise_config(M: int, K: int, tile: int = TILE_ELEMENTS, num_warps: int | None = None) -> dict:
    """Block sizes for ``M`` rows of ``K`` (static shapes only: never the token count's value).

    Returns ``BLOCK_M``, ``BLOCK_K``, ``SINGLE_PASS`` (constexprs) and ``num_warps``.
    """
    padded_k = next_power_of_2(max(K, 16))
    if padded_k <= MAX_SINGLE_PASS_K:
        block_k, single = padded_k, True
        block_m = max(1, min(tile // block_k, next_power_of_2(M)))
    else:
        block_k, single, block_m = 2048, False, max(1, tile // 2048)
    warps = num_warps or (8 if block_m * block_k > 8192 else 4)
    return dict(BLOCK_M=block_m, BLOCK_K=block_k, SINGLE_PASS=single, num_warps=warps)


def launch_rowwise(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    fmt: Float8Format,
    pow2: bool,
    *,
    M: int,
    K: int,
    rows_per_group: int,
    stride_g: int,
    stride_r: int,
    stride_k: int,
    config: dict | None = None,
    hw_cast: bool | None = None,
) -> None:
    """Fill ``q`` (``M * K`` row-major elements) and ``scale`` (``M``) from ``x`` (see the module docstring)."""
    if M == 0:
        return
    cfg = config or rowwise_config(M, K)
    grid = (cdiv(M, cfg["BLOCK_M"]),)
    _rowwise_kernel[grid](
        x, q, scale, M, K, max(rows_per_group, 1), stride_g, stride_r, stride_k,
        POW2=bool(pow2), **cfg, **format_constexprs(fmt, x.device, hw_cast),
    )
