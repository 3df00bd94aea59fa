"""Zero the output rows at or past ``offs[-1]`` without a host sync.

``torch._scaled_grouped_mm`` and ``torch._grouped_mm`` on the GPU never write the rows past the
last group (their content is whatever the allocator left there). This kernel reads ``offs[-1]``
on the device; every program whose row block lies wholly inside the groups exits after one load,
so in the common case (``offs[-1] == M``) it costs one tiny launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch_math import cdiv

__all__ = ["launch_zero_rows_kernel", "zero_rows_past_end"]


@triton.jit
def _zero_rows_past_end_kernel(out_ptr, offs_ptr, num_groups, num_rows, num_cols, stride_row,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    end = tl.load(offs_ptr + num_groups - 1)
    row0 = pid * BLOCK_M
    if row0 + BLOCK_M > end:
        rows = row0 + tl.arange(0, BLOCK_M)
        row_mask = (rows >= end) & (rows < num_rows)
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
        for n0 in range(0, num_cols, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_row + cols[None, :]
            tl.store(ptrs, zeros, mask=row_mask[:, None] & (cols[None, :] < num_cols))


def zero_rows_past_end(out: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """In place: ``out[offs[-1]:] = 0`` for ``out (M, N)``; returns ``out``.

    GPU tensors: the Triton kernel above (unit column stride). CPU tensors: a masked fill.
    """
    M, N = out.shape
    if M == 0 or N == 0:
        return out
    if not out.is_cuda:
        rows = torch.arange(M, device=out.device)
        return out.masked_fill_((rows >= offs[-1])[:, None], 0)
    return launch_zero_rows_kernel(out, offs)


def launch_zero_rows_kernel(out: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The Triton path of :func:`zero_rows_past_end` (also on CPU under ``TRITON_INTERPRET=1``)."""
    M, N = out.shape
    if out.stride(1) != 1:
        raise ValueError(f"out: expected unit column stride, got strides {out.stride()}")
    block_m = 32
    _zero_rows_past_end_kernel[(cdiv(M, block_m),)](
        out, offs, offs.numel(), M, N, out.stride(0), BLOCK_M=block_m, BLOCK_N=128
    )
    return out
