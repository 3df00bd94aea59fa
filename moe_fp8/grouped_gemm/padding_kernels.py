"""One-launch Triton kernel: copy token rows into groups padded to 16 rows (``padding.py``'s layout).

It *gathers*: program ``p`` owns output rows ``[p * BLOCK_R, (p + 1) * BLOCK_R)``, finds the group
of each of them and copies its source row, or zeros, across all columns in ``BLOCK_C`` chunks.
Every output row is written exactly once, so there is no separate fill and no scatter. For row
``r`` of the output:

* ``pend`` and ``end`` are the running maxima of the padded end offsets clamped to ``[0, R]`` and
  of the end offsets clamped to ``[0, M]`` (bad offsets can address nothing outside the tensors);
* the groups ending at or before ``r`` (``pend[g] <= r``) are a prefix of them: ``pstart`` and
  ``start`` (the start of ``r``'s group in the padded and the source layout) are the largest
  ``pend``/``end`` over that prefix (0 if it is empty), ``stop`` the smallest ``end`` past it
  (``M`` past the last group: the rows after ``offs[-1]`` form a tail group, as in
  ``padded_row_index``);
* ``out[r] = x[start + r - pstart]`` if that row is below ``stop``, else zeros.

The offsets are read ``G_BLOCK`` at a time (the running maxima carried from chunk to chunk), so the
``(BLOCK_R, G_BLOCK)`` comparison tile stays in registers however many groups there are.

Bits move, not values: the caller passes integer views of the same element size (FP8 as uint8).
Interior column chunks carry no column mask and a row mask that is constant along a row, so loads
and stores stay 16-byte vectorizable; row offsets are int64.

The output may also be column-major (strides ``(1, R)``: the layout of the FP8 wgrad operands).
Then each program copies one ``BLOCK_R x BLOCK_C`` tile, which the compiler transposes through
shared memory between the row-major loads and the column-major stores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import launch
from ..launch_math import cdiv, next_power_of_2
from ..quant.kernels.common import max_combine

__all__ = ["BITS_DTYPES", "gather_rows_padded_kernel", "launch_gather_rows_padded"]

# Integer types of each element size: the byte-moving kernels (this one, ``transpose.py``) copy bits.
BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def gather_rows_padded_kernel(
    x_ptr,
    out_ptr,
    offs_ptr,
    poffs_ptr,
    M,
    C,
    R,
    stride_x,
    stride_or,
    stride_oc,
    E,
    G_BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """``out (R, C)`` (strides ``stride_or``, ``stride_oc``) from ``x (M, C)`` (row stride
    ``stride_x``, unit column stride), ``offs``/``poffs`` ``(E,)`` int32 end offsets of the groups
    and of the padded groups; fewer than 2**31 rows. Program ``(i, j)`` owns output rows
    ``[i * BLOCK_R, (i + 1) * BLOCK_R)`` and the column chunks ``j, j + J, ...`` of ``J`` programs."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    pstart = tl.zeros((BLOCK_R,), dtype=tl.int32)
    start = tl.zeros((BLOCK_R,), dtype=tl.int32)
    stop = tl.full((BLOCK_R,), M, dtype=tl.int32)
    end_carry = 0
    pend_carry = 0
    for g0 in range(0, E, G_BLOCK):  # the groups in chunks (a (BLOCK_R, G_BLOCK) tile stays in registers)
        gi = g0 + tl.arange(0, G_BLOCK)
        in_e = gi < E
        # lanes past E get end = M, pend = R: they never end at or before a row r < R
        end = tl.minimum(tl.maximum(tl.load(offs_ptr + gi, mask=in_e, other=M), 0), M)
        end = tl.maximum(tl.associative_scan(end, 0, max_combine), end_carry)
        pend = tl.minimum(tl.maximum(tl.load(poffs_ptr + gi, mask=in_e, other=R), 0), R)
        pend = tl.maximum(tl.associative_scan(pend, 0, max_combine), pend_carry)
        end_carry = tl.max(end, axis=0)
        pend_carry = tl.max(pend, axis=0)
        before = pend[None, :] <= r[:, None]  # the groups ending at or before row r
        pstart = tl.maximum(pstart, tl.max(tl.where(before, pend[None, :], 0), axis=1))
        start = tl.maximum(start, tl.max(tl.where(before, end[None, :], 0), axis=1))
        stop = tl.minimum(stop, tl.min(tl.where(before, M, end[None, :]), axis=1))
    src = start + (r - pstart)  # >= 0: r >= pstart
    in_out = (r < R)[:, None]
    live = (src < stop)[:, None] & in_out
    x_rows = x_ptr + src.to(tl.int64)[:, None] * stride_x
    out_rows = out_ptr + r.to(tl.int64)[:, None] * stride_or
    cols = tl.arange(0, BLOCK_C)[None, :]
    n_full = C // BLOCK_C
    for cb in range(tl.program_id(1), n_full, tl.num_programs(1)):
        c = cb * BLOCK_C + cols
        tl.store(out_rows + c.to(tl.int64) * stride_oc, tl.load(x_rows + c, mask=live, other=0), mask=in_out)
    if (n_full * BLOCK_C < C) & (tl.program_id(1) == n_full % tl.num_programs(1)):
        c = n_full * BLOCK_C + cols
        c_ok = c < C
        tl.store(out_rows + c.to(tl.int64) * stride_oc, tl.load(x_rows + c, mask=live & c_ok, other=0),
                 mask=in_out & c_ok)


