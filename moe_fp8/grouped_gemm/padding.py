"""Token groups padded to 16-row boundaries, computed on the device (no host sync).

``torch._scaled_grouped_mm``'s 2D x 2D (wgrad) form needs every group but the last to hold a
multiple of 16 rows (a device-side assert otherwise) and the total row count to be a multiple of
16 (the bf16 ``torch._grouped_mm`` needs multiples of 8). Group sizes live on the device, so the
padded layout is computed there too, inside a buffer whose row count is a static upper bound:
``padded_rows(M, E) = round_up(M + 15 E, 16)`` >= ``sum_g round_up(size_g, 16)``.
"""

from __future__ import annotations

import torch

__all__ = ["ALIGN", "padded_rows", "padded_offsets", "padded_row_index", "scatter_rows_padded"]

ALIGN = 16


def padded_rows(num_rows: int, num_groups: int) -> int:
    """Static row count of a buffer that holds any grouping of ``num_rows`` rows padded to 16."""
    return -(-(num_rows + (ALIGN - 1) * num_groups) // ALIGN) * ALIGN


def padded_offsets(offs: torch.Tensor) -> torch.Tensor:
    """``(E,)`` int32 end offsets of the groups of ``offs`` each rounded up to 16 rows (on device)."""
    o = offs.to(torch.int64)
    sizes = torch.diff(o, prepend=o.new_zeros(1))
    return torch.cumsum((sizes + ALIGN - 1) // ALIGN * ALIGN, 0).to(torch.int32)


def padded_row_index(offs: torch.Tensor, padded_offs: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Destination row ``(num_rows,)`` int64 of every source row in the padded layout.

    Row ``i`` of group ``g`` goes to ``padded_start[g] + (i - start[g])``. Rows at or past
    ``offs[-1]`` (in no group) go to ``padded_offs[-1] + (i - offs[-1])``: past every padded
    group, so no GEMM reads them, and still inside ``padded_rows(num_rows, E)``.
    """
    o = offs.to(torch.int64)
    p = padded_offs.to(torch.int64)
    zero = o.new_zeros(1)
    starts = torch.cat([zero, o])  # group E (the tail) starts at offs[-1]
    pstarts = torch.cat([zero, p])
    rows = torch.arange(num_rows, device=offs.device, dtype=torch.int64)
    group = torch.searchsorted(o, rows, right=True)  # E for tail rows
    return rows - starts[group] + pstarts[group]


def scatter_rows_padded(
    x: torch.Tensor, dest: torch.Tensor, num_padded_rows: int, *, column_major: bool = False
) -> torch.Tensor:
    """Copy the rows of ``x (M, C)`` to rows ``dest`` of a zero ``(num_padded_rows, C)`` buffer.

    With ``column_major`` the result is ``(num_padded_rows, C)`` with strides ``(1, num_padded_rows)``.
    FP8 tensors are moved as bytes (index_copy has no FP8 kernels).
    """
    src = x.view(torch.uint8) if x.element_size() == 1 and x.is_floating_point() else x
    if column_major:
        out = src.new_zeros(src.shape[1], num_padded_rows)
        out.index_copy_(1, dest, src.t())
        out = out.t()
    else:
        out = src.new_zeros(num_padded_rows, src.shape[1])
        out.index_copy_(0, dest, src)
    return out.view(x.dtype) if src is not x else out
