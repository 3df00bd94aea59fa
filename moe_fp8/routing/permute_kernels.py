"""Triton kernels that scatter token rows into the expert-sorted layout, optionally quantizing.

Token-major: program ``t`` reads row ``x[t]`` ONCE (plus once more from cache for the amax when
the row is wider than one block), quantizes it once and stores the same bytes to the ``k`` rows
``pair_to_row[t*k : t*k+k]``. Bytes moved: ``T*H`` elements read, ``T*k*H`` written: the
minimum. Programs ``t >= T`` write the padding rows (zeros; scale = that of an all-zero row).
Since every copy of a row has the same bytes and scale, the result is bit-identical to
``quantize_rowwise(x[source token of each row])``. With ``WRITE_COPY`` the same programs also store
the rows as they are (``x``'s dtype) to a second output: the bf16 permute and the FP8 one from one
read of ``x``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..quant.kernels.common import to_fp8
from ..quant.triton_helpers import fp8_scales

__all__ = ["permute_rows_kernel", "write_padding_rows"]


@triton.jit
def write_padding_rows(
    out_ptr, scale_ptr, pad_rows_ptr, first, num_pad_rows, H, pad_scale,
    HAS_SCALE: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Zero the rows ``pad_rows[first : first + ROWS]`` (and set their scale to ``pad_scale``)."""
    cols = tl.arange(0, BLOCK_H)
    zeros = tl.zeros([BLOCK_H], dtype=tl.float32).to(out_ptr.dtype.element_ty)
    for i in range(ROWS):
        ok = first + i < num_pad_rows
        row = tl.load(pad_rows_ptr + first + i, mask=ok, other=0).to(tl.int64)
        width = tl.where(ok, H, 0)  # scalar & vector masks trip the interpreter: fold into the bound
        for c in range(0, H, BLOCK_H):
            tl.store(out_ptr + row * H + c + cols, zeros, mask=c + cols < width)
        if HAS_SCALE:
            tl.store(scale_ptr + row, pad_scale, mask=ok)


@triton.jit
def permute_rows_kernel(
    x_ptr, out_ptr, scale_ptr, copy_ptr, pair_to_row_ptr, pad_rows_ptr,
    num_tokens, H, stride_x, num_pad_rows, pad_scale,
    TOPK: tl.constexpr, BLOCK_H: tl.constexpr, NUM_CHUNKS: tl.constexpr, PAD_ROWS: tl.constexpr,
    QUANTIZE: tl.constexpr, WRITE_COPY: tl.constexpr, POW2: tl.constexpr, OUT_DTYPE: tl.constexpr,
    HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr, FP8_NEG_ZERO: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    if pid < num_tokens:
        t = pid.to(tl.int64)
        x_row = x_ptr + t * stride_x
        pairs = pair_to_row_ptr + t * TOPK
        if QUANTIZE:
            if NUM_CHUNKS > 1:  # wide rows: amax pass first (the second read hits the cache)
                amax_vec = tl.zeros([BLOCK_H], dtype=tl.float32)
                for c in range(0, H, BLOCK_H):
                    xc = tl.load(x_row + c + cols, mask=c + cols < H, other=0.0).to(tl.float32)
                    amax_vec = tl.maximum(amax_vec, tl.abs(xc))
                inv_scale, scale = fp8_scales(tl.max(amax_vec, axis=0), FP8_MAX, POW2)
        for ci in range(NUM_CHUNKS):
            c = ci * BLOCK_H
            xc = tl.load(x_row + c + cols, mask=c + cols < H, other=0.0)
            if QUANTIZE:
                if NUM_CHUNKS == 1:
                    inv_scale, scale = fp8_scales(tl.max(tl.abs(xc.to(tl.float32)), axis=0), FP8_MAX, POW2)
                vals = to_fp8(
                    xc, inv_scale, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO
                )
            else:
                vals = xc.to(out_ptr.dtype.element_ty)
            for j in tl.static_range(TOPK):
                row = tl.load(pairs + j).to(tl.int64)
                width = tl.where(row >= 0, H, 0)  # dropped pair (-1): store nothing
                tl.store(out_ptr + row * H + c + cols, vals, mask=c + cols < width)
                if WRITE_COPY:
                    tl.store(copy_ptr + row * H + c + cols, xc, mask=c + cols < width)
                if QUANTIZE:
                    if ci == 0:
                        tl.store(scale_ptr + row, scale, mask=row >= 0)
    else:
        first = (pid - num_tokens) * PAD_ROWS
        write_padding_rows(out_ptr, scale_ptr, pad_rows_ptr, first, num_pad_rows, H, pad_scale, QUANTIZE, PAD_ROWS,
                           BLOCK_H)
        if WRITE_COPY:
            write_padding_rows(copy_ptr, scale_ptr, pad_rows_ptr, first, num_pad_rows, H, pad_scale, False,
                               PAD_ROWS, BLOCK_H)
