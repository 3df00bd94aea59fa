"""Row-wise FP8 quantization: one scale per row, amax over the last dim, in one launch.

Serves ``quantize_rowwise`` (``(M, K)``: activations, grad_output) and the forward expert layout
of ``quantize_expert_colwise`` (``(E, N, K)`` seen as ``E * N`` rows of ``K``). Row ``r`` of the
input lives at ``(r // rows_per_group) * stride_g + (r % rows_per_group) * stride_r``, so 3D
weights need no copy; the output is always row-major contiguous.

When a whole row fits in registers (``K <= 16384``) each program loads its rows once, reduces,
and writes: one HBM read and one write per element. Longer rows take two passes over ``K`` (the
second pass re-reads the program's rows, which are still in L2).

``launch_expert_rowwise_col_amax`` writes the same forward expert layout and, from the same read,
the amax over N of every expert column (what the dgrad layout's scales need): the dgrad layout
then costs one more read and write of ``w`` (``colwise.launch_expert_colwise_t(amax_bits=...)``)
instead of a reduction over strided columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...launch import launch
from ...launch_math import cdiv, next_power_of_2
from ..formats import Float8Format
from ..triton_helpers import fp8_scales
from .common import format_constexprs, group_ends, to_fp8

__all__ = [
    "rowwise_block",
    "rowwise_config",
    "launch_rowwise",
    "col_amax_fits",
    "launch_expert_rowwise_col_amax",
    "launch_group_rowwise_amax",
    "col_amax_rows_per_program",
    "col_amax_min_programs",
    "col_amax_defaults",
    "col_amax_tile",
    "expert_strips",
]

# Largest row held in registers in one piece; longer rows loop over K twice, TWO_PASS_BLOCK_K
# elements per loop step.
MAX_SINGLE_PASS_K = 16384
TWO_PASS_BLOCK_K = 2048
# Elements per program tile (rows x padded K) and per loop step of the two-pass path. Measured on
# one H200 (2026-11): 4096 with 4 warps ties 8192 with 8 warps on K = 7168 and beats it on K = 5120.
TILE_ELEMENTS = 4096
# The forward expert layout with column amax: rows per program (one atomic per column and program)
# and software-pipeline stages of its row loop. Best of a sweep on one H200 (2026-11-30, six model
# weights, rows 32/128 x warps 4/8 x stages 1/3 x tiles 2048-8192): 128 rows, 3 stages, 4 warps
# ran at 84-91% of copy where K >= 2048 (71% at K = 768); one stage ran at 44-82%.
ROWS_PER_PROGRAM = 128
ROW_STAGES = 3
# Both column-amax kernels take fewer rows per program where 128 would leave too few programs: a
# dense linear's 8192 token rows (one group) made 64 programs for 132 multiprocessors, a dense
# 4096 x 4096 weight (one expert) 32 (Llama3-8B sizes, 2026-12-05,
# ``bench_job_acc4_llama3_8b_profile.md``). Each program adds one atomic per column. On one H100
# (2026-12-07, ``sweep_col_amax_kernels_rule_h100.md``) about one program per multiprocessor
# (MIN_COL_AMAX_PROGRAMS) ran fastest where a loop step reads at least FULL_STEP_BYTES (its stages
# then keep 48 KiB or more in flight), and two per multiprocessor where steps are shorter (bf16
# rows of 5120 or 7168, one per step: 4-14% faster than 128; rows of 1536, four per step, within
# 5% either way).
# ``benchmarks/sweep_col_amax_kernels.py`` sweeps the trade.
MIN_COL_AMAX_PROGRAMS = 128
FULL_STEP_BYTES = 16384
# Elements per loop step of the column-amax kernels for rows of 1025 to 4096 elements (two to four
# rows; ``col_amax_tile``): faster than TILE_ELEMENTS on every such shape of the same sweep (K =
# 1536, 2048 and 4096: 1-12%). Shorter rows were not swept.
WIDE_STEP_ELEMENTS = 8192


@triton.jit
def _rows_in_registers(
    x_ptr,
    q_ptr,
    in_row,
    out_row,
    row_ok,
    s_ptrs,
    K,
    stride_k,
    POW2: tl.constexpr,
    BLOCK_K: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):
    """Quantize whole rows held in registers (``K <= BLOCK_K``): rows start at ``in_row`` (element
    offsets into ``x``) and ``out_row`` (into the row-major ``q``), scales go to ``s_ptrs``.
    Returns ``|x|`` as fp32, ``(BLOCK_M, BLOCK_K)`` (0 in masked lanes), for a column amax."""
    cols = tl.arange(0, BLOCK_K)
    mask = row_ok[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + in_row[:, None] + cols.to(tl.int64)[None, :] * stride_k, mask=mask, other=0.0)
    ax = tl.abs(x.to(tl.float32))
    inv_scale, scale = fp8_scales(tl.max(ax, axis=1), FP8_MAX, POW2)
    q = to_fp8(x, inv_scale[:, None], OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE,
               FP8_NEG_ZERO)
    tl.store(q_ptr + out_row[:, None] + cols[None, :], q, mask=mask)
    tl.store(s_ptrs, scale, mask=row_ok)
    return ax


@triton.jit
def rowwise_block(
    x_ptr,
    q_ptr,
    s_ptr,
    pid,
    M,
    K,
    rows_per_group,
    stride_g,
    stride_r,
    stride_k,
    POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):
    """Quantize rows ``[pid * BLOCK_M, (pid + 1) * BLOCK_M)``: q row-major ``(M, K)``, scale ``(M,)``."""
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    in_row = (rows // rows_per_group).to(tl.int64) * stride_g + (rows % rows_per_group).to(tl.int64) * stride_r
    out_row = rows.to(tl.int64) * K
    if SINGLE_PASS:
        _rows_in_registers(x_ptr, q_ptr, in_row, out_row, row_ok, s_ptr + rows, K, stride_k, POW2, BLOCK_K,
                           OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = row_ok[:, None] & (cols < K)[None, :]
            x = tl.load(x_ptr + in_row[:, None] + cols.to(tl.int64)[None, :] * stride_k, mask=mask, other=0.0)
            acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
        inv_scale, scale = fp8_scales(tl.max(acc, axis=1), FP8_MAX, POW2)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = row_ok[:, None] & (cols < K)[None, :]
            x = tl.load(x_ptr + in_row[:, None] + cols.to(tl.int64)[None, :] * stride_k, mask=mask, other=0.0)
            q = to_fp8(x, inv_scale[:, None], OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE,
                   FP8_NEG_ZERO)
            tl.store(q_ptr + out_row[:, None] + cols[None, :], q, mask=mask)
        tl.store(s_ptr + rows, scale, mask=row_ok)


@triton.jit
def _rowwise_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    rows_per_group,
    stride_g,
    stride_r,
    stride_k,
    POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):
    rowwise_block(x_ptr, q_ptr, s_ptr, tl.program_id(0), M, K, rows_per_group, stride_g, stride_r, stride_k,
                  POW2, BLOCK_M, BLOCK_K, SINGLE_PASS, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL,
                  FP8_SUB_SCALE, FP8_NEG_ZERO)


@triton.jit
def _expert_rowwise_col_amax_kernel(
    w_ptr,
    q_ptr,
    s_ptr,
    amax_ptr,
    N,
    K,
    stride_g,
    stride_r,
    stride_k,
    POW2: tl.constexpr,
    ROWS: tl.constexpr,
    STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):
    """Program ``(expert e, strip j)``: rows ``[j * ROWS, (j + 1) * ROWS)`` of expert ``e``, quantized
    row by row as ``rowwise_block`` does, and their column amax merged into ``amax (E, K)`` (the fp32
    bits, as int32: amaxes are >= 0, so the integers order like the floats) by one relaxed
    ``atomic_max`` per column."""
    e = tl.program_id(0)
    r0 = tl.program_id(1) * ROWS
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)  # in the tiles' layout: no conversion per step
    for i in tl.range(0, ROWS, BLOCK_M, num_stages=STAGES):
        r = r0 + i + tl.arange(0, BLOCK_M)
        row_ok = r < N
        rows = e * N + r
        in_row = e.to(tl.int64) * stride_g + r.to(tl.int64) * stride_r
        ax = _rows_in_registers(w_ptr, q_ptr, in_row, rows.to(tl.int64) * K, row_ok, s_ptr + rows, K, stride_k, POW2,
                                BLOCK_K, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE,
                                FP8_NEG_ZERO)
        acc = tl.maximum(acc, ax)
    cols = tl.arange(0, BLOCK_K)
    bits = tl.max(acc, axis=0).to(tl.int32, bitcast=True)
    tl.atomic_max(amax_ptr + e * K + cols, bits, mask=cols < K, sem="relaxed")


@triton.jit
def _group_rowwise_amax_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    amax_ptr,
    offs_ptr,
    M,
    K,
    G,
    stride_r,
    stride_k,
    POW2: tl.constexpr,
    ROWS: tl.constexpr,
    STAGES: tl.constexpr,
    G_POW2: tl.constexpr,
    WRITE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):
    """Program ``j``: rows ``[j * ROWS, (j + 1) * ROWS)`` of ``x (M, K)`` quantized row by row
    (``WRITE_ROWS``; else only read), and the column amax of each piece of a jagged group among
    them merged into ``amax (G, K)`` (fp32 bits as int32, one relaxed ``atomic_max`` per column and
    piece). Group ``g`` holds rows ``[end[g-1], end[g])``, ``end`` the running maximum of the
    offsets clamped to ``[0, M]`` (bad offsets move rows between groups, never outside ``x``); rows
    at or past ``end[-1]`` belong to no group (quantized with ``WRITE_ROWS``, else not read)."""
    r0 = tl.program_id(0) * ROWS
    r1 = tl.minimum(r0 + ROWS, M)
    gi = tl.arange(0, G_POW2)
    ends = group_ends(tl.load(offs_ptr + gi, mask=gi < G, other=0), M)
    last = tl.max(tl.where(gi < G, ends, 0), axis=0)
    g = tl.sum(((ends <= r0) & (gi < G)).to(tl.int32), axis=0)  # the first group ending after r0
    start = tl.sum(tl.where(gi == g - 1, ends, 0), axis=0)
    cols = tl.arange(0, BLOCK_K)
    while (g < G) & (start < r1):
        end = tl.sum(tl.where(gi == g, ends, 0), axis=0)
        p0 = tl.maximum(start, r0)
        p1 = tl.minimum(end, r1)
        acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)  # in the tiles' layout, as the expert kernel
        for r in tl.range(p0, p1, BLOCK_M, num_stages=STAGES):
            rows = r + tl.arange(0, BLOCK_M)
            row_ok = rows < p1
            if WRITE_ROWS:
                ax = _rows_in_registers(x_ptr, q_ptr, rows.to(tl.int64) * stride_r, rows.to(tl.int64) * K, row_ok,
                                        s_ptr + rows, K, stride_k, POW2, BLOCK_K, OUT_DTYPE, HW_CAST, FP8_MAX,
                                        FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)
            else:
                x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_r + cols.to(tl.int64)[None, :] * stride_k,
                            mask=row_ok[:, None] & (cols < K)[None, :], other=0.0)
                ax = tl.abs(x.to(tl.float32))
            acc = tl.maximum(acc, ax)
        if p1 > p0:
            bits = tl.max(acc, axis=0).to(tl.int32, bitcast=True)
            tl.atomic_max(amax_ptr + g.to(tl.int64) * K + cols, bits, mask=cols < K, sem="relaxed")
        g += 1
        start = end
    if WRITE_ROWS:
        for r in tl.range(tl.maximum(last, r0), r1, BLOCK_M, num_stages=STAGES):  # rows in no group
            rows = r + tl.arange(0, BLOCK_M)
            _rows_in_registers(x_ptr, q_ptr, rows.to(tl.int64) * stride_r, rows.to(tl.int64) * K, rows < r1,
                               s_ptr + rows, K, stride_k, POW2, BLOCK_K, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT,
                               FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)


def rowwise_config(M: int, K: int, tile: int = TILE_ELEMENTS, num_warps: int | None = None) -> dict:
    """Block sizes for ``M`` rows of ``K`` (``M`` may be a traced size: ``next_power_of_2`` guards ranges).

    Returns ``BLOCK_M``, ``BLOCK_K``, ``SINGLE_PASS`` (constexprs) and ``num_warps``.
    """
    padded_k = next_power_of_2(max(K, 16))
    if padded_k <= MAX_SINGLE_PASS_K:
        block_k, single = padded_k, True
        block_m = max(1, next_power_of_2(M, cap=tile // block_k))
    else:
        block_k, single, block_m = TWO_PASS_BLOCK_K, False, max(1, tile // TWO_PASS_BLOCK_K)
    warps = num_warps or (8 if block_m * block_k > 8192 else 4)
    return dict(BLOCK_M=block_m, BLOCK_K=block_k, SINGLE_PASS=single, num_warps=warps)


def launch_rowwise(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    fmt: Float8Format,
    pow2: bool,
    *,
    M: int,
    K: int,
    rows_per_group: int,
    stride_g: int,
    stride_r: int,
    stride_k: int,
    config: dict | None = None,
    hw_cast: bool | None = None,
) -> None:
    """Fill ``q`` (``M * K`` row-major elements) and ``scale`` (``M``) from ``x`` (see the module docstring)."""
    if M == 0:
        return
    cfg = config or rowwise_config(M, K)
    grid = (cdiv(M, cfg["BLOCK_M"]),)
    launch(_rowwise_kernel)[grid](
        x, q, scale, M, K, max(rows_per_group, 1), stride_g, stride_r, stride_k,
        POW2=bool(pow2), **cfg, **format_constexprs(fmt, x.device, hw_cast),
    )


def col_amax_fits(K: int) -> bool:
    """Whether ``launch_expert_rowwise_col_amax`` takes rows of ``K`` (whole rows in registers)."""
    return next_power_of_2(max(K, 16)) <= MAX_SINGLE_PASS_K


def col_amax_tile(K: int) -> int:
    """Elements per loop step of the column-amax kernels over rows of ``K``: ``WIDE_STEP_ELEMENTS``
    for rows of 1025 to 4096 elements, else ``TILE_ELEMENTS``."""
    return WIDE_STEP_ELEMENTS if 1024 < K <= 4096 else TILE_ELEMENTS


def col_amax_min_programs(block_m: int, K: int, itemsize: int) -> int:
    """Programs a column-amax launch keeps at least when its loop steps read ``block_m`` rows of
    ``K`` elements of ``itemsize`` bytes: ``MIN_COL_AMAX_PROGRAMS``, twice that below
    ``FULL_STEP_BYTES`` per step."""
    full = block_m * K * itemsize >= FULL_STEP_BYTES
    return MIN_COL_AMAX_PROGRAMS if full else 2 * MIN_COL_AMAX_PROGRAMS


def _col_amax_config(N: int, K: int, E: int, itemsize: int, rows_per_program: int | None, tile: int | None,
                     num_warps: int | None) -> tuple[dict, int]:
    """Block sizes of the column-amax kernels over ``E`` groups of ``N`` rows of ``K`` elements of
    ``itemsize`` bytes (``rowwise_config`` without its pass choice: whole rows only, else
    ``ValueError``; ``tile``: ``None`` for :func:`col_amax_tile`) and their rows per program
    (``None``: :func:`col_amax_rows_per_program` for :func:`col_amax_min_programs`): a multiple of
    the row block, at most ``N`` rounded up to it (no program loops over wholly masked row blocks)."""
    if not col_amax_fits(K):
        raise ValueError(f"K: rows of {K} elements do not fit in registers (at most {MAX_SINGLE_PASS_K})")
    cfg = rowwise_config(N, K, tile=tile or col_amax_tile(K), num_warps=num_warps)
    del cfg["SINGLE_PASS"]
    block_m = cfg["BLOCK_M"]
    rows_per_program = rows_per_program or col_amax_rows_per_program(
        N, E, col_amax_min_programs(block_m, K, itemsize))
    rows = max(rows_per_program, block_m) // block_m * block_m
    return cfg, min(rows, cdiv(max(N, 1), block_m) * block_m)


def col_amax_defaults(N: int, K: int, E: int = 1, itemsize: int = 2) -> tuple[int, int]:
    """Rows per program and elements per loop step the column-amax launchers pick for ``E`` groups
    of ``N`` rows of ``K`` elements of ``itemsize`` bytes."""
    return _col_amax_config(N, K, E, itemsize, None, None, None)[1], col_amax_tile(K)


def expert_strips(E: int, N: int, K: int, itemsize: int, rows_per_program: int | None, tile: int | None,
                  num_warps: int | None) -> tuple[dict, int]:
    """Block sizes and rows per program (``ROWS``) of a kernel over ``(E, N, K)`` expert weights of
    ``itemsize`` bytes per element whose programs ``(e, j)`` hold strips of whole rows of ``K`` and
    merge a column amax by atomics (``rows_per_program``, ``tile``: ``None`` for the defaults)."""
    return _col_amax_config(N, K, E, itemsize, rows_per_program, tile, num_warps)


def launch_expert_rowwise_col_amax(
    w: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    amax_bits: torch.Tensor,
    fmt: Float8Format,
    pow2: bool,
    *,
    rows_per_program: int | None = None,
    num_warps: int | None = None,
    stages: int = ROW_STAGES,
    tile: int | None = None,
    hw_cast: bool | None = None,
) -> None:
    """The forward expert layout plus the dgrad layout's amax, from one read of ``w``.

    ``w (E, N, K)`` any strides, ``K`` with :func:`col_amax_fits`; fills ``q (E, N, K)`` contiguous
    and ``scale (E, N)`` as ``launch_rowwise`` does (amax over K), and merges the amax over N of
    each expert column into ``amax_bits (E, K)`` int32 (fp32 bits; pass zeros). ``rows_per_program``
    (a multiple of the row block; ``None`` for :func:`col_amax_rows_per_program`) trades programs for
    atomics: ``E * K`` per ``rows_per_program`` rows.
    """
    E, N, K = w.shape
    cfg, rows = expert_strips(E, N, K, w.element_size(), rows_per_program, tile, num_warps)
    if E * N == 0:
        return
    launch(_expert_rowwise_col_amax_kernel)[(E, cdiv(N, rows))](
        w, q, scale, amax_bits, N, K, w.stride(0), w.stride(1), w.stride(2),
        POW2=bool(pow2), ROWS=rows, STAGES=stages, **cfg, **format_constexprs(fmt, w.device, hw_cast),
    )


def col_amax_rows_per_program(N: int, E: int = 1, min_programs: int = MIN_COL_AMAX_PROGRAMS) -> int:
    """Rows per program of the column-amax kernels over ``E`` groups of ``N`` rows (activations: one
    group of ``M`` rows): ``ROWS_PER_PROGRAM``, or the largest power of two below it that still makes
    ``min_programs`` programs (at least 1). Decided by comparisons only, so a traced ``N`` (a
    ``SymInt``) is guarded on a range of sizes."""
    rows = ROWS_PER_PROGRAM
    while rows > 1 and E * N < rows * min_programs:
        rows //= 2
    return rows


def launch_group_rowwise_amax(
    x: torch.Tensor,
    q: torch.Tensor | None,
    scale: torch.Tensor | None,
    amax_bits: torch.Tensor,
    offs: torch.Tensor,
    fmt: Float8Format,
    pow2: bool,
    *,
    rows_per_program: int | None = None,
    num_warps: int | None = None,
    stages: int = ROW_STAGES,
    tile: int | None = None,
    hw_cast: bool | None = None,
) -> None:
    """``launch_rowwise`` of ``x (M, K)`` (any strides, ``K`` with :func:`col_amax_fits`) into
    ``q (M, K)`` row-major and ``scale (M,)``, plus, from the same read, the column amax of every
    group of rows given by the int32 end offsets ``offs (G,)`` (on the device, never synced), merged
    into ``amax_bits (G, K)`` int32 (fp32 bits; pass zeros): what the wgrad's per-group column scales
    of ``x`` need (``colwise.launch_group_colwise(amax_bits=...)``). ``q = scale = None``: the amax
    alone (the rows are read, nothing else is written; rows past the groups are not read).
    ``rows_per_program``: ``None`` for :func:`col_amax_rows_per_program`; ``num_warps`` and ``tile``
    (elements per loop step; ``None`` for :func:`col_amax_tile`) as in :func:`rowwise_config`."""
    M, K = x.shape
    cfg, rows = _col_amax_config(M, K, 1, x.element_size(), rows_per_program, tile, num_warps)
    if M == 0:
        return
    G = offs.numel()
    write = q is not None
    launch(_group_rowwise_amax_kernel)[(cdiv(M, rows),)](
        x, q if write else x, scale if write else x, amax_bits, offs, M, K, G, x.stride(0),
        x.stride(1), POW2=bool(pow2), ROWS=rows, STAGES=stages, G_POW2=next_power_of_2(max(G, 1)),
        WRITE_ROWS=write, **cfg, **format_constexprs(fmt, x.device, hw_cast),
    )
