"""Column-wise FP8 quantization with each chunk held in registers (``colwise_config(resident=True)``).

One program per (column block, chunk of ``CHUNK`` rows), in place of the member and worker of
:mod:`.colwise`: it loads its ``CHUNK x BLOCK_C`` tile once, reduces each group piece's column
amax, merges it (``atomic_max``, CTA barrier, ``release`` count, as a member does), then waits for
every piece of its groups to be counted and quantizes and stores the tile it still holds. HBM and
L2 see each input byte once (a worker of :mod:`.colwise` reads it again from L2).

A program waits for programs of the same column block launched *after* it (the chunks further
down its groups), so it relies on those being resident at the same time: true when the GPU starts
programs in order and a column block's chunks fit on it at once, which nothing guarantees (another
kernel may hold multiprocessors; the CPU interpreter runs programs one after another). So the wait
is bounded: after ``max_polls`` polls the program gives up, stores nothing, and flags its chunk
*late*; a second, small launch (one program per column block, ``ROLES_LATE`` in
:func:`.colwise._colwise_kernel`) quantizes the late chunks the way :mod:`.colwise`'s workers do,
the amaxes being complete by then. It returns at once when no chunk is late. Either path writes
the same bytes.

The workspace after the ticket of :mod:`.colwise`: the late count, then one flag per program.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton_helpers import fp8_scales
from .colwise_parts import _empty_group, _first_group, _group_out, _group_rows, _store_zeros
from .common import to_fp8


@triton.jit
def _wait_count(cnt, n_pieces, max_polls):
    """Whether the counter at ``cnt`` reached ``n_pieces`` within ``max_polls`` polls (uniform over
    the CTA: the answer is one thread's acquire, which a CTA barrier then orders before every
    thread's later loads). Polls are plain volatile loads, cheaper than atomics."""
    seen = tl.load(cnt, volatile=True)
    polls = 0
    while (seen < n_pieces) & (polls < max_polls):
        seen = tl.load(cnt, volatile=True)
        polls += 1
    done = tl.atomic_add(cnt, 0, sem="acquire") >= n_pieces
    tl.debug_barrier()
    return done


@triton.jit
def _resident_chunk(
    x_ptr,
    q_ptr,
    s_ptr,
    cb,
    C,
    stride_g,
    stride_r,
    stride_c,
    stride_qg,
    stride_qr,
    stride_qc,
    amax_ptr,
    amax_col,
    amax_stride,
    cnt_ptr,
    cnt_col,
    cnt_stride,
    offs_ptr,
    poffs_ptr,
    late_ptr,
    item,
    c,
    n_chunks,
    G,
    N_UNI,
    rows_in,
    rows_out,
    tail_per_chunk,
    max_polls,
    POW2: tl.constexpr,
    UNIFORM: tl.constexpr,
    PADDED: tl.constexpr,
    G_POW2: tl.constexpr,
    CHUNK: tl.constexpr,
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
    """Chunk ``c`` (virtual rows ``[c * CHUNK, ...)``, see :mod:`.colwise_parts`) of column block
    ``cb`` of one tensor, amax and quantized rows; ``item``: this program's late flag's index."""
    n_rows = G * N_UNI if UNIFORM else rows_in
    r0 = c * CHUNK
    r1 = tl.minimum(r0 + CHUNK, n_rows)
    last_chunk = c == n_chunks - 1
    rows = r0 + tl.arange(0, CHUNK)
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    cols64 = cols.to(tl.int64)
    if UNIFORM:
        rg = rows // tl.maximum(N_UNI, 1)
        src = rg.to(tl.int64) * stride_g + (rows - rg * N_UNI).to(tl.int64) * stride_r
    else:
        src = rows.to(tl.int64) * stride_r
    x = tl.load(x_ptr + src[:, None] + cols64[None, :] * stride_c, mask=(rows < r1)[:, None] & col_ok[None, :],
                other=0.0).to(tl.float32)
    gi, ends, g_first = _first_group(offs_ptr, r0, G, N_UNI, rows_in, UNIFORM, G_POW2)

    # As a member: each group piece's column amax, merged and counted in.
    g = g_first
    go = g < G
    while go:
        start, end = _group_rows(ends, gi, g, G, N_UNI, UNIFORM)
        p0 = tl.maximum(start, r0)
        p1 = tl.minimum(end, r1)
        if p1 > p0:
            inside = (rows >= p0) & (rows < p1)
            piece = tl.max(tl.where(inside[:, None], tl.abs(x), 0.0), axis=0)
            amax_cols = amax_ptr + g.to(tl.int64) * amax_stride + amax_col + cols
            tl.atomic_max(amax_cols, piece.to(tl.int32, bitcast=True), mask=col_ok, sem="relaxed")
            tl.debug_barrier()  # every warp's maxima before the one-thread release (see .colwise)
            tl.atomic_add(cnt_ptr + g.to(tl.int64) * cnt_stride + cnt_col + cb, 1, sem="release")
        g += 1
        nxt, _ = _group_rows(ends, gi, g, G, N_UNI, UNIFORM)
        go = (g < G) & (nxt < r1)

    # As a worker: wait for each group's amax, select it for the rows of its piece (rows in no group
    # keep 0: written as x * 0, like the reference), then quantize the rows held since the load in
    # one store. Chunks that are not whole (the last one; with uniform groups, one straddling two)
    # are left to the late launch, so that every store here has no row mask (vectorized).
    whole = r1 == r0 + CHUNK
    if UNIFORM:
        whole = whole & (g_first == (r1 - 1) // tl.maximum(N_UNI, 1))
    late = (~whole).to(tl.int32)
    inv = tl.zeros((CHUNK, BLOCK_C), dtype=tl.float32)
    shift = tl.zeros((CHUNK,), dtype=tl.int32)  # PADDED: output row minus input row
    grouped = rows < 0  # PADDED: rows in some group
    g = g_first
    go = (g < G) & whole
    while go:
        start, end = _group_rows(ends, gi, g, G, N_UNI, UNIFORM)
        _, _, out_base, o_start, o_zero_end, o_limit = _group_out(g, start, stride_g, stride_qg, poffs_ptr, end,
                                                                  rows_out, N_UNI, UNIFORM, PADDED)
        q_cols = q_ptr + out_base + cols64[None, :] * stride_qc
        p0 = tl.maximum(start, r0)
        p1 = tl.minimum(end, r1)
        if end > start:
            if p1 > p0:
                n_pieces = (end - 1) // CHUNK - start // CHUNK + 1
                if _wait_count(cnt_ptr + g.to(tl.int64) * cnt_stride + cnt_col + cb, n_pieces, max_polls):
                    amax_cols = amax_ptr + g.to(tl.int64) * amax_stride + amax_col + cols
                    amax = tl.load(amax_cols, mask=col_ok, other=0, volatile=True).to(tl.float32, bitcast=True)
                    inv_scale, scale = fp8_scales(amax, FP8_MAX, POW2)
                    if p0 == start:
                        tl.store(s_ptr + g.to(tl.int64) * C + cols, scale, mask=col_ok)
                    inside = (rows >= p0) & (rows < p1)
                    inv = tl.where(inside[:, None], inv_scale[None, :], inv)
                    if PADDED:
                        shift = tl.where(inside, o_start - start, shift)
                        grouped = grouped | inside
                        if p1 == end:  # the group's padding rows
                            _store_zeros(q_cols, o_start + (end - start), o_zero_end, o_limit, stride_qr, col_ok,
                                         BLOCK_R, BLOCK_C, OUT_DTYPE)
                else:
                    late = 1
        else:
            _empty_group(q_cols, s_ptr, g, C, cols, col_ok, start, o_start, o_zero_end, o_limit, stride_qr, c, n_chunks,
                         POW2, CHUNK, BLOCK_R, BLOCK_C, OUT_DTYPE, FP8_MAX)
        g += 1
        nxt, _ = _group_rows(ends, gi, g, G, N_UNI, UNIFORM)
        go = (g < G) & ((nxt < r1) | last_chunk) & (late == 0)

    if late != 0:  # the whole chunk is redone by the late launch
        tl.atomic_xchg(late_ptr + 1 + item, 1, sem="relaxed")
        tl.atomic_add(late_ptr, 1, sem="relaxed")
    else:
        q = to_fp8(x, inv, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)
        q_cols = q_ptr + cols64[None, :] * stride_qc
        if UNIFORM:  # output rows from the expert's start: a multiple of 16 where N is
            o = rows - g_first * N_UNI
            tl.store(q_cols + g_first.to(tl.int64) * stride_qg + o.to(tl.int64)[:, None] * stride_qr, q,
                     mask=col_ok[None, :])
        elif PADDED:  # output rows shifted per group: byte stores
            o = rows + shift
            ok = grouped & (o < rows_out)
            tl.store(q_cols + o.to(tl.int64)[:, None] * stride_qr, q, mask=ok[:, None] & col_ok[None, :])
            # this chunk's share of the output rows after the last group (see .colwise_parts._tail_rows)
            pt = tl.minimum(tl.maximum(tl.load(poffs_ptr + G - 1, mask=G > 0, other=0), 0), rows_out)
            _store_zeros(q_cols, pt + c * tail_per_chunk, pt + (c + 1) * tail_per_chunk, rows_out, stride_qr, col_ok,
                         BLOCK_R, BLOCK_C, OUT_DTYPE)
        else:
            tl.store(q_cols + rows.to(tl.int64)[:, None] * stride_qr, q, mask=col_ok[None, :])
