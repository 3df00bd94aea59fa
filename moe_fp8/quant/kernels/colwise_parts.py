"""Pieces of the column-wise kernels (:mod:`.colwise`, :mod:`.colwise_resident`): group geometry,
output placement, and the stores of rows, of a group that is empty and of rows in no group.

Rows are *virtual*: ``UNIFORM`` groups hold rows ``[g * N_UNI, (g + 1) * N_UNI)``, stored at
``g * stride_g + (row - g * N_UNI) * stride_r``; jagged group ``g`` holds rows ``[end[g-1],
end[g])`` stored at ``row * stride_r``, where ``end`` is the running maximum of the offsets clamped
to ``[0, rows_in]``: bad offsets can neither address memory outside the tensors nor leave a program
waiting for a piece nobody reduces. Group ``g``'s output row ``o``, column ``c`` lives at ``out_base
+ o * stride_qr + c * stride_qc`` (:func:`_group_out`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton_helpers import fp8_scales
from .common import to_fp8


@triton.jit
def _store_rows(
    x_cols,
    q_cols,
    o0,
    o_start,
    o_end,
    in_start,
    stride_r,
    stride_qr,
    inv_scale,
    col_ok,
    MASK_ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):
    """Quantize output rows ``o0 + [0, BLOCK_R)`` (only those in ``[o_start, o_end)`` when ``MASK_ROWS``)."""
    o = o0 + tl.arange(0, BLOCK_R)
    src = x_cols + (o - o_start + in_start).to(tl.int64)[:, None] * stride_r
    dst = q_cols + o.to(tl.int64)[:, None] * stride_qr
    if MASK_ROWS:
        mask = ((o >= o_start) & (o < o_end))[:, None] & col_ok[None, :]
    else:
        mask = col_ok[None, :]
    x = tl.load(src, mask=mask, other=0.0)
    q = to_fp8(x, inv_scale[None, :], OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE,
               FP8_NEG_ZERO)
    tl.store(dst, q, mask=mask)


@triton.jit
def _store_strip(
    x_cols,
    q_cols,
    in_start,
    in_end,
    stride_r,
    o_start,
    o_zero_end,
    o_limit,
    stride_qr,
    inv_scale,
    col_ok,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    STAGES: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):
    """Rows ``[in_start, in_end)`` times ``inv_scale`` to output rows ``[o_start, ...)``, then zeros
    up to ``o_zero_end``; nothing at or past ``o_limit``.

    Walks backwards (the rows read last, the freshest in L2, first): the partial tile at the end,
    the full tiles, the partial tile at the start. Full tiles get no row mask, so their stores along
    the output's contiguous dim stay vectorized (a shared masked store would not be).
    """
    o_end = tl.minimum(o_start + (in_end - in_start), o_limit)
    full_lo = tl.cdiv(o_start, BLOCK_R) * BLOCK_R
    full_hi = tl.maximum((o_end // BLOCK_R) * BLOCK_R, full_lo)
    if full_hi < o_end:
        _store_rows(x_cols, q_cols, full_hi, o_start, o_end, in_start, stride_r, stride_qr, inv_scale, col_ok,
                    True, BLOCK_R, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE,
                    FP8_NEG_ZERO)
    for j in tl.range(0, (full_hi - full_lo) // BLOCK_R, num_stages=STAGES):
        o0 = tl.multiple_of(full_hi - (j + 1) * BLOCK_R, BLOCK_R)
        _store_rows(x_cols, q_cols, o0, o_start, o_end, in_start, stride_r, stride_qr, inv_scale, col_ok,
                    False, BLOCK_R, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE,
                    FP8_NEG_ZERO)
    if (o_start < full_lo) & (o_start < o_end):
        _store_rows(x_cols, q_cols, full_lo - BLOCK_R, o_start, o_end, in_start, stride_r, stride_qr, inv_scale,
                    col_ok, True, BLOCK_R, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE,
                    FP8_NEG_ZERO)
    _store_zeros(q_cols, o_end, o_zero_end, o_limit, stride_qr, col_ok, BLOCK_R, BLOCK_C, OUT_DTYPE)


@triton.jit
def _store_zeros(q_cols, o_lo, o_hi, o_limit, stride_qr, col_ok, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                 OUT_DTYPE: tl.constexpr):
    """Zeros to output rows ``[o_lo, min(o_hi, o_limit))``, in tiles aligned to ``BLOCK_R`` rows."""
    zero = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32).to(OUT_DTYPE)
    z_end = tl.minimum(o_hi, o_limit)
    for o0 in range((o_lo // BLOCK_R) * BLOCK_R, z_end, BLOCK_R):
        o = o0 + tl.arange(0, BLOCK_R)
        ok = (o >= o_lo) & (o < z_end)
        tl.store(q_cols + o.to(tl.int64)[:, None] * stride_qr, zero, mask=ok[:, None] & col_ok[None, :])


@triton.jit
def _tile_aligned(row, start, o_start, BLOCK_R: tl.constexpr):
    """The last row at or before ``row`` of a group starting at ``start`` whose output row
    (``o_start + row - start``) starts a ``BLOCK_R`` tile; ``start`` if there is none. (Rows
    before ``row``: the members of this chunk and the one before have just read them.)"""
    o = (o_start + (row - start)) // BLOCK_R * BLOCK_R
    return tl.maximum(start + (o - o_start), start)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _group_rows(ends, gi, g, G, N_UNI, UNIFORM: tl.constexpr):
    """``(start, end)`` virtual rows of group ``g`` (``ends``: the running-max end offsets, jagged)."""
    if UNIFORM:
        start = g * N_UNI
        end = start + N_UNI
    else:
        start = tl.sum(tl.where(gi == g - 1, ends, 0), axis=0)
        end = tl.sum(tl.where(gi == g, ends, 0), axis=0)
    return start, end


@triton.jit
def _first_group(offs_ptr, r0, G, N_UNI, rows_in, UNIFORM: tl.constexpr, G_POW2: tl.constexpr):
    """``(gi, ends, g)``: ``arange(G_POW2)``, the running-max end offsets (jagged; ``gi`` when
    ``UNIFORM``) and the first group ending at or after row ``r0``."""
    gi = tl.arange(0, G_POW2)
    if UNIFORM:
        ends = gi
        g = r0 // tl.maximum(N_UNI, 1)
    else:
        raw = tl.minimum(tl.maximum(tl.load(offs_ptr + gi, mask=gi < G, other=0), 0), rows_in)
        ends = tl.associative_scan(raw, 0, _max_combine)
        g = tl.sum(((ends < r0) & (gi < G)).to(tl.int32), axis=0)
    return gi, ends, g


@triton.jit
def _group_out(g, start, stride_g, stride_qg, poffs_ptr, end, rows_out, N_UNI, UNIFORM: tl.constexpr,
               PADDED: tl.constexpr):
    """Where group ``g`` (virtual rows ``[start, end)``) is read and written: ``(shift, in_base,
    out_base, o_start, o_zero_end, o_limit)``. Input row ``r`` is at ``in_base + (r - shift) *
    stride_r``; its output row is ``o_start + r - start``; output rows ``[o_start + end - start,
    o_zero_end)`` are zeros (padding); nothing is written at or past ``o_limit``."""
    if UNIFORM:
        shift = start
        in_base = g.to(tl.int64) * stride_g
        out_base = g.to(tl.int64) * stride_qg
        o_start = 0
        o_zero_end = N_UNI
        o_limit = N_UNI
    else:
        shift = 0
        in_base = 0
        out_base = 0
        o_limit = rows_out
        if PADDED:
            p_prev = tl.load(poffs_ptr + g - 1, mask=g > 0, other=0)
            o_start = tl.minimum(tl.maximum(p_prev, 0), rows_out)
            o_zero_end = tl.minimum(tl.maximum(tl.load(poffs_ptr + g), o_start), rows_out)
        else:
            o_start = start
            o_zero_end = end
    return shift, in_base, out_base, o_start, o_zero_end, o_limit


@triton.jit
def _empty_group(q_cols, s_ptr, g, C, cols, col_ok, start, o_start, o_zero_end, o_limit, stride_qr, c, n_chunks,
                 POW2: tl.constexpr, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                 OUT_DTYPE: tl.constexpr, FP8_MAX: tl.constexpr):
    """An empty group's scales (amax 0) and zero padding rows, written by the chunk holding its
    start (the last chunk when ``start`` is the end of all rows)."""
    if tl.minimum(start // CHUNK, n_chunks - 1) == c:
        _, scale = fp8_scales(tl.zeros((BLOCK_C,), dtype=tl.float32), FP8_MAX, POW2)
        tl.store(s_ptr + g.to(tl.int64) * C + cols, scale, mask=col_ok)
        _store_zeros(q_cols, o_start, o_zero_end, o_limit, stride_qr, col_ok, BLOCK_R, BLOCK_C, OUT_DTYPE)


@triton.jit
def _tail_rows(x_ptr, q_ptr, cols64, col_ok, gi, ends, G, c, r0, r1, poffs_ptr, rows_out, tail_per_chunk, stride_r,
               stride_c, stride_qr, stride_qc, PADDED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
               STAGES: tl.constexpr, OUT_DTYPE: tl.constexpr, HW_CAST: tl.constexpr, FP8_MAX: tl.constexpr,
               FP8_MANT: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_SUB_SCALE: tl.constexpr,
               FP8_NEG_ZERO: tl.constexpr):
    """Chunk ``c``'s share of the output rows in no group (jagged groups): with ``PADDED`` the rows
    ``[poffs[-1], rows_out)`` are 0, shared out in ``tail_per_chunk`` pieces; otherwise the input
    rows ``[end[-1], rows_in)`` of this chunk (``[r0, r1)``) are written as ``x * 0`` (-0 for
    negative x, like the reference)."""
    x_cols = x_ptr + cols64[None, :] * stride_c
    q_cols = q_ptr + cols64[None, :] * stride_qc
    zero_scale = tl.zeros((BLOCK_C,), dtype=tl.float32)
    if PADDED:
        pt = tl.minimum(tl.maximum(tl.load(poffs_ptr + G - 1, mask=G > 0, other=0), 0), rows_out)
        z0 = pt + c * tail_per_chunk
        _store_strip(x_cols, q_cols, 0, 0, stride_r, z0, z0 + tail_per_chunk, rows_out, stride_qr, zero_scale, col_ok,
                     BLOCK_R, BLOCK_C, STAGES, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE,
                     FP8_NEG_ZERO)
    else:
        t = tl.max(tl.where(gi < G, ends, 0), axis=0)
        z0 = tl.maximum(t, r0)
        z1 = tl.maximum(r1, z0)
        _store_strip(x_cols, q_cols, z0, z1, stride_r, z0, z1, rows_out, stride_qr, zero_scale, col_ok, BLOCK_R,
                     BLOCK_C, STAGES, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE,
                     FP8_NEG_ZERO)
