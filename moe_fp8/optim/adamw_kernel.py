"""Triton kernel: the AdamW update of a 3D expert weight and the rowwise FP8 copy of the new weight.

Program ``(expert e, strip j)`` owns rows ``[j * ROWS, (j + 1) * ROWS)`` of ``p (E, N, K)``
(contiguous), whole rows of ``K`` at a time: it reads ``p``, ``grad``, ``exp_avg``, ``exp_avg_sq``,
writes the updated three, and from the new weight still in registers its forward-layout FP8 copy
``q (E, N, K)`` with the per-row scales ``(E, N)`` (amax over K: local to the program) and the
column amax over N, merged into ``(E, K)`` by one relaxed ``atomic_max`` per column and program,
as ``rowwise._expert_rowwise_col_amax_kernel`` does: the dgrad layout then costs one read and
one write of the new weight (``colwise.launch_expert_colwise_t(amax_bits=...)``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch_math import cdiv, next_power_of_2
from ..quant.formats import Float8Format
from ..quant.kernels.common import format_constexprs, to_fp8
from ..quant.kernels.rowwise import MAX_SINGLE_PASS_K
from ..quant.triton_helpers import fp8_scales
from ..routing.combine_kernels import cast_rne

__all__ = ["DEFAULT_CONFIG", "HYPER_NAMES", "adamw_fits", "launch_adamw_quantize"]

HYPER_NAMES = ("decay", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "step_size", "bc2_sqrt", "eps")

# Rows per program, elements per register tile (four fp32 operands live at once: twice the
# quantization kernels' operands, so half their tile), software-pipeline stages of the row loop.
# Not yet swept on a GPU: ``benchmarks/bench_weight_quant_step.py`` times a few configs.
DEFAULT_CONFIG = dict(rows=64, tile=2048, stages=2, num_warps=None)


@triton.jit
def _adamw_quantize_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, q_ptr, s_ptr, amax_ptr,
    N, K,
    decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps,
    QUANTIZE: tl.constexpr,
    STAGES: tl.constexpr,
    QUANT_DTYPE: tl.constexpr,
    POW2: tl.constexpr,
    ROWS: tl.constexpr,
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
    """The update is torch's single-tensor AdamW in fp32: ``p *= 1 - lr * wd``; ``m += (1 - b1) *
    (g - m)``; ``v = v * b2 + (1 - b2) * g * g``; ``p -= step_size * m / (sqrt(v) / bc2_sqrt + eps)``
    (``decay``, ``1 - b1``, ``1 - b2``, ``step_size``, ``bc2_sqrt`` computed on the host in double).
    The FP8 copy quantizes the new weight as stored (``p``'s dtype), cast to ``QUANT_DTYPE``. The
    moments are fp32 or bf16 (then rounded once per step: the math runs in fp32)."""
    e = tl.program_id(0)
    r0 = tl.program_id(1) * ROWS
    cols = tl.arange(0, BLOCK_K)
    col_ok = cols < K
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for i in tl.range(0, ROWS, BLOCK_M, num_stages=STAGES):
        r = r0 + i + tl.arange(0, BLOCK_M)
        row_ok = r < N
        rows = e * N + r
        mask = row_ok[:, None] & col_ok[None, :]
        off = rows.to(tl.int64)[:, None] * K + cols[None, :]
        p_old = tl.load(p_ptr + off, mask=mask, other=0.0)
        p = p_old.to(tl.float32)
        g = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + off, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + off, mask=mask, other=0.0).to(tl.float32)
        p = p * decay
        m = m + one_minus_beta1 * (g - m)
        v = v * beta2 + one_minus_beta2 * g * g
        denom = tl.math.div_rn(tl.sqrt_rn(v), tl.zeros_like(v) + bc2_sqrt) + eps
        p = p - step_size * tl.math.div_rn(m, denom)
        p_new = cast_rne(p, p_old.dtype)  # the interpreter's own fp32 -> bf16 cast truncates
        tl.store(p_ptr + off, p_new, mask=mask)
        tl.store(m_ptr + off, cast_rne(m, m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + off, cast_rne(v, v_ptr.dtype.element_ty), mask=mask)
        if QUANTIZE:
            w = cast_rne(p_new.to(tl.float32), QUANT_DTYPE).to(tl.float32)
            ax = tl.where(mask, tl.abs(w), 0.0)
            inv_scale, scale = fp8_scales(tl.max(ax, axis=1), FP8_MAX, POW2)
            q = to_fp8(w, inv_scale[:, None], OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE,
                       FP8_NEG_ZERO)
            tl.store(q_ptr + off, q, mask=mask)
            tl.store(s_ptr + rows, scale, mask=row_ok)
            acc = tl.maximum(acc, ax)
    if QUANTIZE:
        bits = tl.max(acc, axis=0).to(tl.int32, bitcast=True)
        tl.atomic_max(amax_ptr + e * K + cols, bits, mask=col_ok, sem="relaxed")


def adamw_fits(K: int) -> bool:
    """Whether rows of ``K`` fit the kernel (whole rows in registers, as the column-amax kernels)."""
    return next_power_of_2(max(K, 16)) <= MAX_SINGLE_PASS_K


def launch_adamw_quantize(
    p: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: dict,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    fmt: Float8Format,
    pow2: bool,
    quant_dtype: torch.dtype,
    hw_cast: bool | None = None,
    config: dict | None = None,
) -> None:
    """Update ``p (E, N, K)`` (and its ``exp_avg``, ``exp_avg_sq``, fp32 or bf16) in place from ``grad``, all
    contiguous; with ``out = (q (E, N, K) fp8, scale (E, N) fp32, amax_bits (E, K) int32 zeros)``
    fill them from the new weight cast to ``quant_dtype`` (``out = None``: the update alone).
    ``hyper``: the kernel's float arguments by name (see ``adamw_quantize.adamw_hyper``); ``config``:
    ``DEFAULT_CONFIG``'s keys (``num_warps=None``: 4 for tiles of at most 1024 elements, else 8)."""
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    E, N, K = p.shape
    block_k = next_power_of_2(max(K, 16))
    block_m = max(1, min(cfg["tile"] // block_k, next_power_of_2(max(N, 1))))
    rows = max(cfg["rows"], block_m) // block_m * block_m
    warps = cfg["num_warps"] or (4 if block_m * block_k <= 1024 else 8)
    if E * N * K == 0:
        return
    quantize = out is not None
    q, s, amax = out if quantize else (p, p, p)
    _adamw_quantize_kernel[(E, cdiv(N, rows))](
        p, grad, exp_avg, exp_avg_sq, q, s, amax, N, K,
        *(hyper[k] for k in HYPER_NAMES),
        QUANTIZE=quantize, STAGES=cfg["stages"], QUANT_DTYPE=_TL_DTYPES[quant_dtype], POW2=bool(pow2), ROWS=rows,
        BLOCK_M=block_m, BLOCK_K=block_k, num_warps=warps, **format_constexprs(fmt, p.device, hw_cast),
    )


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
