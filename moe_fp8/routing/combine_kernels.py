"""Triton kernels of the combine (un-permute + weighted sum over the k slots) and its backward.

No atomics: each output element is owned by one program, which gathers the token's k rows and
sums them in fp32 in slot order 0..k-1, so every run gives the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..quant.kernels.common import to_fp8
from ..quant.triton_helpers import fp8_scales
from .permute_kernels import write_padding_rows

__all__ = ["combine_kernel", "combine_backward_kernel", "cast_rne"]


@triton.jit
def cast_rne(x, DTYPE: tl.constexpr):
    """fp32 ``x`` -> ``DTYPE``; bf16 is rounded to nearest-even on the bit pattern first, because
    the interpreter's own fp32 -> bf16 cast truncates (the GPU's cast rounds: same bits either way)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # keep NaN a NaN
    return x.to(DTYPE)


@triton.jit
def combine_kernel(
    y_ptr, w_ptr, out_ptr, pair_to_row_ptr, H,
    TOPK: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Grid ``(T, cdiv(H, BLOCK_H))``: ``out[t, cols] = sum_j w[t, j] * y[pair_to_row[t*k + j], cols]``."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        row = tl.load(pair_to_row_ptr + t * TOPK + j).to(tl.int64)
        width = tl.where(row >= 0, H, 0)  # dropped pair (-1) adds 0
        y = tl.load(y_ptr + row * H + cols, mask=cols < width, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            acc += tl.load(w_ptr + t * TOPK + j).to(tl.float32) * y
        else:
            acc += y
    tl.store(out_ptr + t * H + cols, cast_rne(acc, out_ptr.dtype.element_ty), mask=cols < H)


@triton.jit
def combine_backward_kernel(
    g_ptr, y_ptr, w_ptr, grad_y_ptr, grad_w_ptr, q_ptr, scale_ptr, pair_to_row_ptr, pad_rows_ptr,
    num_tokens, H, num_pad_rows, pad_scale,
    TOPK: tl.constexpr, TOPK_POW2: tl.constexpr, BLOCK_H: tl.constexpr, PAD_ROWS: tl.constexpr,
    QUANTIZE: tl.constexpr, POW2: tl.constexpr, OUT_DTYPE: tl.constexpr, HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr, FP8_NEG_ZERO: tl.constexpr,
):
    """Grid ``(T + padding programs,)``: token ``t`` writes ``grad_y[row_j] = w_j * g[t]`` and
    ``grad_w[t, j] = <g[t], y[row_j]>`` (fp32, fixed reduction order); the rest zero ``pad_rows``.
    ``QUANTIZE``: also each ``grad_y`` row's FP8 codes (``q``) and scale, in the same pass over the
    columns. The row's amax needs no pass over ``grad_y``: rounding is monotonic, so
    ``max_c |round(w_j * g[t, c])| = round(|w_j| * max_c |g[t, c]|)``, bit for bit."""
    pid = tl.program_id(0)
    if pid < num_tokens:
        t = pid.to(tl.int64)
        slots = tl.arange(0, TOPK_POW2)
        smask = slots < TOPK
        rows = tl.load(pair_to_row_ptr + t * TOPK + slots, mask=smask, other=-1).to(tl.int64)
        w = tl.load(w_ptr + t * TOPK + slots, mask=smask, other=0.0).to(tl.float32)
        live = rows >= 0
        cols = tl.arange(0, BLOCK_H)
        if QUANTIZE:
            g_cols = tl.arange(0, TOPK_POW2 * BLOCK_H)
            g_max = tl.zeros([TOPK_POW2 * BLOCK_H], dtype=tl.float32)
            for c in range(0, H, TOPK_POW2 * BLOCK_H):
                g = tl.load(g_ptr + t * H + c + g_cols, mask=c + g_cols < H, other=0.0).to(tl.float32)
                g_max = tl.maximum(g_max, tl.abs(g))
            amax = cast_rne(tl.abs(w) * tl.max(g_max, axis=0), grad_y_ptr.dtype.element_ty).to(tl.float32)
            inv_scale, scale = fp8_scales(amax, FP8_MAX, POW2)
            tl.store(scale_ptr + rows, scale, mask=live)
        dots = tl.zeros([TOPK_POW2, BLOCK_H], dtype=tl.float32)
        for c in range(0, H, BLOCK_H):
            cc = c + cols
            m = cc < H
            g = tl.load(g_ptr + t * H + cc, mask=m, other=0.0).to(tl.float32)
            tile = live[:, None] & m[None, :]
            offs = rows[:, None] * H + cc[None, :]
            y = tl.load(y_ptr + offs, mask=tile, other=0.0).to(tl.float32)
            dots += y * g[None, :]
            grad_y = cast_rne(w[:, None] * g[None, :], grad_y_ptr.dtype.element_ty)
            tl.store(grad_y_ptr + offs, grad_y, mask=tile)
            if QUANTIZE:
                q = to_fp8(grad_y, inv_scale[:, None], OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT,
                           FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)
                tl.store(q_ptr + offs, q, mask=tile)
        tl.store(grad_w_ptr + t * TOPK + slots, cast_rne(tl.sum(dots, axis=1), grad_w_ptr.dtype.element_ty), mask=smask)
    else:
        first = (pid - num_tokens) * PAD_ROWS
        write_padding_rows(grad_y_ptr, grad_y_ptr, pad_rows_ptr, first, num_pad_rows, H, 0.0, False, PAD_ROWS, BLOCK_H)
        if QUANTIZE:
            write_padding_rows(q_ptr, scale_ptr, pad_rows_ptr, first, num_pad_rows, H, pad_scale, True, PAD_ROWS,
                               BLOCK_H)
