"""Column-wise FP8 quantization over row groups, written transposed: dgrad weights and wgrad operands.

One scale per (group, column): the amax over the group's rows. The rows are cut into fixed
*chunks* of ``CHUNK`` rows; per column block of ``BLOCK_C`` columns, each chunk gets two programs:

* a *member* reduces the column amax of each group piece in its chunk, merges it into the group's
  amax (a relaxed ``atomic_max`` on the fp32 bits, ``BLOCK_C`` per piece) and, after a CTA barrier
  (the maxima come from several warps), counts the piece in at the (group, column block) counter
  (one ``release`` atomic add);
* a *worker* waits (an ``acquire`` atomic read, spinning, then a CTA barrier) until every piece of
  each of its groups is counted, then scales, rounds and stores its chunk's rows, which it reads
  from L2, where its member has just brought them. (With padded offsets, a worker's piece
  boundaries inside a group move, by less than ``BLOCK_R`` rows, to where the output rows start a
  tile: see below.)

Every program moves the same bytes whatever the group sizes are (no autotuning per token count,
no host sync) and HBM sees each input byte once (3 bytes per element, bf16 in, fp8 out). The grid
puts all members of a column block before its workers, so a worker only waits for programs
launched before it, which the GPU has already placed on its multiprocessors (the forward-progress
assumption of decoupled look-back scans); the L2 working set is one column block of all rows
(``rows x BLOCK_C x 2`` bytes), or ``LAG + 1`` of them when the workers trail their members by
``LAG`` column blocks (``colwise_config(lag=...)``; by default ``auto_lag``). With
``colwise_config(two_pass=True)`` the members run in one launch and the workers in a second one
that waits for nothing (HBM then reads each input byte twice). The sequential CPU interpreter runs
members first, so its workers never spin. Counts a worker waits for are derived from the same
clamped running-max offsets the members use, so no offsets, however bad, leave a worker waiting
forever.

Users:

* ``quantize_expert_colwise(transposed=True)`` (``UNIFORM``): groups are experts, ``N`` rows each,
  of ``w (E, N, K)`` (any strides); ``q (E, K, N)`` contiguous, ``scale (E, K)``;
* ``quantize_group_colwise[_dual]``: groups are jagged token ranges given by int32 end offsets
  (read on the device, never synced); ``q`` is column-major ``(rows, C)`` (or row-major), rows
  outside every group are 0. With padded offsets, group ``g``'s rows land at the padded group start
  and the pad rows are 0. Two tensors sharing the offsets (``grad_out`` and the activations) are
  quantized in one launch.

Output row ``o`` of a group, column ``c``, lives at ``out_base + o * stride_qr + c * stride_qc``;
rows are stored in tiles aligned to ``BLOCK_R`` output rows so that interior tiles take
unmasked, vectorized stores along the output's contiguous dim; where every group starts and ends
on a multiple of 16 output rows (uniform groups of 16k rows, padded groups), the partial tiles at
group edges store 16-row vectors too, writing their pad rows' zeros in the same stores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...kernel_backend import launch_target
from ...launch import interpreted_trace, launch
from ...launch_math import cdiv, next_power_of_2
from ..formats import Float8Format
from ..triton_helpers import fp8_scales
from .common import format_constexprs, group_ends, multiprocessor_count, to_fp8

__all__ = ["auto_lag", "colwise_config", "launch_expert_colwise_t", "launch_group_colwise", "zero_fill"]

# What the programs of one launch do (``_colwise_kernel``'s ``ROLES``).
ROLES_BOTH = tl.constexpr(0)
ROLES_MEMBERS = tl.constexpr(1)
ROLES_WORKERS = tl.constexpr(2)


@triton.jit
def _store_rows(
    x_cols,
    q_cols,
    o0,
    o_start,
    o_end,
    s_end,
    in_start,
    stride_r,
    stride_qr,
    inv_scale,
    col_ok,
    MASK_ROWS: tl.constexpr,
    ZERO_FILL: tl.constexpr,
    BLOCK_R: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):
    """Quantize output rows ``o0 + [0, BLOCK_R)``; with ``MASK_ROWS`` only some are stored: with
    ``ZERO_FILL == 1`` the rows in ``[o_start, o_end)``; else those in ``[o_start, s_end)``, the
    rows past ``o_end`` as 0, under a mask computed on ``o // ZERO_FILL``: constant over runs of
    ``ZERO_FILL`` rows, so the compiler keeps ``ZERO_FILL``-element vector stores along the
    output's contiguous dim (under a per-row mask it stores single bytes). ``o_start`` and
    ``s_end`` must then be multiples of ``ZERO_FILL``."""
    o = o0 + tl.arange(0, BLOCK_R)
    src = x_cols + (o - o_start + in_start).to(tl.int64)[:, None] * stride_r
    dst = q_cols + o.to(tl.int64)[:, None] * stride_qr
    if MASK_ROWS:
        load_mask = ((o >= o_start) & (o < o_end))[:, None] & col_ok[None, :]
        if ZERO_FILL == 1:  # the input's rows only: one mask for both (``_store_strip`` writes the zeros)
            store_mask = load_mask
        else:
            ov = o // ZERO_FILL
            store_mask = ((ov >= o_start // ZERO_FILL) & (ov < s_end // ZERO_FILL))[:, None] & col_ok[None, :]
    else:
        load_mask = col_ok[None, :]
        store_mask = load_mask
    x = tl.load(src, mask=load_mask, other=0.0)
    q = to_fp8(x, inv_scale[None, :], OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE,
               FP8_NEG_ZERO)
    tl.store(dst, q, mask=store_mask)


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
    ZERO_FILL: tl.constexpr,
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

    First the tile past the last full one (the input's partial last tile), then the full tiles
    walking backwards (the rows read last, the freshest in L2, first), the partial tile at the
    start, and last the zeros (first, they made triton 3.9's allocator keep three pipelined loops'
    buffers live at once: 48 instead of 16 KiB of shared memory). Full tiles get no row mask, so
    their stores along the output's contiguous dim stay vectorized; with ``ZERO_FILL > 1`` the
    partial ones store ``ZERO_FILL``-row vectors and their rows' zeros (``_store_rows``).
    """
    o_end = tl.minimum(o_start + (in_end - in_start), o_limit)
    s_end = tl.maximum(tl.minimum(o_zero_end, o_limit), o_end)
    full_lo = tl.cdiv(o_start, BLOCK_R) * BLOCK_R
    full_hi = tl.maximum((o_end // BLOCK_R) * BLOCK_R, full_lo)
    if full_hi < s_end:
        _store_rows(x_cols, q_cols, full_hi, o_start, o_end, s_end, in_start, stride_r, stride_qr, inv_scale, col_ok,
                    True, ZERO_FILL, BLOCK_R, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE,
                    FP8_NEG_ZERO)
    for j in tl.range(0, (full_hi - full_lo) // BLOCK_R, num_stages=STAGES):
        o0 = tl.multiple_of(full_hi - (j + 1) * BLOCK_R, BLOCK_R)
        _store_rows(x_cols, q_cols, o0, o_start, o_end, s_end, in_start, stride_r, stride_qr, inv_scale, col_ok,
                    False, ZERO_FILL, BLOCK_R, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE,
                    FP8_NEG_ZERO)
    if (o_start < full_lo) & (o_start < s_end):
        _store_rows(x_cols, q_cols, full_lo - BLOCK_R, o_start, o_end, s_end, in_start, stride_r, stride_qr,
                    inv_scale, col_ok, True, ZERO_FILL, BLOCK_R, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT,
                    FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)
    # zeros only (no loads to pipeline): past the tiles above, or with per-row masks past o_end
    z0 = full_hi + BLOCK_R if ZERO_FILL > 1 else o_end
    zero = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32).to(OUT_DTYPE)
    for o0 in range((z0 // BLOCK_R) * BLOCK_R, s_end, BLOCK_R):
        o = o0 + tl.arange(0, BLOCK_R)
        ok = (o >= z0) & (o // ZERO_FILL < s_end // ZERO_FILL)
        tl.store(q_cols + o.to(tl.int64)[:, None] * stride_qr, zero, mask=ok[:, None] & col_ok[None, :])


@triton.jit
def _tile_aligned(row, start, o_start, BLOCK_R: tl.constexpr):
    """The last row at or before ``row`` of a group starting at ``start`` whose output row
    (``o_start + row - start``) starts a ``BLOCK_R`` tile; ``start`` if there is none. (Rows
    before ``row``: the members of this chunk and the one before have just read them.)"""
    o = (o_start + (row - start)) // BLOCK_R * BLOCK_R
    return tl.maximum(start + (o - o_start), start)


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
def _column_block(
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
    c,
    is_worker,
    n_chunks,
    G,
    N_UNI,
    rows_in,
    rows_out,
    tail_per_chunk,
    POW2: tl.constexpr,
    UNIFORM: tl.constexpr,
    PADDED: tl.constexpr,
    NO_WAIT: tl.constexpr,
    G_POW2: tl.constexpr,
    ZERO_FILL: tl.constexpr,
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
    """Chunk ``c`` (rows ``[c * CHUNK, ...)``) of column block ``cb`` of one tensor: its amax
    (member) or its quantized rows (worker; ``NO_WAIT``: the amaxes are complete before it starts).

    Rows are *virtual*: ``UNIFORM`` groups hold rows ``[g * N_UNI, (g + 1) * N_UNI)``, stored at
    ``g * stride_g + (row - g * N_UNI) * stride_r``; jagged group ``g`` holds rows ``[end[g-1],
    end[g])`` stored at ``row * stride_r``, where ``end`` is the running maximum of the offsets
    clamped to ``[0, rows_in]``: bad offsets can neither address memory outside the tensors nor
    leave a worker waiting for a piece no member reduces.
    """
    n_rows = G * N_UNI if UNIFORM else rows_in
    r0 = c * CHUNK
    r1 = tl.minimum(r0 + CHUNK, n_rows)
    last_chunk = c == n_chunks - 1
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    cols64 = cols.to(tl.int64)
    gi = tl.arange(0, G_POW2)
    if UNIFORM:
        ends = gi
        g = r0 // tl.maximum(N_UNI, 1)
    else:
        ends = group_ends(tl.load(offs_ptr + gi, mask=gi < G, other=0), rows_in)
        g = tl.sum(((ends < r0) & (gi < G)).to(tl.int32), axis=0)  # the first group ending at or after r0
    go = g < G
    while go:
        start, end = _group_rows(ends, gi, g, G, N_UNI, UNIFORM)
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
        x_cols = x_ptr + in_base + cols64[None, :] * stride_c
        q_cols = q_ptr + out_base + cols64[None, :] * stride_qc
        amax_cols = amax_ptr + g.to(tl.int64) * amax_stride + amax_col + cols
        cnt = cnt_ptr + g.to(tl.int64) * cnt_stride + cnt_col + cb
        p0 = tl.maximum(start, r0)
        p1 = tl.minimum(end, r1)
        if end > start:
            if p1 > p0:
                if is_worker:
                    if not NO_WAIT:
                        n_pieces = (end - 1) // CHUNK - start // CHUNK + 1
                        seen = tl.atomic_add(cnt, 0, sem="acquire")
                        while seen < n_pieces:  # members run ahead of workers: see the module docstring
                            seen = tl.atomic_add(cnt, 0, sem="acquire")
                        tl.debug_barrier()  # the acquire (one thread's) before every thread's amax loads
                    amax = tl.load(amax_cols, mask=col_ok, other=0, volatile=True).to(tl.float32, bitcast=True)
                    inv_scale, scale = fp8_scales(amax, FP8_MAX, POW2)
                    if p0 == start:
                        tl.store(s_ptr + g.to(tl.int64) * C + cols, scale, mask=col_ok)
                    w0 = p0
                    w1 = p1
                    if PADDED:  # piece ends inside the group move to output tile starts: unmasked full tiles
                        w0 = tl.where(p0 == start, p0, _tile_aligned(p0, start, o_start, BLOCK_R))
                        w1 = tl.where(p1 == end, p1, _tile_aligned(p1, start, o_start, BLOCK_R))
                    z_end = tl.where(p1 == end, o_zero_end, o_start + (w1 - start))
                    _store_strip(x_cols, q_cols, w0 - shift, w1 - shift, stride_r, o_start + (w0 - start), z_end,
                                 o_limit, stride_qr, inv_scale, col_ok, ZERO_FILL, BLOCK_R, BLOCK_C, STAGES, OUT_DTYPE,
                                 HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)
                else:
                    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
                    for r in tl.range(p0 - shift, p1 - shift, BLOCK_R, num_stages=STAGES):
                        rows = r + tl.arange(0, BLOCK_R)
                        x = tl.load(x_cols + rows.to(tl.int64)[:, None] * stride_r,
                                    mask=(rows < p1 - shift)[:, None] & col_ok[None, :], other=0.0)
                        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
                    bits = tl.max(acc, axis=0).to(tl.int32, bitcast=True)  # >= 0: ordered like the floats
                    tl.atomic_max(amax_cols, bits, mask=col_ok, sem="relaxed")
                    # Several warps run the atomic_max (threads 0-63 for 64 columns on sm_90), one
                    # thread the release below: without a CTA barrier between them the release does
                    # not order the other warps' maxima (a worker could read a partial amax).
                    tl.debug_barrier()
                    tl.atomic_add(cnt, 1, sem="release")
        elif is_worker:  # an empty group belongs to the chunk holding its start (the last chunk: start == n_rows)
            if tl.minimum(start // CHUNK, n_chunks - 1) == c:
                inv_scale, scale = fp8_scales(tl.zeros((BLOCK_C,), dtype=tl.float32), FP8_MAX, POW2)
                tl.store(s_ptr + g.to(tl.int64) * C + cols, scale, mask=col_ok)
                _store_strip(x_cols, q_cols, start - shift, start - shift, stride_r, o_start, o_zero_end,
                             o_limit, stride_qr, inv_scale, col_ok, ZERO_FILL, BLOCK_R, BLOCK_C, STAGES, OUT_DTYPE,
                             HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)
        g += 1
        nxt, _ = _group_rows(ends, gi, g, G, N_UNI, UNIFORM)
        go = (g < G) & ((nxt < r1) | last_chunk)

    if (not UNIFORM) and is_worker:  # rows in no group: this chunk's share of the tail
        t = tl.max(tl.where(gi < G, ends, 0), axis=0)
        x_cols = x_ptr + cols64[None, :] * stride_c
        q_cols = q_ptr + cols64[None, :] * stride_qc
        zero_scale = tl.zeros((BLOCK_C,), dtype=tl.float32)
        if PADDED:  # output rows [poffs[-1], rows_out) are 0, shared out in tail_per_chunk pieces
            pt = tl.minimum(tl.maximum(tl.load(poffs_ptr + G - 1, mask=G > 0, other=0), 0), rows_out)
            z0 = pt + c * tail_per_chunk
            _store_strip(x_cols, q_cols, 0, 0, stride_r, z0, z0 + tail_per_chunk, rows_out, stride_qr,
                         zero_scale, col_ok, ZERO_FILL, BLOCK_R, BLOCK_C, STAGES, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT,
                         FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)
        else:  # rows [end[-1], rows_in) are written as x * 0 (-0 for negative x, like the reference)
            z0 = tl.maximum(t, r0)
            z1 = tl.maximum(r1, z0)
            _store_strip(x_cols, q_cols, z0, z1, stride_r, z0, z1, rows_out, stride_qr, zero_scale, col_ok,
                         ZERO_FILL, BLOCK_R, BLOCK_C, STAGES, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL,
                         FP8_SUB_SCALE, FP8_NEG_ZERO)


@triton.jit
def _colwise_kernel(
    a_ptr,
    qa_ptr,
    sa_ptr,
    C_A,
    stride_ag,
    stride_ar,
    stride_ac,
    stride_qag,
    stride_qar,
    stride_qac,
    b_ptr,
    qb_ptr,
    sb_ptr,
    C_B,
    stride_br,
    stride_bc,
    stride_qbr,
    stride_qbc,
    offs_ptr,
    poffs_ptr,
    amax_ptr,
    cnt_ptr,
    G,
    N_UNI,
    rows_in,
    rows_out,
    n_chunks,
    tail_per_chunk,
    NB_A,
    NB_B,
    POW2: tl.constexpr,
    HAS_B: tl.constexpr,
    TICKETS: tl.constexpr,
    UNIFORM: tl.constexpr,
    PADDED: tl.constexpr,
    G_POW2: tl.constexpr,
    ZERO_FILL: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    STAGES: tl.constexpr,
    LAG: tl.constexpr,
    ROLES: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):
    """Program ``(column block, role, chunk)``: per column block, the members of every chunk, then
    the workers of every chunk, so a worker only ever waits for programs launched before it. With
    ``LAG > 0`` the workers of a column block come ``LAG`` column blocks later (after the members of
    column block ``cb + LAG``), so that their members have had time to finish: fewer workers spin on
    the counters, at the price of ``LAG`` more column blocks held in L2 (``2 * LAG * n_chunks`` idle
    programs pad the grid).

    The workspace (int32 zeros): ``amax (G, C_A + C_B)`` (fp32 bits), ``cnt (G, NB_A + NB_B)`` and
    one dispatch ticket. With ``TICKETS`` a program's place in the grid is the order in which it
    started (an atomic ticket, as rocPRIM's look-back scans do), not its program id, so the wait
    is safe even where the hardware does not start programs in id order; on NVIDIA GPUs, which
    do, the program id serves.

    ``ROLES``: ``ROLES_BOTH`` (the above), or one role per launch, ``(column block, chunk)`` per
    program: ``ROLES_MEMBERS`` (amaxes only), then ``ROLES_WORKERS`` in a second launch, which
    waits for nothing (the two-pass form: HBM reads each byte twice, no program ever spins).
    """
    if TICKETS:
        pid = tl.atomic_add(cnt_ptr + tl.maximum(G, 1) * (NB_A + NB_B), 1, sem="relaxed")
    else:
        pid = tl.program_id(0)
    slot = pid // n_chunks  # ROLES_BOTH: members of column block j, then workers of column block j - LAG
    c = pid % n_chunks
    if ROLES == ROLES_BOTH:
        is_worker = slot % 2 == 1
        cb = slot // 2 - is_worker.to(tl.int32) * LAG  # out of [0, NB_A + NB_B) in the LAG idle slots at each end
    else:
        is_worker = (pid >= 0) == (ROLES == ROLES_WORKERS)
        cb = slot
    no_wait = ROLES == ROLES_WORKERS  # a constexpr
    amax_stride = C_A + C_B
    cnt_stride = NB_A + NB_B
    if (cb >= 0) & (cb < NB_A):
        _column_block(a_ptr, qa_ptr, sa_ptr, cb, C_A, stride_ag, stride_ar, stride_ac, stride_qag, stride_qar,
                      stride_qac, amax_ptr, 0, amax_stride, cnt_ptr, 0, cnt_stride, offs_ptr, poffs_ptr, c, is_worker,
                      n_chunks, G, N_UNI, rows_in, rows_out, tail_per_chunk, POW2, UNIFORM, PADDED, no_wait, G_POW2,
                      ZERO_FILL, CHUNK, BLOCK_R, BLOCK_C, STAGES, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL,
                      FP8_SUB_SCALE, FP8_NEG_ZERO)
    elif HAS_B & (cb >= NB_A) & (cb < NB_A + NB_B):
        _column_block(b_ptr, qb_ptr, sb_ptr, cb - NB_A, C_B, 0, stride_br, stride_bc, 0, stride_qbr, stride_qbc,
                      amax_ptr, C_A, amax_stride, cnt_ptr, NB_A, cnt_stride, offs_ptr, poffs_ptr, c, is_worker,
                      n_chunks, G, N_UNI, rows_in, rows_out, tail_per_chunk, POW2, UNIFORM, PADDED, no_wait, G_POW2,
                      ZERO_FILL, CHUNK, BLOCK_R, BLOCK_C, STAGES, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL,
                      FP8_SUB_SCALE, FP8_NEG_ZERO)


# Workers trail their members by up to MAX_LAG column blocks: as many as keep the members of the
# ``lag + 1`` column blocks in between (``lag + 1`` times the chunks of a column block) within 3.5
# programs per multiprocessor, and at least one in jagged (wgrad) launches (``auto_lag``).
# Fitted to the default tile (256-row chunks of 32 x 128) on one H200 (132 multiprocessors;
# ``benchmarks/results/colwise_default_ab.md``: lags 0, 1, 2 and 4 on 19 launches of three models):
# on every launch the lag it picks was the fastest measured or within 1.3% of it (lag 3 was not
# timed, and the rule picks it for none of them). The bound sits between 3.39 per multiprocessor,
# below which DeepSeek-V3 W2's dgrad (224 chunks) falls back to lag 0 (13% slower: 161 against
# 143 µs), and 3.88, from which DeepSeek-V3 W1's dgrad and its wgrad operands (128 chunks) would
# take lag 3. Where one column block has 512 chunks or more (Llama 4 and Qwen3 dgrad) lag 0 won,
# by 1-5%; in jagged launches lag 0 was slowest or next slowest on every shape. Checked afterwards
# by a sweep of lags 0-4 on 12 shapes (the sweep script and its results are in git history): its pick
# was the fastest lag on 11 and 0.1% behind on the 12th; lag 3 was never the fastest. An earlier fit of
# 3 per multiprocessor at 512-row chunks of 64 x 64 tiles (lags 0-4): under
# this bound its picks there are within 3.1% of the best (DeepSeek-V3 W2: lag 3 against 2), at 32
# columns within 6%.
# Only NVIDIA's H200 was measured; elsewhere (ROCm: 304 CUs on an MI300X) the rule is applied as is.
MAX_LAG = 4
_MEMBERS_PER_TWO_SMS = 7  # 3.5 member programs per multiprocessor, in integers


def auto_lag(n_chunks: int, sms: int, jagged: bool) -> int:
    """Largest ``lag <= MAX_LAG`` with ``(lag + 1) * n_chunks <= 3.5 * sms``: the member programs of the
    column blocks that have been read and not yet written (``n_chunks`` members per column block)
    within 3.5 per multiprocessor. At least 1 when ``jagged`` (groups from offsets), else at least 0."""
    return max(int(jagged), min(MAX_LAG, _MEMBERS_PER_TWO_SMS * sms // (2 * max(n_chunks, 1)) - 1))


def zero_fill(uniform: bool, n_uni: int, padded: bool, rows_out: int) -> int:
    """``_colwise_kernel``'s ``ZERO_FILL``: 16 where every output row boundary is a multiple of 16
    (uniform groups of ``n_uni`` = 16k rows; padded groups, whose offsets are multiples of 16, in a
    buffer of ``rows_out`` = 16k rows), so partial tiles store 16-row vectors; else 1."""
    return 16 if (uniform and n_uni % 16 == 0) or (padded and rows_out % 16 == 0) else 1


def colwise_config(*, chunk: int = 256, block_r: int = 32, block_c: int = 128, stages: int = 3,
                   lag: int | None = None, num_warps: int = 4, maxnreg: int | None = 96,
                   two_pass: bool = False) -> dict:
    """Chunk rows, tile shape, software-pipeline stages of the row loops, how many column blocks the
    workers trail their members by (see ``_colwise_kernel``; ``None``: ``auto_lag`` per launch),
    warps, a cap on registers per thread (NVIDIA only, ignored elsewhere; ``None``: no cap), and
    ``two_pass``: members and workers in two launches (no waiting; ``lag`` unused) instead of one.

    Defaults (every launch: members and workers, workers alone, jagged groups and uniform experts):
    256-row chunks of 32 x 128 tiles, best on one H200 (2026-11-30). Members and workers
    (``benchmarks/results/colwise_default_ab.md``, auto lag, 19 launches of three models): 3-21%
    faster than 512-row chunks of 64 x 64 on 17 (group dual 8-21%, Llama 4 dgrad 6%), level on
    Qwen3's second dgrad; on DeepSeek-V3's second dgrad 8% slower at lag 0 (161 against 149 µs) and
    4% faster at lag 1 (143), which ``auto_lag`` gives it since its refit. Workers alone
    (``benchmarks/results/wgrad_both_amax_ab.md``, ``expert_colwise_from_amax.md``): 5-14% faster
    on the wgrad operands, 86-92% of copy on the dgrad layout against 79-82%. The cap of 96 lets 5
    programs share a multiprocessor instead of 4."""
    for name, v in (("chunk", chunk), ("block_r", block_r), ("block_c", block_c)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}: expected a power of two >= 16, got {v}")
    if lag is not None and (not isinstance(lag, int) or lag < 0):
        raise ValueError(f"lag: expected None or an int >= 0, got {lag!r}")
    return dict(CHUNK=chunk, BLOCK_R=block_r, BLOCK_C=block_c, STAGES=stages, LAG=lag, num_warps=num_warps,
                maxnreg=maxnreg, TWO_PASS=bool(two_pass))


def _launch(a, qa, sa, b, qb, sb, offs, padded_offs, G, n_uni, rows_in, rows_out, strides_a, fmt, pow2, config,
            hw_cast, amax_bits=None, after=None) -> None:
    """One launch over ``(column blocks of a and b) x 2 x chunks`` (two launches of half that with
    ``TWO_PASS``); ``offs=None``: ``G`` uniform groups of ``n_uni`` rows. ``amax_bits`` (int32
    ``(G, C_A + C_B)``, the complete amaxes as fp32 bits): the workers alone, in one launch.
    ``after`` (uniform groups only; see :func:`order_token`): passed where the offsets would go,
    which a uniform launch never reads (not while torch traces interpreted kernels:
    ``launch.interpreted_trace``)."""
    target = launch_target(a.device)
    cfg = {**colwise_config(), "TICKETS": target.kind == "hip", **(config or {})}
    if cfg["maxnreg"] is None or target.kind != "cuda":
        del cfg["maxnreg"]  # a launch option of NVIDIA's compiler only (the interpreter runs on CPU tensors)
    c_a = sa.shape[1]
    c_b = sb.shape[1] if b is not None else 0
    nb_a, nb_b = cdiv(c_a, cfg["BLOCK_C"]), cdiv(c_b, cfg["BLOCK_C"])
    uniform = offs is None
    if (uniform and G == 0) or nb_a + nb_b == 0:
        return
    n_chunks = max(cdiv(G * n_uni if uniform else rows_in, cfg["CHUNK"]), 1)
    dev = a.device
    g1 = max(G, 1)
    eager = type(qa) is torch.Tensor and not torch.compiler.is_compiling()
    n_amax, n_cnt = g1 * (c_a + c_b), g1 * (nb_a + nb_b) + 1
    if amax_bits is not None:  # workers that wait for nothing read no counter: any int32 pointer
        amax, cnt = amax_bits, amax_bits
    elif eager:  # one zero fill for both
        work = torch.zeros(n_amax + n_cnt, dtype=torch.int32, device=dev)
        amax, cnt = work[:n_amax], work[n_amax:]
    else:
        # While traced, two buffers: a traced launch clones each argument it writes through that
        # argument's base, and Inductor may have materialised a slice of a zeroed buffer on its own,
        # so the clone of the slice would read past it.
        amax = torch.zeros(n_amax, dtype=torch.int32, device=dev)
        cnt = torch.zeros(n_cnt, dtype=torch.int32, device=dev)
    # Without b: b's branch is compiled but never runs. Eagerly its outputs point at qa / sa (no
    # allocation); while traced they get one-element stand-ins of their dtypes (a traced launch clones
    # each argument the kernel may write apart, so an alias of qa would lose qa's writes).
    if b is not None:
        b_args = (b, qb, sb, c_b, b.stride(0), b.stride(1), qb.stride(0), qb.stride(1))
    elif eager:
        b_args = (a, qa, sa, 0, 0, 0, 0, 0)
    else:
        b_args = (a, qa.new_empty(1), sa.new_empty(1), 0, 0, 0, 0, 0)
    ordered = after is not None and not interpreted_trace(a)
    offs = (order_token(after) if ordered else cnt) if uniform else offs  # UNIFORM never reads it
    if cfg.pop("TWO_PASS", False) or amax_bits is not None:  # no program waits: no ticket needed, no lag
        passes = (ROLES_WORKERS,) if amax_bits is not None else (ROLES_MEMBERS, ROLES_WORKERS)
        launches = [((nb_a + nb_b) * n_chunks, r) for r in passes]
        cfg.update(TICKETS=False, LAG=0)
    else:
        if cfg.get("LAG") is None:
            cfg["LAG"] = auto_lag(n_chunks, multiprocessor_count(dev), jagged=not uniform)
        launches = [((nb_a + nb_b + cfg["LAG"]) * 2 * n_chunks, ROLES_BOTH)]
    padded = padded_offs is not None
    tail_per_chunk = cdiv(cdiv(rows_out, n_chunks), cfg["BLOCK_R"]) * cfg["BLOCK_R"]
    for grid, roles in launches:
        launch(_colwise_kernel)[(grid,)](
            a, qa, sa, c_a, *strides_a, *b_args, offs, padded_offs if padded else offs, amax, cnt,
            G, n_uni, rows_in, rows_out, n_chunks, tail_per_chunk, nb_a, nb_b,
            POW2=bool(pow2), HAS_B=b is not None, UNIFORM=uniform, PADDED=padded,
            ZERO_FILL=zero_fill(uniform, n_uni, padded, rows_out),
            G_POW2=next_power_of_2(max(G, 1)), ROLES=roles.value, **cfg,
            **format_constexprs(fmt, dev, hw_cast),
        )


def order_token(after: torch.Tensor) -> torch.Tensor:
    """One int32 element viewed from ``after`` (float32 or int32, not empty): an argument a launch
    takes and never reads, so that the launch depends on ``after`` in a traced graph. A layout that
    depends on the weights alone would otherwise be computed by torch.compile's partitioner in the
    forward and kept alive until the backward: handing the weight's dgrad quantization a tensor of
    the backward pass (grad_out's scales) keeps it in the backward."""
    if after.dtype not in (torch.float32, torch.int32) or after.numel() == 0:
        raise ValueError(f"after: expected a non-empty float32 or int32 tensor, got {after.dtype} "
                         f"of shape {tuple(after.shape)}")
    return after.reshape(-1)[:1].view(torch.int32)


def launch_expert_colwise_t(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, fmt: Float8Format, pow2: bool,
                            config: dict | None = None, hw_cast: bool | None = None,
                            amax_bits: torch.Tensor | None = None, after: torch.Tensor | None = None) -> None:
    """``w (E, N, K)`` (any strides) -> ``q (E, K, N)`` contiguous, ``scale (E, K)`` (amax over N).

    ``amax_bits (E, K)`` int32, the fp32 bits of each expert column's amax
    (``rowwise.launch_expert_rowwise_col_amax`` makes them): only the workers run, one read and one
    write of ``w``, nothing waits. ``after``: a tensor the launch is ordered after
    (:func:`order_token`)."""
    E, N, K = w.shape
    strides = (w.stride(0), w.stride(1), w.stride(2), K * N, 1, N)
    _launch(w, q, scale, None, None, None, None, None, E, N, N, N, strides, fmt, pow2, config, hw_cast,
            amax_bits=amax_bits, after=after)


def launch_group_colwise(
    a: torch.Tensor,
    qa: torch.Tensor,
    sa: torch.Tensor,
    b: torch.Tensor | None,
    qb: torch.Tensor | None,
    sb: torch.Tensor | None,
    offs: torch.Tensor,
    padded_offs: torch.Tensor | None,
    fmt: Float8Format,
    pow2: bool,
    config: dict | None = None,
    hw_cast: bool | None = None,
    amax_bits: torch.Tensor | None = None,
) -> None:
    """Per-group column scales of ``a (M, C_A)`` (and ``b (M, C_B)``) into the given ``q``/``scale`` buffers.

    ``qa``/``qb`` have ``rows_out`` rows and any strides; ``sa (G, C_A)``, ``sb (G, C_B)`` contiguous.
    ``amax_bits (G, C_A + C_B)`` int32, the per-group column amaxes as fp32 bits, ``a``'s columns
    then ``b``'s (``rowwise.launch_group_rowwise_amax`` makes each): only the workers run, one read
    and one write per element, nothing waits.
    """
    strides = (0, a.stride(0), a.stride(1), 0, qa.stride(0), qa.stride(1))
    _launch(a, qa, sa, b, qb, sb, offs, padded_offs, offs.numel(), 1, a.shape[0], qa.shape[0], strides, fmt, pow2,
            config, hw_cast, amax_bits=amax_bits)