def launch_gather_rows_padded(
    x: torch.Tensor,
    offs: torch.Tensor,
    padded_offs: torch.Tensor,
    out: torch.Tensor,
    *,
    block_r: int | None = None,
    block_bytes: int | None = None,
    group_block: int = 128,
    num_warps: int = 4,
) -> None:
    """Fill ``out (R, C)`` (``x.dtype``, contiguous or column-major) from ``x (M, C)`` (unit column stride).

    ``offs``/``padded_offs``: ``(E,)`` int32 on ``x``'s device. Each program finds the groups of
    its ``block_r`` rows, reading the offsets ``group_block`` at a time, then copies ``block_bytes``
    bytes of each row per step. Defaults: row-major ``out``, 16 rows and 512 B per step, one
    program per row block; column-major ``out`` (strides ``(1, R)``), 128 x 128-byte tiles, one
    program per tile (128-byte stores down each column). 128 groups at a time, 4 warps.
    """
    (M, C), R, E = x.shape, out.shape[0], offs.numel()
    column_major = out.dim() == 2 and R > 1 and C > 1 and out.stride() == (1, R)
    if out.dim() != 2 or out.shape[1] != C or out.dtype != x.dtype or not (out.is_contiguous() or column_major):
        raise ValueError(f"out: expected a contiguous or column-major (*, {C}) {x.dtype} tensor, "
                         f"got {tuple(out.shape)} {out.dtype} with strides {out.stride()}")
    if C > 1 and x.stride(1) != 1:
        raise ValueError(f"x: expected a unit column stride, got strides {x.stride()}")
    if R == 0 or C == 0:
        return
    bits = BITS_DTYPES[x.element_size()]
    block_r = block_r or (128 if column_major else 16)
    block_c = max((block_bytes or (128 if column_major else 512)) // x.element_size(), 1)
    grid = (cdiv(R, block_r), cdiv(C, block_c) if column_major else 1)
    launch(gather_rows_padded_kernel)[grid](
        x.view(bits), out.view(bits), offs, padded_offs, M, C, R, x.stride(0) if M > 1 else C,
        *((1, R) if column_major else (C, 1)), E,
        G_BLOCK=min(next_power_of_2(max(E, 1)), group_block), BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=num_warps,
    )  # fmt: skip
