"""Column-wise FP8 quantization over row groups, written transposed: dgrad weights and wgrad operands.

One scale per (group, column): amax over the group's rows. A program owns a *strip*: one group's
rows times ``BLOCK_C`` columns. It reads the strip twice, once to reduce the amax and once to
scale, round and store; the second pass walks the strip backwards so that the rows read last in
pass 1 (the ones most likely still in L2) are read first. Narrow strips keep the L2 working set
(``programs in flight x group rows x BLOCK_C x 2 bytes``) small; a persistent launch (a fixed
number of programs looping over strips) bounds the programs in flight. When the strips of the
programs in flight do not fit in L2, the second pass reads HBM again (5 bytes moved per element
instead of 3 for bf16 in, fp8 out).

Measured on one H200 (2026-11, ``benchmarks/results/quant.md``): 42-52% of copy bandwidth for
groups of >= 1536 rows (experts, DeepSeek-V3 token groups) and 20-26% for groups of 512-1024 rows,
where each strip is one or two chunks and the program's chain of dependent loads (offsets, pass 1,
pass 2) leaves the memory system idle. The strips are latency-bound, not bandwidth-bound: a strip
of 16 columns reads 32 bytes per row, so few bytes are in flight per program.

Users:

* ``quantize_expert_colwise(transposed=True)``: groups are experts (``N`` rows each) of
  ``w (E, N, K)``; ``q (E, K, N)`` contiguous, ``scale (E, K)``;
* ``quantize_group_colwise[_dual]``: groups are jagged token ranges given by int32 end offsets
  (read on the device, never synced); ``q`` is column-major ``(rows, C)`` (or row-major), rows
  outside every group are 0. With padded offsets, group ``g``'s rows land at the padded group start
  and the pad rows are 0. Two tensors sharing the offsets (``grad_out`` and the activations) are
  quantized in one launch.

Output row ``o`` of a group, column ``c``, lives at ``out_base + o * stride_qr + c * stride_qc``;
rows are stored in chunks aligned to ``BLOCK_R`` output rows so that interior chunks take
unmasked, vectorized stores along the output's contiguous dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import Float8Format
from ..triton_helpers import fp8_scales
from .common import format_constexprs, multiprocessor_count, to_fp8

__all__ = ["colwise_strip", "colwise_config", "expert_t_config", "launch_expert_colwise_t", "launch_group_colwise"]


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
def colwise_strip(
    x_ptr,
    q_ptr,
    s_ptr,
    cb,
    C,
    in_base,
    in_start,
    in_end,
    stride_r,
    stride_c,
    out_base,
    o_start,
    o_zero_end,
    o_limit,
    stride_qr,
    stride_qc,
    scale_base,
    is_group,
    POW2: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):
    """Quantize input rows ``[in_start, in_end)`` x columns ``cb * BLOCK_C + [0, BLOCK_C)``.

    They are stored at output rows ``[o_start, o_start + in_end - in_start)``; output rows from
    there up to ``o_zero_end`` get zeros; nothing is stored at or past ``o_limit``. When
    ``is_group``, the column scales go to ``s_ptr + scale_base + column``; otherwise the rows
    belong to no group and are multiplied by 0 (``x * 0``: ``-0`` for negative ``x``, as the
    reference writes them).
    """
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    x_cols = x_ptr + in_base + cols.to(tl.int64)[None, :] * stride_c
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    reduce_end = tl.where(is_group, in_end, in_start)
    for r0 in range(in_start, reduce_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        x = tl.load(x_cols + rows.to(tl.int64)[:, None] * stride_r,
                    mask=(rows < in_end)[:, None] & col_ok[None, :], other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    inv_scale, scale = fp8_scales(tl.max(acc, axis=0), FP8_MAX, POW2)
    inv_scale = tl.where(is_group, inv_scale, 0.0)
    if is_group:
        tl.store(s_ptr + scale_base + cols, scale, mask=col_ok)

    # Pass 2, backwards (the freshest rows in L2 first): the partial chunk at the end, the full
    # chunks, the partial chunk at the start. Full chunks get no row mask, so their stores along
    # the output's contiguous dim stay vectorized (a shared masked store would not be).
    q_cols = q_ptr + out_base + cols.to(tl.int64)[None, :] * stride_qc
    o_end = tl.minimum(o_start + (in_end - in_start), o_limit)
    full_lo = tl.cdiv(o_start, BLOCK_R) * BLOCK_R
    full_hi = tl.maximum((o_end // BLOCK_R) * BLOCK_R, full_lo)
    if full_hi < o_end:
        _store_rows(x_cols, q_cols, full_hi, o_start, o_end, in_start, stride_r, stride_qr, inv_scale, col_ok,
                    True, BLOCK_R, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE,
                    FP8_NEG_ZERO)
    for j in range(0, (full_hi - full_lo) // BLOCK_R):
        o0 = tl.multiple_of(full_hi - (j + 1) * BLOCK_R, BLOCK_R)
        _store_rows(x_cols, q_cols, o0, o_start, o_end, in_start, stride_r, stride_qr, inv_scale, col_ok,
                    False, BLOCK_R, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE,
                    FP8_NEG_ZERO)
    if (o_start < full_lo) & (o_start < o_end):
        _store_rows(x_cols, q_cols, full_lo - BLOCK_R, o_start, o_end, in_start, stride_r, stride_qr, inv_scale,
                    col_ok, True, BLOCK_R, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE,
                    FP8_NEG_ZERO)

    zero = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32).to(OUT_DTYPE)
    z_end = tl.minimum(o_zero_end, o_limit)
    for o0 in range((o_end // BLOCK_R) * BLOCK_R, z_end, BLOCK_R):
        o = o0 + tl.arange(0, BLOCK_R)
        ok = (o >= o_end) & (o < z_end)
        tl.store(q_cols + o.to(tl.int64)[:, None] * stride_qr, zero, mask=ok[:, None] & col_ok[None, :])


@triton.jit
def expert_colwise_t_item(
    w_ptr,
    q_ptr,
    s_ptr,
    item,
    N,
    K,
    NB,
    stride_we,
    stride_wn,
    stride_wk,
    POW2: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):
    """Strip ``item`` = (expert, column block) of ``w (E, N, K)`` into ``q (E, K, N)``, ``scale (E, K)``."""
    e = (item // NB).to(tl.int64)
    colwise_strip(w_ptr, q_ptr, s_ptr, item % NB, K, e * stride_we, 0, N, stride_wn, stride_wk,
                  e * K * N, 0, N, N, 1, N, e * K, True,
                  POW2, BLOCK_R, BLOCK_C, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)


@triton.jit
def _expert_colwise_t_kernel(
    w_ptr,
    q_ptr,
    s_ptr,
    N,
    K,
    NB,
    n_items,
    stride_we,
    stride_wn,
    stride_wk,
    POW2: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        expert_colwise_t_item(w_ptr, q_ptr, s_ptr, item, N, K, NB, stride_we, stride_wn, stride_wk,
                              POW2, BLOCK_R, BLOCK_C, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL,
                              FP8_SUB_SCALE, FP8_NEG_ZERO)


@triton.jit
def _group_colwise_kernel(
    a_ptr,
    qa_ptr,
    sa_ptr,
    C_A,
    stride_ar,
    stride_ac,
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
    G,
    rows_in,
    rows_out,
    NB_A,
    NB_B,
    n_items,
    POW2: tl.constexpr,
    HAS_B: tl.constexpr,
    PADDED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):
    """Items ``(g, column block)`` for ``g`` in ``[0, G]``; ``g == G`` zero-fills the rows after the last group."""
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        g = item // (NB_A + NB_B)
        cb = item % (NB_A + NB_B)
        real = g < G
        last = tl.maximum(tl.minimum(g, G - 1), 0)
        # Offsets are clamped so that bad offsets can never address memory outside the tensors.
        prev = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
        cur = tl.load(offs_ptr + last, mask=G > 0, other=0)
        start = tl.minimum(tl.maximum(prev, 0), rows_in)
        if PADDED:  # the tail item only zero-fills the padded rows after the last group
            end = tl.where(real, tl.minimum(tl.maximum(cur, start), rows_in), start)
            p_prev = tl.load(poffs_ptr + g - 1, mask=g > 0, other=0)
            p_cur = tl.load(poffs_ptr + last, mask=G > 0, other=0)
            o_start = tl.minimum(tl.maximum(p_prev, 0), rows_out)
            o_zero_end = tl.where(real, tl.minimum(tl.maximum(p_cur, o_start), rows_out), rows_out)
        else:  # the tail item writes rows [offs[-1], M) times 0, like the reference
            end = tl.where(real, tl.minimum(tl.maximum(cur, start), rows_in), rows_in)
            o_start = start
            o_zero_end = end
        if HAS_B:
            if cb < NB_A:
                colwise_strip(a_ptr, qa_ptr, sa_ptr, cb, C_A, 0, start, end, stride_ar, stride_ac,
                              0, o_start, o_zero_end, rows_out, stride_qar, stride_qac, g.to(tl.int64) * C_A, real,
                              POW2, BLOCK_R, BLOCK_C, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL,
                              FP8_SUB_SCALE, FP8_NEG_ZERO)
            else:
                colwise_strip(b_ptr, qb_ptr, sb_ptr, cb - NB_A, C_B, 0, start, end, stride_br, stride_bc,
                              0, o_start, o_zero_end, rows_out, stride_qbr, stride_qbc, g.to(tl.int64) * C_B, real,
                              POW2, BLOCK_R, BLOCK_C, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL,
                              FP8_SUB_SCALE, FP8_NEG_ZERO)
        else:
            colwise_strip(a_ptr, qa_ptr, sa_ptr, cb, C_A, 0, start, end, stride_ar, stride_ac,
                          0, o_start, o_zero_end, rows_out, stride_qar, stride_qac, g.to(tl.int64) * C_A, real,
                          POW2, BLOCK_R, BLOCK_C, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL,
                          FP8_SUB_SCALE, FP8_NEG_ZERO)


def colwise_config(group_rows: int, *, block_r: int | None = None, block_c: int | None = None,
                   num_warps: int | None = None, programs_per_sm: int | None = None) -> dict:
    """Strip shape and launch width from static sizes (``group_rows`` = rows / groups, never data).

    ``programs_per_sm = 0`` launches one program per strip instead of a persistent grid. Defaults
    (one H200, 2026-11, DeepSeek-V3 shapes): 256 x 32 strips, 8 warps, 2 programs per SM for groups
    of >= 2048 rows (best of six configurations on the wgrad operands); 256 x 16, 4 warps, one
    program per strip for smaller groups, where a strip is a single chunk and only many programs in
    flight hide the latency.
    """
    big = group_rows >= 2048
    block_r = block_r or 256
    block_r = min(block_r, max(16, triton.next_power_of_2(max(group_rows, 1))))
    return dict(BLOCK_R=block_r, BLOCK_C=block_c or (32 if big else 16), num_warps=num_warps or (8 if big else 4),
                programs_per_sm=(2 if big else 0) if programs_per_sm is None else programs_per_sm)


def expert_t_config(rows: int) -> dict:
    """Strips of the dgrad weight layout (``rows = N``): 256 x 16, 4 warps, 4 programs per SM.

    Best of six configurations on DeepSeek-V3 and Llama 4 weights (one H200, 2026-11).
    """
    return colwise_config(rows, block_r=256, block_c=16, num_warps=4, programs_per_sm=4)


def _grid(n_items: int, device: torch.device, programs_per_sm: int) -> tuple[int]:
    if programs_per_sm <= 0:
        return (n_items,)
    return (min(n_items, multiprocessor_count(device) * programs_per_sm),)


def launch_expert_colwise_t(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, fmt: Float8Format, pow2: bool,
                            config: dict | None = None, hw_cast: bool | None = None) -> None:
    """``w (E, N, K)`` -> ``q (E, K, N)`` contiguous, ``scale (E, K)`` (amax over N)."""
    E, N, K = w.shape
    cfg = dict(config or expert_t_config(N))
    nb = triton.cdiv(K, cfg["BLOCK_C"])
    n_items = E * nb
    if n_items == 0:
        return
    grid = _grid(n_items, w.device, cfg.pop("programs_per_sm"))
    _expert_colwise_t_kernel[grid](w, q, scale, N, K, nb, n_items, w.stride(0), w.stride(1), w.stride(2),
                                   POW2=bool(pow2), **cfg, **format_constexprs(fmt, w.device, hw_cast))


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
    """
    G = offs.numel()
    rows_in, rows_out = a.shape[0], qa.shape[0]
    cfg = dict(config or colwise_config(rows_in // max(G, 1)))
    nb_a = triton.cdiv(a.shape[1], cfg["BLOCK_C"])
    nb_b = triton.cdiv(b.shape[1], cfg["BLOCK_C"]) if b is not None else 0
    n_items = (G + 1) * (nb_a + nb_b)
    if n_items == 0:
        return
    grid = _grid(n_items, a.device, cfg.pop("programs_per_sm"))
    has_b = b is not None
    b_args = (b, qb, sb, b.shape[1], b.stride(0), b.stride(1), qb.stride(0), qb.stride(1)) if has_b else (
        a, qa, sa, 0, 0, 0, 0, 0)
    _group_colwise_kernel[grid](
        a, qa, sa, a.shape[1], a.stride(0), a.stride(1), qa.stride(0), qa.stride(1),
        *b_args,
        offs, padded_offs if padded_offs is not None else offs, G, rows_in, rows_out, nb_a, nb_b, n_items,
        POW2=bool(pow2), HAS_B=has_b, PADDED=padded_offs is not None, **cfg, **format_constexprs(fmt, a.device, hw_cast),
    )
