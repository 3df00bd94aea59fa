"""Zero what a library grouped GEMM leaves undefined, without a host sync.

* Rows at or past ``offs[-1]`` of a 2D x 3D output: ``torch._scaled_grouped_mm`` and
  ``torch._grouped_mm`` on the GPU never write them (their content is whatever the allocator left
  there). The kernel reads ``offs[-1]`` on the device; every program whose row block lies wholly
  inside the groups exits after one load, so in the common case (``offs[-1] == M``) it costs one
  tiny launch.
* Empty groups of a 2D x 2D (wgrad) output ``(E, N, K)``: a group of no rows is an empty
  reduction, whose result a library GEMM does not promise to write (torch 2.13's CPU
  ``torch._scaled_mm`` returns uninitialised memory for one). The kernel reads each group's size on
  the device; the programs of non-empty groups exit after two loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import launch
from ..launch_math import cdiv

__all__ = ["launch_zero_empty_groups_kernel", "launch_zero_rows_kernel", "zero_empty_groups", "zero_rows_past_end"]


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
    launch(_zero_rows_past_end_kernel)[(cdiv(M, block_m),)](
        out, offs, offs.numel(), M, N, out.stride(0), BLOCK_M=block_m, BLOCK_N=128
    )
    return out


@triton.jit
def _zero_empty_groups_kernel(out_ptr, offs_ptr, numel_per_group, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
    g = tl.program_id(0)
    start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    end = tl.load(offs_ptr + g)
    if end <= start:
        base = out_ptr + g.to(tl.int64) * numel_per_group
        zeros = tl.zeros((BLOCK,), dtype=out_ptr.dtype.element_ty)
        for i0 in range(tl.program_id(1) * BLOCK, numel_per_group, PROGRAMS * BLOCK):
            idx = i0 + tl.arange(0, BLOCK)
            tl.store(base + idx, zeros, mask=idx < numel_per_group)


#: programs per group of the empty-group kernel: enough to fill an H200 when one group of a
#: large layer is empty, few enough that non-empty groups cost almost nothing.
_EMPTY_GROUP_PROGRAMS = 64


def zero_empty_groups(out: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """In place: ``out[g] = 0`` for every group ``g`` with no rows, for ``out (E, N, K)`` contiguous
    and ``offs (E,)`` int32 end offsets (group ``g`` is empty when ``offs[g] <= offs[g - 1]``);
    returns ``out``.

    GPU tensors: the Triton kernel above. CPU tensors: a masked fill.
    """
    if out.numel() == 0:
        return out
    if not out.is_cuda:
        sizes = torch.diff(offs, prepend=offs.new_zeros(1))
        return out.masked_fill_((sizes <= 0)[:, None, None], 0)
    return launch_zero_empty_groups_kernel(out, offs)


def launch_zero_empty_groups_kernel(out: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The Triton path of :func:`zero_empty_groups` (also on CPU under ``TRITON_INTERPRET=1``)."""
    if not out.is_contiguous() or out.dim() != 3 or out.shape[0] != offs.numel():
        raise ValueError(f"out: expected a contiguous (E={offs.numel()}, N, K) tensor, got shape "
                         f"{tuple(out.shape)} strides {out.stride()}")
    E, N, K = out.shape
    launch(_zero_empty_groups_kernel)[(E, _EMPTY_GROUP_PROGRAMS)](
        out, offs, N * K, BLOCK=1024, PROGRAMS=_EMPTY_GROUP_PROGRAMS
    )
    return out
