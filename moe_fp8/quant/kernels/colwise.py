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
``LAG`` column blocks (``colwise_config(lag=...)``). With ``colwise_config(two_pass=True)`` the
members run in one launch and the workers in a second one that waits for nothing (HBM then reads
each input byte twice). The sequential CPU interpreter runs members first, so its workers
never spin. Counts a worker waits for are derived from the same clamped running-max offsets the
members use, so no offsets, however bad, leave a worker waiting forever.

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
unmasked, vectorized stores along the output's contiguous dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...launch_math import cdiv, next_power_of_2
from ..formats import Float8Format
from ..triton_helpers import fp8_scales
from .colwise_parts import _empty_group, _first_group, _group_out, _group_rows, _store_strip, _tail_rows, _tile_aligned
from .colwise_resident import _resident_chunk
from .common import format_constexprs

__all__ = ["colwise_config", "launch_expert_colwise_t", "launch_group_colwise"]

# What the programs of one launch do (``_colwise_kernel``'s ``ROLES``).
ROLES_BOTH = tl.constexpr(0)
ROLES_MEMBERS = tl.constexpr(1)
ROLES_WORKERS = tl.constexpr(2)
ROLES_RESIDENT = tl.constexpr(3)  # one program per chunk holds it in registers (.colwise_resident)
ROLES_LATE = tl.constexpr(4)  # one program per column block quantizes the chunks flagged late


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
    ALIGN_PIECES: tl.constexpr,
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
    """Chunk ``c`` (rows ``[c * CHUNK, ...)``) of column block ``cb`` of one tensor: its amax
    (member) or its quantized rows (worker; ``NO_WAIT``: the amaxes are complete before it starts;
    ``ALIGN_PIECES``: with padded output, piece ends inside a group move to output tile starts,
    which every worker of the launch must agree on). Virtual rows and output placement:
    :mod:`.colwise_parts`.
    """
    n_rows = G * N_UNI if UNIFORM else rows_in
    r0 = c * CHUNK
    r1 = tl.minimum(r0 + CHUNK, n_rows)
    last_chunk = c == n_chunks - 1
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    cols64 = cols.to(tl.int64)
    gi, ends, g = _first_group(offs_ptr, r0, G, N_UNI, rows_in, UNIFORM, G_POW2)
    go = g < G
    while go:
        start, end = _group_rows(ends, gi, g, G, N_UNI, UNIFORM)
        shift, in_base, out_base, o_start, o_zero_end, o_limit = _group_out(g, start, stride_g, stride_qg, poffs_ptr,
                                                                            end, rows_out, N_UNI, UNIFORM, PADDED)
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
                    if PADDED and ALIGN_PIECES:  # piece ends inside the group move to output tile starts: unmasked full tiles
                        w0 = tl.where(p0 == start, p0, _tile_aligned(p0, start, o_start, BLOCK_R))
                        w1 = tl.where(p1 == end, p1, _tile_aligned(p1, start, o_start, BLOCK_R))
                    z_end = tl.where(p1 == end, o_zero_end, o_start + (w1 - start))
                    _store_strip(x_cols, q_cols, w0 - shift, w1 - shift, stride_r, o_start + (w0 - start), z_end,
                                 o_limit, stride_qr, inv_scale, col_ok, BLOCK_R, BLOCK_C, STAGES, OUT_DTYPE, HW_CAST,
                                 FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)
                else:
                    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
                    for r in tl.range(p0 - shift, p1 - shift, BLOCK_R, num_stages=STAGES):
                        rows = r + tl.arange(0, BLOCK_R)
                        x = tl.load(x_cols + rows.to(tl.int64)[:, None] * stride_r,
                                    mask=(rows < p1 - shift)[:, None] & col_ok[None, :], other=0.0)
                        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
                    bits = tl.max(acc, axis=0).to(tl.int32, bitcast=True)  # >= 0: ordered like the floats
                    tl.atomic_max(amax_cols, bits, mask=col_ok, sem="relaxed")
                    # Several warps issue the atomic_max (threads 0-63 for 64 columns on sm_90), one
                    # thread the release below: without a CTA barrier between them the release does
                    # not order the other warps' maxima (a worker could read a partial amax).
                    tl.debug_barrier()
                    tl.atomic_add(cnt, 1, sem="release")
        elif is_worker:
            _empty_group(q_cols, s_ptr, g, C, cols, col_ok, start, o_start, o_zero_end, o_limit, stride_qr, c, n_chunks,
                         POW2, CHUNK, BLOCK_R, BLOCK_C, OUT_DTYPE, FP8_MAX)
        g += 1
        nxt, _ = _group_rows(ends, gi, g, G, N_UNI, UNIFORM)
        go = (g < G) & ((nxt < r1) | last_chunk)

    if (not UNIFORM) and is_worker:  # rows in no group: this chunk's share of the tail
        _tail_rows(x_ptr, q_ptr, cols64, col_ok, gi, ends, G, c, r0, r1, poffs_ptr, rows_out, tail_per_chunk, stride_r,
                   stride_c, stride_qr, stride_qc, PADDED, BLOCK_R, BLOCK_C, STAGES, OUT_DTYPE, HW_CAST, FP8_MAX,
                   FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)


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
    late_ptr,
    G,
    N_UNI,
    rows_in,
    rows_out,
    n_chunks,
    tail_per_chunk,
    NB_A,
    NB_B,
    max_polls,
    POW2: tl.constexpr,
    HAS_B: tl.constexpr,
    TICKETS: tl.constexpr,
    UNIFORM: tl.constexpr,
    PADDED: tl.constexpr,
    G_POW2: tl.constexpr,
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
    waits for nothing (the two-pass form: HBM reads each byte twice, no program ever spins); or
    ``ROLES_RESIDENT`` (:mod:`.colwise_resident`, ``late_ptr`` its late count and flags), then
    ``ROLES_LATE``, one program per column block, which quantizes that launch's late chunks.
    """
    pid = tl.program_id(0)
    if TICKETS:
        if ROLES != ROLES_LATE:
            pid = tl.atomic_add(cnt_ptr + tl.maximum(G, 1) * (NB_A + NB_B), 1, sem="relaxed")
    amax_stride = C_A + C_B
    cnt_stride = NB_A + NB_B
    if ROLES == ROLES_RESIDENT:
        cb = pid // n_chunks
        c = pid % n_chunks
        if cb < NB_A:
            _resident_chunk(a_ptr, qa_ptr, sa_ptr, cb, C_A, stride_ag, stride_ar, stride_ac, stride_qag, stride_qar,
                            stride_qac, amax_ptr, 0, amax_stride, cnt_ptr, 0, cnt_stride, offs_ptr, poffs_ptr, late_ptr,
                            pid, c, n_chunks, G, N_UNI, rows_in, rows_out, tail_per_chunk, max_polls, POW2, UNIFORM,
                            PADDED, G_POW2, CHUNK, BLOCK_R, BLOCK_C, STAGES, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT,
                            FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)
        elif HAS_B & (cb < NB_A + NB_B):
            _resident_chunk(b_ptr, qb_ptr, sb_ptr, cb - NB_A, C_B, 0, stride_br, stride_bc, 0, stride_qbr, stride_qbc,
                            amax_ptr, C_A, amax_stride, cnt_ptr, NB_A, cnt_stride, offs_ptr, poffs_ptr, late_ptr, pid,
                            c, n_chunks, G, N_UNI, rows_in, rows_out, tail_per_chunk, max_polls, POW2, UNIFORM, PADDED,
                            G_POW2, CHUNK, BLOCK_R, BLOCK_C, STAGES, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT,
                            FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)
    elif ROLES == ROLES_LATE:
        if tl.load(late_ptr) > 0:
            for c in range(n_chunks):
                if tl.load(late_ptr + 1 + pid * n_chunks + c) != 0:
                    _column_roles(a_ptr, qa_ptr, sa_ptr, C_A, stride_ag, stride_ar, stride_ac, stride_qag, stride_qar,
                                  stride_qac, b_ptr, qb_ptr, sb_ptr, C_B, stride_br, stride_bc, stride_qbr, stride_qbc,
                                  offs_ptr, poffs_ptr, amax_ptr, cnt_ptr, pid, c, True, G, N_UNI, rows_in, rows_out,
                                  n_chunks, tail_per_chunk, NB_A, NB_B, POW2, HAS_B, UNIFORM, PADDED, True, False, G_POW2,
                                  CHUNK, BLOCK_R, BLOCK_C, STAGES, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT,
                                  FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)
    else:
        slot = pid // n_chunks  # ROLES_BOTH: members of column block j, then workers of column block j - LAG
        c = pid % n_chunks
        if ROLES == ROLES_BOTH:
            is_worker = slot % 2 == 1
            cb = slot // 2 - is_worker.to(tl.int32) * LAG  # out of [0, NB_A + NB_B) in the LAG idle slots at each end
        else:
            is_worker = (pid >= 0) == (ROLES == ROLES_WORKERS)
            cb = slot
        _column_roles(a_ptr, qa_ptr, sa_ptr, C_A, stride_ag, stride_ar, stride_ac, stride_qag, stride_qar, stride_qac,
                      b_ptr, qb_ptr, sb_ptr, C_B, stride_br, stride_bc, stride_qbr, stride_qbc, offs_ptr, poffs_ptr,
                      amax_ptr, cnt_ptr, cb, c, is_worker, G, N_UNI, rows_in, rows_out, n_chunks, tail_per_chunk, NB_A,
                      NB_B, POW2, HAS_B, UNIFORM, PADDED, ROLES == ROLES_WORKERS, True, G_POW2, CHUNK, BLOCK_R, BLOCK_C,
                      STAGES, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)


@triton.jit
def _column_roles(a_ptr, qa_ptr, sa_ptr, C_A, stride_ag, stride_ar, stride_ac, stride_qag, stride_qar, stride_qac, b_ptr,
                  qb_ptr, sb_ptr, C_B, stride_br, stride_bc, stride_qbr, stride_qbc, offs_ptr, poffs_ptr, amax_ptr,
                  cnt_ptr, cb, c, is_worker, G, N_UNI, rows_in, rows_out, n_chunks, tail_per_chunk, NB_A, NB_B,
                  POW2: tl.constexpr, HAS_B: tl.constexpr, UNIFORM: tl.constexpr, PADDED: tl.constexpr,
                  NO_WAIT: tl.constexpr, ALIGN_PIECES: tl.constexpr, G_POW2: tl.constexpr, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_C: tl.constexpr, STAGES: tl.constexpr, OUT_DTYPE: tl.constexpr, HW_CAST: tl.constexpr,
                  FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr,
                  FP8_SUB_SCALE: tl.constexpr, FP8_NEG_ZERO: tl.constexpr):
    """Member or worker of chunk ``c`` of column block ``cb`` of ``a`` (``cb < NB_A``) or ``b``."""
    amax_stride = C_A + C_B
    cnt_stride = NB_A + NB_B
    if (cb >= 0) & (cb < NB_A):
        _column_block(a_ptr, qa_ptr, sa_ptr, cb, C_A, stride_ag, stride_ar, stride_ac, stride_qag, stride_qar,
                      stride_qac, amax_ptr, 0, amax_stride, cnt_ptr, 0, cnt_stride, offs_ptr, poffs_ptr, c, is_worker,
                      n_chunks, G, N_UNI, rows_in, rows_out, tail_per_chunk, POW2, UNIFORM, PADDED, NO_WAIT, ALIGN_PIECES, G_POW2,
                      CHUNK, BLOCK_R, BLOCK_C, STAGES, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL,
                      FP8_SUB_SCALE, FP8_NEG_ZERO)
    elif HAS_B & (cb >= NB_A) & (cb < NB_A + NB_B):
        _column_block(b_ptr, qb_ptr, sb_ptr, cb - NB_A, C_B, 0, stride_br, stride_bc, 0, stride_qbr, stride_qbc,
                      amax_ptr, C_A, amax_stride, cnt_ptr, NB_A, cnt_stride, offs_ptr, poffs_ptr, c, is_worker,
                      n_chunks, G, N_UNI, rows_in, rows_out, tail_per_chunk, POW2, UNIFORM, PADDED, NO_WAIT, ALIGN_PIECES, G_POW2,
                      CHUNK, BLOCK_R, BLOCK_C, STAGES, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL,
                      FP8_SUB_SCALE, FP8_NEG_ZERO)


# Workers of the jagged (wgrad) launches trail their members by 4 column blocks: +5-10% over 0 on
# every model's wgrad dual in the H200 sweep (BENCHMARKS.md); the uniform (dgrad) launch keeps 0,
# where a lag won on DeepSeek-V3 but lost on Llama 4 and Qwen3.
GROUP_LAG = 4


def colwise_config(*, chunk: int | None = None, block_r: int = 64, block_c: int = 64, stages: int = 3, lag: int = 0,
                   num_warps: int = 4, maxnreg: int | None = 96, two_pass: bool = False, resident: bool = False,
                   max_polls: int | None = None) -> dict:
    """Chunk rows, tile shape, software-pipeline stages of the row loops, how many column blocks the
    workers trail their members by (see ``_colwise_kernel``), warps, a cap on registers per thread
    (NVIDIA only, ignored elsewhere; ``None``: no cap), and the form of the launch: members and
    workers in one launch (default), in two (``two_pass``: no waiting; ``lag`` unused), or one
    program per chunk holding it in registers (``resident``, :mod:`.colwise_resident`; ``chunk`` is
    then the rows held, ``lag`` unused, and a program gives up waiting after ``max_polls`` polls:
    default 4096 on a GPU, 0 in the interpreter, where programs run one at a time). ``chunk``
    defaults to 512, or 128 when ``resident``. Defaults: best of a sweep on one H200 (see
    BENCHMARKS.md); the cap of 96 lets 5 programs share a multiprocessor instead of 4."""
    if chunk is None:
        chunk = 128 if resident else 512
    for name, v in (("chunk", chunk), ("block_r", block_r), ("block_c", block_c)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}: expected a power of two >= 16, got {v}")
    if not isinstance(lag, int) or lag < 0:
        raise ValueError(f"lag: expected an int >= 0, got {lag!r}")
    if two_pass and resident:
        raise ValueError("two_pass and resident are two different launch forms: pick one")
    if max_polls is not None and (not isinstance(max_polls, int) or max_polls < 0):
        raise ValueError(f"max_polls: expected an int >= 0 or None, got {max_polls!r}")
    return dict(CHUNK=chunk, BLOCK_R=block_r, BLOCK_C=block_c, STAGES=stages, LAG=lag, num_warps=num_warps,
                maxnreg=maxnreg, TWO_PASS=bool(two_pass), RESIDENT=bool(resident), MAX_POLLS=max_polls)


# Polls before a resident program gives up waiting (about 3 ms at ~0.7 us per L2 round trip); its
# normal wait is a few microseconds.
_GPU_MAX_POLLS = 4096


def _launch(a, qa, sa, b, qb, sb, offs, padded_offs, G, n_uni, rows_in, rows_out, strides_a, fmt, pow2, config,
            hw_cast) -> None:
    """One launch over ``(column blocks of a and b) x 2 x chunks``; with ``TWO_PASS`` two launches of
    half that; with ``RESIDENT`` one over ``(column blocks) x chunks`` and one over column blocks.
    ``offs=None``: ``G`` uniform groups of ``n_uni`` rows."""
    cfg = {**colwise_config(), "TICKETS": torch.version.hip is not None, **(config or {})}
    if cfg["maxnreg"] is None or not a.is_cuda or torch.version.hip is not None:
        del cfg["maxnreg"]  # a launch option of NVIDIA's compiler only (the interpreter runs on CPU tensors)
    two_pass, resident = cfg.pop("TWO_PASS", False), cfg.pop("RESIDENT", False)
    max_polls = cfg.pop("MAX_POLLS", None)
    if max_polls is None:
        max_polls = _GPU_MAX_POLLS if a.is_cuda else 0
    c_a = sa.shape[1]
    c_b = sb.shape[1] if b is not None else 0
    nb_a, nb_b = cdiv(c_a, cfg["BLOCK_C"]), cdiv(c_b, cfg["BLOCK_C"])
    uniform = offs is None
    if (uniform and G == 0) or nb_a + nb_b == 0:
        return
    n_chunks = max(cdiv(G * n_uni if uniform else rows_in, cfg["CHUNK"]), 1)
    dev = a.device
    g1 = max(G, 1)
    n_late = 1 + (nb_a + nb_b) * n_chunks if resident else 0
    work = torch.zeros(g1 * (c_a + c_b + nb_a + nb_b) + 1 + n_late, dtype=torch.int32, device=dev)
    amax, cnt = work[: g1 * (c_a + c_b)], work[g1 * (c_a + c_b):]
    late = cnt[g1 * (nb_a + nb_b) + 1:] if resident else cnt
    b_args = (b, qb, sb, c_b, b.stride(0), b.stride(1), qb.stride(0), qb.stride(1)) if b is not None else (
        a, qa, sa, 0, 0, 0, 0, 0)
    offs = cnt if uniform else offs  # any int32 pointer: UNIFORM never reads it
    if two_pass:  # no program waits: no ticket needed, no lag
        launches = [((nb_a + nb_b) * n_chunks, ROLES_MEMBERS), ((nb_a + nb_b) * n_chunks, ROLES_WORKERS)]
        cfg.update(TICKETS=False, LAG=0)
    elif resident:
        launches = [((nb_a + nb_b) * n_chunks, ROLES_RESIDENT), (nb_a + nb_b, ROLES_LATE)]
        cfg.update(LAG=0)
    else:
        launches = [((nb_a + nb_b + cfg["LAG"]) * 2 * n_chunks, ROLES_BOTH)]
    for grid, roles in launches:
        _colwise_kernel[(grid,)](
            a, qa, sa, c_a, *strides_a, *b_args, offs, padded_offs if padded_offs is not None else offs, amax, cnt,
            late, G, n_uni, rows_in, rows_out, n_chunks, cdiv(rows_out, n_chunks), nb_a, nb_b, max_polls,
            POW2=bool(pow2), HAS_B=b is not None, UNIFORM=uniform, PADDED=padded_offs is not None,
            G_POW2=next_power_of_2(max(G, 1)), ROLES=roles.value, **cfg,
            **format_constexprs(fmt, dev, hw_cast),
        )


def launch_expert_colwise_t(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, fmt: Float8Format, pow2: bool,
                            config: dict | None = None, hw_cast: bool | None = None) -> None:
    """``w (E, N, K)`` (any strides) -> ``q (E, K, N)`` contiguous, ``scale (E, K)`` (amax over N)."""
    E, N, K = w.shape
    strides = (w.stride(0), w.stride(1), w.stride(2), K * N, 1, N)
    _launch(w, q, scale, None, None, None, None, None, E, N, N, N, strides, fmt, pow2, config, hw_cast)


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
) -> None:
    """Per-group column scales of ``a (M, C_A)`` (and ``b (M, C_B)``) into the given ``q``/``scale`` buffers.

    ``qa``/``qb`` have ``rows_out`` rows and any strides; ``sa (G, C_A)``, ``sb (G, C_B)`` contiguous.
    Default ``LAG``: ``GROUP_LAG``.
    """
    strides = (0, a.stride(0), a.stride(1), 0, qa.stride(0), qa.stride(1))
    config = {"LAG": GROUP_LAG, **(config or {})}
    _launch(a, qa, sa, b, qb, sb, offs, padded_offs, offs.numel(), 1, a.shape[0], qa.shape[0], strides, fmt, pow2,
            config, hw_cast)
