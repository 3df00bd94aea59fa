"""FP8 grouped GEMM in Triton: the portable ``triton`` backend (GPU, and the CPU interpreter).

Same semantics as the CPU references in :mod:`.emulated` (read its module table for the scale
shapes):

* :func:`triton_grouped_mm_2d3d` (forward / dgrad): ``out[rows of g] = a[rows of g] @ b[g].T``;
* :func:`triton_grouped_mm_dgrad_quantize_w` (dgrad of a high-precision weight, quantized in the
  GEMM): ``out[rows of g] = a[rows of g] @ w[g]``, the same grid computed transposed;
* :func:`triton_grouped_mm_2d2d` (wgrad): ``out[g] = a[rows of g].T @ b[rows of g]``.

How the work is laid out, with no host sync (nothing is read from ``offs`` on the host):

* 2D x 3D: the grid is a static upper bound of row tiles, ``cdiv(M, BM) + E``, times the column
  tiles. Each program rebuilds the per-group row-tile counts from ``offs`` in registers (one
  vector of ``E + 1`` entries and a cumulative sum) and finds its group and row tile. Group ``E``
  is the tail ``[offs[-1], M)``: its tiles write zeros, so every output row is defined. Programs
  past the last tile return at once. Row tiles are visited ``group_m`` at a time per column sweep,
  so consecutive programs reuse one expert's weight tiles from L2.
* 2D x 2D: one program per ``(group, output tile)``; it loops over its group's rows (any count:
  no 16-row padding is needed) and an empty group stores zeros. The same kernel takes bf16 / fp16
  operands without scales (a BF16 weight gradient), and can add its products to an existing
  ``(E, N, K)`` tensor in place (``accumulate_into``: gradient accumulation without a separate add;
  empty groups then touch nothing). The rows are split into a
  16-aligned body, loaded as 16-byte vectors when the rows are the contiguous dim (column-major
  operands, ``M % 16 == 0``) in ``BK``-row blocks aligned to multiples of ``BK`` (the first one
  masked), and up to 15 head and 15 tail rows handled in one masked slice, skipped when the group
  has none.
* fp32 accumulation with ``tl.dot`` on the FP8 operands; scales are applied in the epilogue as
  ``scale_b[col] * (scale_a[row] * acc)`` like the CUDA kernel (blockwise: per 128-deep slice in
  the main loop); pointer offsets are int64.
* bf16 output is rounded to nearest-even in fp32 before the cast, because the interpreter's
  fp32 -> bf16 cast truncates; on the GPU the cast of the pre-rounded value is exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_multiple_of, check_offsets, check_same_device, check_tensor
from ..kernel_backend import interpreter_enabled, launch_target
from ..launch import launch
from ..launch_math import cdiv, next_power_of_2
from ..quant.formats import Float8Format, resolve_format
from ..quant.triton_helpers import fp8_constexprs, fp8_round, fp8_scales
from .emulated import FP8_DTYPES
from .triton_configs import (
    BLOCKWISE_BLOCK,
    SCALE_BLOCKWISE,
    SCALE_ROWWISE,
    SCALE_NONE,
    SCALE_TENSORWISE,
    GemmConfig,
    config_2d2d,
    config_2d3d,
    config_dgrad_quantize_w,
)

__all__ = ["triton_grouped_mm_2d3d", "triton_grouped_mm_dgrad_quantize_w", "triton_grouped_mm_2d2d"]

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_UNSCALED_DTYPES = (torch.bfloat16, torch.float16)  # 2D x 2D without scales
_HIGH_PRECISION = (torch.bfloat16, torch.float16, torch.float32)  # b quantized inside the 2D x 3D GEMM


@triton.jit
def _round_to_bf16(x):
    """Round fp32 ``x`` to the nearest bf16 value (ties to even), returned in fp32."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _store_tile(out_ptr, rows, cols, row_mask, col_mask, stride_om, stride_on, val, OUT_BF16: tl.constexpr):
    if OUT_BF16:
        val = _round_to_bf16(val)
    ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols.to(tl.int64)[None, :] * stride_on
    tl.store(ptrs, val.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _row_tile_2d3d(ends, starts, M, N, E, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
                   BLOCK_E: tl.constexpr):
    """This program's output tile of the 2D x 3D grid: ``(g, rows, cols, row_end)``; ``g > E``: no
    tile (past the last one), ``g == E``: the tail rows past ``offs[-1]``. ``ends`` / ``starts``:
    ``offs[e]`` and ``offs[e - 1]`` over ``e < BLOCK_E`` as the kernels load them (a pointer handed to
    a helper counts as written in torch.compile's analysis of a kernel, which would then copy the
    offsets for every launch)."""
    # Swizzled (row tile, column tile) from the flat program id over the static tile bound.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM) + E
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows

    # Per-group row ranges (group E = tail rows past offs[-1]), clamped into [0, M] so that bad
    # offsets can never address memory outside the tensors.
    e = tl.arange(0, BLOCK_E)
    starts = tl.where(e > E, M, starts)
    ends = tl.minimum(tl.maximum(ends, 0), M)
    starts = tl.minimum(tl.maximum(starts, 0), M)
    tiles = tl.cdiv(tl.maximum(ends - starts, 0), BM)
    tile_end = tl.cumsum(tiles, 0)
    g = tl.sum((tile_end <= tile_m).to(tl.int32), 0)
    is_g = e == g
    row_start = tl.sum(tl.where(is_g, starts, 0), 0)
    row_end = tl.sum(tl.where(is_g, ends, 0), 0)
    first_tile = tl.sum(tl.where(is_g, tile_end - tiles, 0), 0)
    rows = row_start + (tile_m - first_tile) * BM + tl.arange(0, BM)
    cols = tile_n * BN + tl.arange(0, BN)
    return g, rows, cols, row_end


@triton.jit
def _grouped_mm_2d3d_kernel(
    a_ptr, b_ptr, out_ptr, sa_ptr, sb_ptr, offs_ptr,
    M, N, K, E,
    stride_am, stride_ak,
    stride_be, stride_bn, stride_bk,
    stride_om, stride_on,
    stride_sam, stride_sak,
    stride_sbe, stride_sbn, stride_sbk,
    SCALE_MODE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_E: tl.constexpr, EVEN_K: tl.constexpr, MAX_IMPRECISE: tl.constexpr, OUT_BF16: tl.constexpr,
):  # fmt: skip
    e = tl.arange(0, BLOCK_E)  # group E: the tail rows past offs[-1]
    ends = tl.load(offs_ptr + e, mask=e < E, other=M)
    starts = tl.load(offs_ptr + e - 1, mask=(e >= 1) & (e <= E), other=0)
    g, rows, cols, row_end = _row_tile_2d3d(ends, starts, M, N, E, BM, BN, GROUP_M, BLOCK_E)
    if g > E:
        return
    row_mask = rows < row_end
    col_mask = cols < N
    if g == E:  # tail rows: zeros
        _store_tile(out_ptr, rows, cols, row_mask, col_mask, stride_om, stride_on,
                    tl.zeros((BM, BN), dtype=tl.float32), OUT_BF16)  # fmt: skip
        return

    # Clamped indices keep every load in bounds without masks (rows past the group are computed
    # and then not stored).
    rows_ld = tl.minimum(rows, M - 1).to(tl.int64)
    cols_ld = tl.minimum(cols, N - 1).to(tl.int64)
    ks = tl.arange(0, BK)
    a_ptrs = a_ptr + rows_ld[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + g.to(tl.int64) * stride_be + ks[:, None] * stride_bk + cols_ld[None, :] * stride_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - kt * BK
            a = tl.load(a_ptrs, mask=ks[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=ks[:, None] < k_left, other=0.0)
        if SCALE_MODE == 2:  # blockwise: BK == 128, one scale slice per iteration
            sa = tl.load(sa_ptr + rows_ld * stride_sam + kt * stride_sak)
            sb = tl.load(sb_ptr + g.to(tl.int64) * stride_sbe + (cols_ld // BK) * stride_sbn + kt * stride_sbk)
            part = tl.dot(a, b, max_num_imprecise_acc=MAX_IMPRECISE)
            acc += sb[None, :] * (sa[:, None] * part)
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=MAX_IMPRECISE)
        a_ptrs += BK * stride_ak
        b_ptrs += BK * stride_bk

    if SCALE_MODE == 1:
        sa = tl.load(sa_ptr + rows_ld * stride_sam)
        sb = tl.load(sb_ptr + g.to(tl.int64) * stride_sbe + cols_ld * stride_sbn)
        acc = sb[None, :] * (sa[:, None] * acc)
    elif SCALE_MODE == 0:
        sa = tl.load(sa_ptr)
        sb = tl.load(sb_ptr + g.to(tl.int64) * stride_sbe)
        acc = sb * (sa * acc)
    _store_tile(out_ptr, rows, cols, row_mask, col_mask, stride_om, stride_on, acc, OUT_BF16)


@triton.jit
def _grouped_mm_dgrad_quantize_w_kernel(
    a_ptr, b_ptr, out_ptr, sa_ptr, amax_ptr, offs_ptr,
    M, N, K, E,
    stride_am, stride_ak,
    stride_be, stride_bn, stride_bk,
    stride_om, stride_on,
    stride_sam, stride_ae, stride_an,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_E: tl.constexpr, EVEN_K: tl.constexpr, MAX_IMPRECISE: tl.constexpr, OUT_BF16: tl.constexpr,
    POW2: tl.constexpr, EXACT_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):  # fmt: skip
    # The 2D x 3D kernel's dgrad (out (M, N) = a (M, K) @ b[g].T with b[g] = w[g].T, K the
    # weight's rows) with b high precision, quantized per tile in registers with the scales of its
    # column amax. Computed transposed, out^T tile (BN, BM) = b_q tile (BN, BK) @ a^T tile (BK, BM):
    # the quantized tile is the MMA's A operand, which may come from registers, so it is never
    # stored to shared memory in the reduction-major layout an FP8 B operand needs (byte stores:
    # the weight's contiguous dim is the output's). EXACT_CAST: the hardware cast rounds like torch
    # and saturates to +-448 like the quantizers' clamp (NVIDIA e4m3fn: cvt.rn.satfinite), so the
    # scaled tile is cast as it is; else it is clamped and rounded onto the FP8 grid in fp32 first.
    e = tl.arange(0, BLOCK_E)  # group E: the tail rows past offs[-1]
    ends = tl.load(offs_ptr + e, mask=e < E, other=M)
    starts = tl.load(offs_ptr + e - 1, mask=(e >= 1) & (e <= E), other=0)
    g, rows, cols, row_end = _row_tile_2d3d(ends, starts, M, N, E, BM, BN, GROUP_M, BLOCK_E)
    if g > E:
        return
    row_mask = rows < row_end
    col_mask = cols < N
    if g == E:  # tail rows: zeros
        _store_tile(out_ptr, rows, cols, row_mask, col_mask, stride_om, stride_on,
                    tl.zeros((BM, BN), dtype=tl.float32), OUT_BF16)  # fmt: skip
        return

    rows_ld = tl.minimum(rows, M - 1).to(tl.int64)
    # Wrapped (N % 16 == 0), not clamped: with b's columns contiguous its loads stay vectors.
    cols_ld = tl.max_contiguous(tl.multiple_of((cols % N).to(tl.int64), 16), 16)
    inv_b, scale_b = fp8_scales(tl.load(amax_ptr + g.to(tl.int64) * stride_ae + cols_ld * stride_an), FP8_MAX, POW2)
    ks = tl.arange(0, BK)
    a_ptrs = a_ptr + ks[:, None] * stride_ak + rows_ld[None, :] * stride_am
    b_ptrs = b_ptr + g.to(tl.int64) * stride_be + cols_ld[:, None] * stride_bn + ks[None, :] * stride_bk
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - kt * BK
            a = tl.load(a_ptrs, mask=ks[:, None] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=ks[None, :] < k_left, other=0.0)
        b = b.to(tl.float32) * inv_b[:, None]
        if not EXACT_CAST:
            b = fp8_round(b, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)
        acc = tl.dot(b.to(a_ptr.dtype.element_ty), a, acc, max_num_imprecise_acc=MAX_IMPRECISE)
        a_ptrs += BK * stride_ak
        b_ptrs += BK * stride_bk
    sa = tl.load(sa_ptr + rows_ld * stride_sam)
    acc = scale_b[:, None] * (sa[None, :] * acc)
    _store_tile(out_ptr, rows, cols, row_mask, col_mask, stride_om, stride_on, tl.trans(acc), OUT_BF16)


@triton.jit
def _dot_rows(a_ptr, b_ptr, rows, r_mask, ns, ks, stride_ar, stride_an, stride_br, stride_bk, acc,
              MAX_IMPRECISE: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """``acc + a[rows, ns].T @ b[rows, ks]`` with masked-out rows read as zeros. ``UPCAST``: the
    operands go to ``tl.dot`` as fp32 (the interpreter's bf16 ``tl.dot`` is wrong; the products of
    bf16 / fp16 values are exact in fp32 either way)."""
    rows64 = rows.to(tl.int64)
    a = tl.load(a_ptr + ns[:, None] * stride_an + rows64[None, :] * stride_ar, mask=r_mask[None, :], other=0.0)
    b = tl.load(b_ptr + rows64[:, None] * stride_br + ks[None, :] * stride_bk, mask=r_mask[:, None], other=0.0)
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, max_num_imprecise_acc=MAX_IMPRECISE)


@triton.jit
def _grouped_mm_2d2d_kernel(
    a_ptr, b_ptr, out_ptr, sa_ptr, sb_ptr, offs_ptr,
    M, N, K,
    stride_ar, stride_an,
    stride_br, stride_bk,
    stride_oe, stride_on, stride_ok,
    stride_sae, stride_san,
    stride_sbe, stride_sbk,
    SCALE_MODE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    MAX_IMPRECISE: tl.constexpr, EDGE_MAX_IMPRECISE: tl.constexpr, OUT_BF16: tl.constexpr,
    ACCUMULATE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    # Output tile (BM rows of N) x (BN cols of K) of group g; BK is the reduction over rows.
    # ACCUMULATE: out += the product (one rounding); an empty group's tile is left as it is.
    pid = tl.program_id(0)
    num_m = tl.cdiv(N, BM)
    num_n = tl.cdiv(K, BN)
    g = pid // (num_m * num_n)
    t = pid % (num_m * num_n)
    per_group = GROUP_M * num_n
    first_m = (t // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    tile_m = first_m + (t % per_group) % group_rows
    tile_n = (t % per_group) // group_rows

    end = tl.load(offs_ptr + g)
    start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    # Clamped into [0, M] so that bad offsets can never address memory outside the tensors.
    end = tl.minimum(tl.maximum(end, 0), M)
    start = tl.minimum(tl.maximum(start, 0), end)
    if ACCUMULATE:
        if start == end:
            return

    ns = tile_m * BM + tl.arange(0, BM)
    ks = tile_n * BN + tl.arange(0, BN)
    n_mask = ns < N
    k_mask = ks < K
    # Wrapped into range (N and K are multiples of 16) rather than clamped: each 16 aligned columns
    # stay contiguous, so loads along a contiguous N or K dim (bf16 operands, row-major) are
    # vectors; a clamp hides that and turns them into scalar loads.
    ns_ld = tl.max_contiguous(tl.multiple_of((ns % N).to(tl.int64), 16), 16)
    ks_ld = tl.max_contiguous(tl.multiple_of((ks % K).to(tl.int64), 16), 16)
    # Rows split into a 16-aligned body [body_start, body_end), whose loads are 16-byte vectors
    # when the rows are the contiguous dim, and at most 15 head rows [start, head_end) and 15 tail
    # rows [tail_start, end) outside it, gathered into one masked 32-row slice after the loop and
    # computed only when the group has such rows (run for every tile, all-masked on aligned
    # groups, it cost ~20% of the kernel on an H200: BENCHMARKS.md).
    body_start = (start + 15) // 16 * 16
    body_end = end // 16 * 16
    head_end = tl.minimum(body_start, end)
    tail_start = tl.maximum(body_end, head_end)
    # The body's blocks start at multiples of BK (the first one masked below body_start), so that
    # with column-major operands each block row is whole aligned cache lines: blocks that start at
    # the group's 16-aligned first row straddle two lines per row and ran 1.2-1.4x slower (H200).
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    r = tl.arange(0, BK)
    for r0 in range(body_start // BK * BK, body_end, BK):
        rows = r0 + r
        acc = _dot_rows(a_ptr, b_ptr, rows, (rows >= body_start) & (rows < body_end), ns_ld, ks_ld,
                        stride_ar, stride_an, stride_br, stride_bk, acc, MAX_IMPRECISE, UPCAST)  # fmt: skip
    if (start < body_start) | (body_end < end):
        i = tl.arange(0, 32)
        rows = tl.where(i < 16, start // 16 * 16 + i, body_end + i - 16)
        r_mask = tl.where(i < 16, (rows >= start) & (rows < head_end), (rows >= tail_start) & (rows < end))
        acc = _dot_rows(a_ptr, b_ptr, rows, r_mask, ns_ld, ks_ld, stride_ar, stride_an, stride_br, stride_bk,
                        acc, EDGE_MAX_IMPRECISE, UPCAST)  # fmt: skip

    if SCALE_MODE == 1:
        sa = tl.load(sa_ptr + g.to(tl.int64) * stride_sae + ns_ld * stride_san)
        sb = tl.load(sb_ptr + g.to(tl.int64) * stride_sbe + ks_ld * stride_sbk)
        acc = sb[None, :] * (sa[:, None] * acc)
    elif SCALE_MODE == 0:
        acc = tl.load(sb_ptr) * (tl.load(sa_ptr) * acc)
    out_g = out_ptr + g.to(tl.int64) * stride_oe
    if ACCUMULATE:
        old = tl.load(out_g + ns_ld[:, None] * stride_on + ks_ld[None, :] * stride_ok)
        acc += old.to(tl.float32)
    _store_tile(out_g, ns, ks, n_mask, k_mask, stride_on, stride_ok, acc, OUT_BF16)


def _check_dtypes(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, scaled: bool = True) -> None:
    check_tensor("a", a, dtypes=FP8_DTYPES if scaled else _UNSCALED_DTYPES, ndim=2)
    check_tensor("b", b, dtypes=FP8_DTYPES if scaled else _UNSCALED_DTYPES)
    if b.dtype != a.dtype:
        raise TypeError(f"b: expected the dtype of a ({a.dtype}), got {b.dtype}")
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype: expected one of {_OUT_DTYPES}, got {out_dtype}")


def _check_can_launch(a: torch.Tensor) -> None:
    """The device of ``a`` can run the kernel (checked after the arguments themselves)."""
    if a.device.type == "cpu" and not interpreter_enabled():
        raise ValueError("a: CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)")
    nvidia = a.device.type == "cuda" and torch.version.hip is None
    if a.dtype in FP8_DTYPES and nvidia and torch.cuda.get_device_capability(a.device) < (8, 9):
        raise ValueError(f"a: FP8 tl.dot needs compute capability >= 8.9, {a.device} has "
                         f"{torch.cuda.get_device_capability(a.device)}")  # fmt: skip


def _max_imprecise(cfg: GemmConfig, device: torch.device):
    """``max_num_imprecise_acc`` for ``tl.dot``: Triton's default (fast) or one promotion per tile."""
    return None if cfg.fast_accum or launch_target(device).kind != "cuda" else cfg.block_k


def triton_grouped_mm_2d3d(
    a: torch.Tensor,
    scale_a: torch.Tensor,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Grouped ``a[rows of g] @ b[g].T`` (forward / dgrad form), FP8 in, fp32 accumulation.

    Args:
        a: ``(M, K)`` fp8 (any strides; row-major is the fast layout), group ``g`` owns rows
            ``[offs[g-1], offs[g])``.
        scale_a: fp32 dequantization scales: ``(M,)`` rowwise, ``()`` tensorwise, or
            ``(M, ceil(K/128))`` blockwise (1x128).
        b: ``(E, N, K)`` fp8, same dtype as ``a``, K contiguous is the fast layout (expert weights
            in ``nn.Linear`` layout; for dgrad the transposed-quantized ``(E, K_in, N_out)``).
        scale_b: fp32 ``(E, N)`` rowwise, ``(E,)`` tensorwise, or ``(E, ceil(N/128), ceil(K/128))``
            blockwise (128x128).
        offs: ``(E,)`` int32 cumulative end offsets (non-decreasing, ``offs[-1] <= M``; empty
            groups allowed). Not read on the host.
        out_dtype: bf16 (default), fp16 or fp32.
        config: tile configuration override (default: :func:`.triton_configs.config_2d3d`).
    Returns:
        ``(M, N)`` contiguous ``out_dtype``; rows at or past ``offs[-1]`` are zero.
    """
    _check_dtypes(a, b, out_dtype)
    check_tensor("b", b, ndim=3, shape=(None, None, a.shape[1]))
    E, N, K = b.shape
    M = a.shape[0]
    check_multiple_of("K (a.shape[1])", K, 16)
    check_multiple_of("N (b.shape[1])", N, 16)
    if E < 1:
        raise ValueError("b: expected at least one group (b.shape[0] >= 1)")
    check_offsets(offs, num_groups=E)
    check_tensor("scale_a", scale_a, dtypes=(torch.float32,), ndim=(0, 1, 2))
    if scale_a.dim() == 0:
        mode = SCALE_TENSORWISE
        check_tensor("scale_b", scale_b, dtypes=(torch.float32,), shape=(E,))
    elif scale_a.dim() == 1:
        mode = SCALE_ROWWISE
        check_tensor("scale_a", scale_a, shape=(M,))
        check_tensor("scale_b", scale_b, dtypes=(torch.float32,), shape=(E, N))
    else:
        mode = SCALE_BLOCKWISE
        kb = cdiv(K, BLOCKWISE_BLOCK)
        check_tensor("scale_a", scale_a, shape=(M, kb))
        check_tensor("scale_b", scale_b, dtypes=(torch.float32,), shape=(E, cdiv(N, BLOCKWISE_BLOCK), kb))
    check_same_device(a=a, b=b, scale_a=scale_a, scale_b=scale_b, offs=offs)
    _check_can_launch(a)

    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0:
        return out
    cfg = config or config_2d3d(N, K, E, mode, a.device)
    if mode == SCALE_BLOCKWISE and cfg.block_k != BLOCKWISE_BLOCK:
        raise ValueError(f"config: blockwise scales need block_k == {BLOCKWISE_BLOCK}, got {cfg.block_k}")
    # Rowwise / tensorwise scales are read through strides; give them a unit second stride slot.
    sa_strides = (scale_a.stride(0), scale_a.stride(1)) if mode == SCALE_BLOCKWISE else (
        (scale_a.stride(0), 0) if mode == SCALE_ROWWISE else (0, 0))  # fmt: skip
    sb_strides = tuple(scale_b.stride()) + (0,) * (3 - scale_b.dim())
    grid = ((cdiv(M, cfg.block_m) + E) * cdiv(N, cfg.block_n),)
    launch(_grouped_mm_2d3d_kernel)[grid](
        a, b, out, scale_a, scale_b, offs,
        M, N, K, E,
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1),
        *sa_strides,
        *sb_strides,
        SCALE_MODE=mode,
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
        BLOCK_E=next_power_of_2(E + 1), EVEN_K=K % cfg.block_k == 0,
        MAX_IMPRECISE=_max_imprecise(cfg, a.device), OUT_BF16=out_dtype == torch.bfloat16,
        num_stages=cfg.num_stages, num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


def triton_grouped_mm_dgrad_quantize_w(
    a: torch.Tensor,
    scale_a: torch.Tensor,
    w: torch.Tensor,
    w_amax: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    fmt: Float8Format | str | None = None,
    pow2: bool = False,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """The rowwise dgrad ``out[rows of g] = a[rows of g] @ w[g]`` from the high-precision weight,
    quantized inside the GEMM: each tile of ``w`` is scaled, rounded and cast to FP8 in registers
    before the FP8 dot, with the per-column scales of ``w_amax`` (those
    ``quant.reference.amax_to_scales`` gives), which the epilogue applies. The FP8 operands equal
    the dgrad layout's (``quantize_expert_colwise(w, transposed=True, amax=w_amax)``) given to
    :func:`triton_grouped_mm_2d3d`; that layout is never written.

    Args:
        a: ``(M, N)`` fp8 rowwise (N contiguous), ``scale_a (M,)`` fp32; ``offs`` as in
            :func:`triton_grouped_mm_2d3d`.
        w: ``(E, N, K)`` bf16 / fp16 / fp32, any strides (``nn.Linear`` layout per expert: K contiguous).
        w_amax: ``(E, K)`` fp32, the amax of each ``w[g, :, k]`` (a larger value gives coarser scales).
        fmt: the FP8 format, ``a``'s (default: ``a``'s dtype's); pow2: power-of-two scales.
        config: tile configuration override (default: :func:`.triton_configs.config_dgrad_quantize_w`).
    Returns:
        ``(M, K)`` contiguous ``out_dtype``; rows at or past ``offs[-1]`` are zero.
    """
    check_tensor("a", a, dtypes=FP8_DTYPES, ndim=2)
    fp8 = resolve_format(a.dtype if fmt is None else fmt)
    if fp8.torch_dtype != a.dtype:
        raise TypeError(f"a: expected {fp8.torch_dtype} (fmt {fp8.name}), got {a.dtype}")
    check_tensor("w", w, dtypes=_HIGH_PRECISION, ndim=3, shape=(None, a.shape[1], None))
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype: expected one of {_OUT_DTYPES}, got {out_dtype}")
    E, N, K = w.shape
    M = a.shape[0]
    check_multiple_of("N (a.shape[1])", N, 16)
    check_multiple_of("K (w.shape[2])", K, 16)
    if E < 1:
        raise ValueError("w: expected at least one group (w.shape[0] >= 1)")
    check_offsets(offs, num_groups=E)
    check_tensor("scale_a", scale_a, dtypes=(torch.float32,), shape=(M,))
    check_tensor("w_amax", w_amax, dtypes=(torch.float32,), shape=(E, K))
    check_same_device(a=a, w=w, scale_a=scale_a, w_amax=w_amax, offs=offs)
    _check_can_launch(a)

    out = torch.empty((M, K), dtype=out_dtype, device=a.device)
    if M == 0:
        return out
    cfg = config or config_dgrad_quantize_w(a.device)
    grid = ((cdiv(M, cfg.block_m) + E) * cdiv(K, cfg.block_n),)
    launch(_grouped_mm_dgrad_quantize_w_kernel)[grid](
        a, w, out, scale_a, w_amax, offs,
        M, K, N, E,
        a.stride(0), a.stride(1),
        w.stride(0), w.stride(2), w.stride(1),
        out.stride(0), out.stride(1),
        scale_a.stride(0), w_amax.stride(0), w_amax.stride(1),
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
        BLOCK_E=next_power_of_2(E + 1), EVEN_K=N % cfg.block_k == 0,
        MAX_IMPRECISE=_max_imprecise(cfg, a.device), OUT_BF16=out_dtype == torch.bfloat16,
        POW2=bool(pow2), EXACT_CAST=launch_target(a.device).kind == "cuda" and fp8.name == "e4m3fn",
        **fp8_constexprs(fp8),
        num_stages=cfg.num_stages, num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


def triton_grouped_mm_2d2d(
    a: torch.Tensor,
    scale_a: torch.Tensor | None,
    b: torch.Tensor,
    scale_b: torch.Tensor | None,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    config: GemmConfig | None = None,
    accumulate_into: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped ``a[rows of g].T @ b[rows of g]`` (wgrad form: ``dW_g = dy_g.T @ x_g``).

    Args:
        a: ``(M, N)`` fp8, row-major or column-major (physically ``(N, M)`` contiguous, the fast
            layout for fp8: the reduction over rows is then contiguous); bf16 / fp16 without scales.
        scale_a: fp32 ``(E, N)`` (per group and column), ``()`` (tensorwise), or ``None`` for
            bf16 / fp16 operands.
        b: ``(M, K)``, same dtype as ``a``, row- or column-major.
        scale_b: fp32 ``(E, K)``, or ``()`` when ``scale_a`` is ``()``, or ``None`` with it.
        offs: ``(E,)`` int32 cumulative end offsets over the M rows; groups of any size, empty
            groups give zeros, rows past ``offs[-1]`` are ignored. Not read on the host.
        out_dtype: bf16 (default), fp16 or fp32.
        config: tile configuration override (default: :func:`.triton_configs.config_2d2d`).
        accumulate_into: ``(E, N, K)`` tensor of ``out_dtype`` (any strides) to add the products
            to, in place: ``out[g] + a_g^T @ b_g`` computed in fp32 and rounded once; empty
            groups leave their slice untouched (not read, not written).
    Returns:
        ``(E, N, K)`` contiguous ``out_dtype``, or ``accumulate_into``.
    """
    scaled = scale_a is not None
    _check_dtypes(a, b, out_dtype, scaled)
    check_tensor("b", b, ndim=2, shape=(a.shape[0], None))
    M, N = a.shape
    K = b.shape[1]
    check_multiple_of("N (a.shape[1])", N, 16)
    check_multiple_of("K (b.shape[1])", K, 16)
    check_offsets(offs)
    E = offs.numel()
    if E < 1:
        raise ValueError("offs: expected at least one group")
    if not scaled:
        if scale_b is not None:
            raise ValueError("scale_b: expected None when scale_a is None")
        mode, scale_a, scale_b = SCALE_NONE, offs, offs  # never read
        sa_strides, sb_strides = (0, 0), (0, 0)
    else:
        check_tensor("scale_a", scale_a, dtypes=(torch.float32,), ndim=(0, 2))
        if scale_a.dim() == 0:
            mode = SCALE_TENSORWISE
            check_tensor("scale_b", scale_b, dtypes=(torch.float32,), ndim=0)
            sa_strides, sb_strides = (0, 0), (0, 0)
        else:
            mode = SCALE_ROWWISE
            check_tensor("scale_a", scale_a, shape=(E, N))
            check_tensor("scale_b", scale_b, dtypes=(torch.float32,), shape=(E, K))
            sa_strides, sb_strides = tuple(scale_a.stride()), tuple(scale_b.stride())
    if accumulate_into is not None:
        check_tensor("accumulate_into", accumulate_into, dtypes=(out_dtype,), shape=(E, N, K))
    check_same_device(a=a, b=b, scale_a=scale_a, scale_b=scale_b, offs=offs,
                      **({} if accumulate_into is None else {"accumulate_into": accumulate_into}))
    _check_can_launch(a)

    out = torch.empty((E, N, K), dtype=out_dtype, device=a.device) if accumulate_into is None else accumulate_into
    cfg = config or config_2d2d(N, K, E, mode, a.device, accumulate_into is not None)
    max_imprecise = _max_imprecise(cfg, a.device) if scaled else None  # fp8 only
    grid = (E * cdiv(N, cfg.block_m) * cdiv(K, cfg.block_n),)
    launch(_grouped_mm_2d2d_kernel)[grid](
        a, b, out, scale_a, scale_b, offs,
        M, N, K,
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        *sa_strides,
        *sb_strides,
        SCALE_MODE=mode,
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
        MAX_IMPRECISE=max_imprecise, EDGE_MAX_IMPRECISE=max_imprecise and min(max_imprecise, 32),
        OUT_BF16=out_dtype == torch.bfloat16, ACCUMULATE=accumulate_into is not None,
        UPCAST=not scaled and launch_target(a.device).kind == "interpreter",
        num_stages=cfg.num_stages, num_warps=cfg.num_warps,
    )  # fmt: skip
    return out
