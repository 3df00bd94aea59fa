"""Token groups padded to 16-row boundaries, computed on the device (no host sync).

``torch._scaled_grouped_mm``'s 2D x 2D (wgrad) form needs every group but the last to hold a
multiple of 16 rows (a device-side assert otherwise) and the total row count to be a multiple of
16 (the bf16 ``torch._grouped_mm`` needs multiples of 8). Group sizes live on the device, so the
padded layout is computed there too, inside a buffer whose row count is a static upper bound:
``padded_rows(M, E) = round_up(M + 15 E, 128)`` >= ``sum_g round_up(size_g, 16)``. The count is
also the column stride of the column-major FP8 wgrad operands: a multiple of 128 starts every
column on a 128-byte line, so the quantizer's 32-row tile stores fill whole 32-byte sectors (with
a multiple of 16 only, as Llama 4's 16384 + 15 x 16 = 16624 rows gave, every odd column's stores
straddled two sectors). Measured on one H200 (``benchmarks/results/ab_padded_rows.md``): Llama 4's
padded wgrad quantization from amaxes 295 -> 183 µs (16624 -> 16640 rows), with its own amaxes
309 -> 291 µs; DeepSeek-V3 with 32 groups (33248 -> 33280 rows) within 0.4%.

``gather_rows_padded`` builds a row-major or column-major padded copy in one Triton launch
(``padding_kernels.py``) on GPUs and in the interpreter, else with ``padded_row_index`` +
``scatter_rows_padded`` (the reference).
"""

from __future__ import annotations

import torch

from ..checks import check_offsets, check_same_device, check_tensor
from ..kernel_backend import device_guard, eager_or_custom_op, use_triton
from .padding_kernels import BITS_DTYPES, gather_rows_padded_kernel, launch_gather_rows_padded

__all__ = [
    "ALIGN",
    "padded_rows",
    "padded_offsets",
    "padded_row_index",
    "scatter_rows_padded",
    "gather_rows_padded",
    "gather_rows_padded_reference",
]

ALIGN = 16  # rows per group
ROWS_ALIGN = 128  # rows of the whole buffer (see the module docstring)


def padded_rows(num_rows: int, num_groups: int, rows_align: int = ROWS_ALIGN) -> int:
    """Static row count, a multiple of ``rows_align`` (128; see the module docstring), of a buffer
    that holds any grouping of ``num_rows`` rows padded to 16."""
    return -(-(num_rows + (ALIGN - 1) * num_groups) // rows_align) * rows_align


def padded_offsets(offs: torch.Tensor) -> torch.Tensor:
    """``(E,)`` int32 end offsets of the groups of ``offs`` each rounded up to 16 rows (on device).

    Five kernels, all int32: the sum wraps exactly as an int64 sum cast to int32 would, and ``& -16`` is
    ``// 16 * 16`` for negative sizes too."""
    sizes = offs.clone()
    sizes[1:].sub_(offs[:-1])
    return torch.cumsum(sizes.add_(ALIGN - 1).bitwise_and_(-ALIGN), 0, dtype=torch.int32)


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


def gather_rows_padded_reference(
    x: torch.Tensor, offs: torch.Tensor, padded_offs: torch.Tensor, num_padded_rows: int, column_major: bool = False
) -> torch.Tensor:
    """Pure-torch ``gather_rows_padded``: ``padded_row_index`` + ``scatter_rows_padded`` (valid offsets only)."""
    dest = padded_row_index(offs, padded_offs, x.shape[0])
    return scatter_rows_padded(x, dest, num_padded_rows, column_major=column_major)


def _empty_padded(x: torch.Tensor, num_padded_rows: int, column_major: bool) -> torch.Tensor:
    if column_major:
        return x.new_empty(x.shape[1], num_padded_rows).t()
    return x.new_empty(num_padded_rows, x.shape[1])


def _gather_rows_padded(x: torch.Tensor, offs: torch.Tensor, padded_offs: torch.Tensor,
                        num_padded_rows: int, column_major: bool) -> torch.Tensor:
    if not use_triton(gather_rows_padded_kernel, x):
        return gather_rows_padded_reference(x, offs, padded_offs, num_padded_rows, column_major)
    out = _empty_padded(x, num_padded_rows, column_major)
    with device_guard(x):
        launch_gather_rows_padded(x, offs, padded_offs, out)
    return out


# Under torch.compile a triton_op with a fake kernel (static output shape), traced to its launch; eagerly a plain call.
_gather_op = torch.library.triton_op("moe_fp8::gather_rows_padded", _gather_rows_padded, mutates_args=())
_gather = eager_or_custom_op(_gather_op, _gather_rows_padded)


@_gather_op.register_fake
def _(x, offs, padded_offs, num_padded_rows, column_major):
    return _empty_padded(x, num_padded_rows, column_major)


def gather_rows_padded(
    x: torch.Tensor, offs: torch.Tensor, padded_offs: torch.Tensor, num_padded_rows: int, *, column_major: bool = False
) -> torch.Tensor:
    """Copy the rows of ``x`` into its groups padded to 16 rows, on the device (no host sync).

    Args:
        x: ``(M, C)``, any dtype of 1, 2, 4 or 8 bytes (FP8 included: bits are copied); a unit
            column stride avoids a copy.
        offs: ``(E,)`` int32 cumulative end offsets of the groups of ``x``'s rows.
        padded_offs: ``(E,)`` int32 ``padded_offsets(offs)``.
        num_padded_rows: ``R >= padded_rows(M, E)``.
        column_major: return the rows column-major (strides ``(1, R)``, the layout of the FP8
            wgrad operands) instead of row-major.

    Returns:
        ``(R, C)`` row-major (or column-major), ``x.dtype``: row ``padded_start[g] + i`` holds
        ``x[start[g] + i]`` for ``i < size[g]``; rows ``padded_offs[-1] + i`` hold
        ``x[offs[-1] + i]`` (rows in no group, past every padded group); every other row is zero.
        Offsets that are not monotonic or leave ``[0, M]`` give unspecified rows, never an access
        outside the tensors (the kernel clamps them to a running maximum in range).
    """
    check_tensor("x", x, ndim=2)
    if x.element_size() not in BITS_DTYPES or x.is_complex():
        raise TypeError(f"x: expected a real dtype of 1, 2, 4 or 8 bytes, got {x.dtype}")
    check_offsets(offs, device=x.device)
    check_tensor("padded_offs", padded_offs, dtypes=(torch.int32,), shape=(offs.numel(),))
    check_same_device(x=x, padded_offs=padded_offs)
    if not isinstance(num_padded_rows, int) or num_padded_rows < padded_rows(x.shape[0], offs.numel()):
        raise ValueError(
            f"num_padded_rows: expected an int >= padded_rows({x.shape[0]}, {offs.numel()}) = "
            f"{padded_rows(x.shape[0], offs.numel())}, got {num_padded_rows!r}"
        )
    if x.stride(1) != 1 and x.shape[1] > 1:
        x = x.contiguous()
    return _gather(x, offs, padded_offs, num_padded_rows, bool(column_major))
