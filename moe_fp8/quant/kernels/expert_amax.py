"""Both amaxes of expert weights from one read: over K per expert row, over N per expert column.

``w (E, N, K)`` (any strides) gives ``row_amax (E, N)``, what the forward layout's scales come from,
and ``col_amax (E, K)``, what the dgrad layout's come from: everything a GEMM that quantizes the
weight's tiles as it reads them needs, with nothing FP8 written. Program ``(e, j)`` holds strips of
whole rows in registers (``K <= 16384``), stores their row amaxes and merges their column amax into
``col_amax`` by one relaxed atomic max per column (the fp32 bits as int32: amaxes are >= 0, so the
integers order like the floats).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...launch import launch
from ...launch_math import cdiv
from .rowwise import ROW_STAGES, expert_strips

__all__ = ["launch_expert_amax"]


@triton.jit
def _expert_amax_kernel(
    w_ptr,
    row_ptr,
    col_ptr,
    N,
    K,
    stride_g,
    stride_r,
    stride_k,
    ROWS: tl.constexpr,
    STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program ``(expert e, strip j)``: rows ``[j * ROWS, (j + 1) * ROWS)`` of expert ``e``."""
    e = tl.program_id(0)
    r0 = tl.program_id(1) * ROWS
    cols = tl.arange(0, BLOCK_K)
    col_ok = cols < K
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for i in tl.range(0, ROWS, BLOCK_M, num_stages=STAGES):
        r = r0 + i + tl.arange(0, BLOCK_M)
        row_ok = r < N
        in_row = e.to(tl.int64) * stride_g + r.to(tl.int64) * stride_r
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(w_ptr + in_row[:, None] + cols.to(tl.int64)[None, :] * stride_k, mask=mask, other=0.0)
        ax = tl.abs(x.to(tl.float32))
        tl.store(row_ptr + e * N + r, tl.max(ax, axis=1), mask=row_ok)
        acc = tl.maximum(acc, ax)
    bits = tl.max(acc, axis=0).to(tl.int32, bitcast=True)
    tl.atomic_max(col_ptr + e * K + cols, bits, mask=col_ok, sem="relaxed")


def launch_expert_amax(
    w: torch.Tensor,
    row_amax: torch.Tensor,
    col_amax_bits: torch.Tensor,
    *,
    rows_per_program: int | None = None,
    num_warps: int | None = None,
    stages: int = ROW_STAGES,
    tile: int | None = None,
) -> None:
    """Fill ``row_amax (E, N)`` fp32 contiguous with ``w``'s amax over K and merge its amax over N
    into ``col_amax_bits (E, K)`` int32 (fp32 bits; pass zeros). ``K`` at most 16384
    (``rowwise.col_amax_fits``); ``rows_per_program`` as in ``launch_expert_rowwise_col_amax``."""
    E, N, K = w.shape
    cfg, rows = expert_strips(E, N, K, w.element_size(), rows_per_program, tile, num_warps)
    if E * N == 0:
        return
    launch(_expert_amax_kernel)[(E, cdiv(N, rows))](
        w, row_amax, col_amax_bits, N, K, w.stride(0), w.stride(1), w.stride(2), ROWS=rows, STAGES=stages, **cfg,
    )
