"""Block-scaled FP8 quantization (DeepSeek-V3 style): 1 x 128 activations, 128 x 128 weights.

``x (..., R, C)`` (2D or 3D) -> ``q`` same shape contiguous, ``scale (..., ceil(R/br), ceil(C/bc))``.
A program holds one tile in registers: ``TILE_R x bc`` with one scale per row when ``br == 1``,
or the whole ``br x bc`` block; one read and one write per element. Edge blocks are partial.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...launch import launch
from ...launch_math import cdiv, next_power_of_2
from ..formats import Float8Format
from ..triton_helpers import fp8_scales
from .common import format_constexprs, to_fp8

__all__ = ["MAX_BLOCK_ELEMENTS", "supported_block", "launch_blockwise"]

# Largest block (br * bc) a program holds in registers.
MAX_BLOCK_ELEMENTS = 16384
_ROW_TILE_ELEMENTS = 4096


@triton.jit
def _blockwise_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    R,
    C,
    n_row_tiles,
    n_col_blocks,
    scale_rows,
    stride_xb,
    stride_xr,
    stride_xc,
    POW2: tl.constexpr,
    TILE_R: tl.constexpr,
    ROW_SCALES: tl.constexpr,
    BLOCK_C: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):
    pid = tl.program_id(0)
    cb = pid % n_col_blocks
    rt = (pid // n_col_blocks) % n_row_tiles
    batch = (pid // n_col_blocks // n_row_tiles).to(tl.int64)
    rows = rt * TILE_R + tl.arange(0, TILE_R)
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < R
    mask = row_ok[:, None] & (cols < C)[None, :]
    src = x_ptr + batch * stride_xb + rows.to(tl.int64)[:, None] * stride_xr + cols.to(tl.int64)[None, :] * stride_xc
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    s_batch = s_ptr + batch * scale_rows * n_col_blocks
    if ROW_SCALES:  # block (1, BLOCK_C): one scale per row of the tile
        inv_scale, scale = fp8_scales(tl.max(tl.abs(x), axis=1), FP8_MAX, POW2)
        q = to_fp8(x, inv_scale[:, None], OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE,
                   FP8_NEG_ZERO)
        tl.store(s_batch + rows.to(tl.int64) * n_col_blocks + cb, scale, mask=row_ok)
    else:  # block (TILE_R, BLOCK_C): one scale for the tile
        inv_scale, scale = fp8_scales(tl.max(tl.max(tl.abs(x), axis=1), axis=0), FP8_MAX, POW2)
        q = to_fp8(x, inv_scale, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)
        tl.store(s_batch + rt * n_col_blocks + cb, scale)
    dst = q_ptr + batch * R * C + rows.to(tl.int64)[:, None] * C + cols[None, :]
    tl.store(dst, q, mask=mask)


def supported_block(block) -> bool:
    """Whether the kernel takes ``block = (br, bc)``: powers of two, ``bc >= 16``, ``br * bc <= 16384``."""
    br, bc = block
    pow2 = all(isinstance(v, int) and v >= 1 and v & (v - 1) == 0 for v in (br, bc))
    return pow2 and bc >= 16 and br * bc <= MAX_BLOCK_ELEMENTS


def _num_warps(br: int, tile_elements: int) -> int:
    """4 warps for a whole block (``br > 1``): 128 x 128 blocks of bf16 weights run at 98-102% of
    copy bandwidth on one H200 with 4, at 70-72% with 8 (2026-11-30,
    ``benchmarks/results/blockwise_warps.md``). Row tiles (``br == 1``): 8 from 8192 elements."""
    return 8 if br == 1 and tile_elements >= 8192 else 4


def launch_blockwise(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, fmt: Float8Format, pow2: bool,
                     block: tuple[int, int], hw_cast: bool | None = None) -> None:
    """``x (B?, R, C)`` -> ``q`` contiguous, ``scale (B?, ceil(R/br), ceil(C/bc))`` contiguous."""
    br, bc = block
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    B, R, C = x3.shape
    if B * R * C == 0:  # no elements, hence no blocks and no scales
        return
    tile_r = br if br > 1 else max(1, min(_ROW_TILE_ELEMENTS // bc, next_power_of_2(R)))
    n_row_tiles, n_col_blocks = cdiv(R, tile_r), cdiv(C, bc)
    grid = (B * n_row_tiles * n_col_blocks,)
    launch(_blockwise_kernel)[grid](
        x3, q, scale, R, C, n_row_tiles, n_col_blocks, cdiv(R, br), x3.stride(0), x3.stride(1), x3.stride(2),
        POW2=bool(pow2), TILE_R=tile_r, ROW_SCALES=br == 1, BLOCK_C=bc,
        num_warps=_num_warps(br, tile_r * bc), **format_constexprs(fmt, x.device, hw_cast),
    )
