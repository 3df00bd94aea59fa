"""Both FP8 layouts of 3D expert weights in one launch (the per-step weight cache fills from this).

``w (E, N, K)`` -> forward ``q (E, N, K)``, ``scale (E, N)`` (amax over K) and dgrad
``q (E, K, N)``, ``scale (E, K)`` (amax over N). The two layouts need different reductions (over
K and over N) before any element of either can be written, and no on-chip buffer holds an expert,
so ``w`` is read once per layout: the first ``NF`` programs quantize rows (:mod:`.rowwise`), the
rest walk dgrad strips (:mod:`.colwise`, persistent). Bytes moved: 2 reads of ``w`` + both
writes, i.e. 6 bytes per bf16 element for 4 bytes of distinct input and output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import Float8Format
from .colwise import colwise_config, expert_colwise_t_item, launch_expert_colwise_t
from .common import format_constexprs, multiprocessor_count
from .rowwise import launch_rowwise, rowwise_block, rowwise_config

__all__ = ["launch_expert_dual"]


@triton.jit
def _expert_dual_kernel(
    w_ptr,
    qf_ptr,
    sf_ptr,
    qb_ptr,
    sb_ptr,
    E,
    N,
    K,
    NF,
    NB,
    n_items,
    stride_we,
    stride_wn,
    stride_wk,
    POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < NF:
        rowwise_block(w_ptr, qf_ptr, sf_ptr, pid, E * N, K, N, stride_we, stride_wn, stride_wk,
                      POW2, BLOCK_M, BLOCK_K, SINGLE_PASS, OUT_DTYPE, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL,
                      FP8_SUB_SCALE, FP8_NEG_ZERO)
    else:
        for item in range(pid - NF, n_items, tl.num_programs(0) - NF):
            expert_colwise_t_item(w_ptr, qb_ptr, sb_ptr, item, N, K, NB, stride_we, stride_wn, stride_wk,
                                  POW2, BLOCK_R, BLOCK_C, OUT_DTYPE, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL,
                                  FP8_SUB_SCALE, FP8_NEG_ZERO)


def launch_expert_dual(
    w: torch.Tensor,
    q_fwd: torch.Tensor,
    s_fwd: torch.Tensor,
    q_bwd: torch.Tensor,
    s_bwd: torch.Tensor,
    fmt: Float8Format,
    pow2: bool,
    row_config: dict | None = None,
    col_config: dict | None = None,
) -> None:
    """Fill the forward ``(E, N, K)`` / ``(E, N)`` and dgrad ``(E, K, N)`` / ``(E, K)`` buffers from ``w``."""
    E, N, K = w.shape
    if E * N == 0 or K == 0:  # nothing to read: the separate launchers write the empty-group scales
        launch_rowwise(w, q_fwd, s_fwd, fmt, pow2, M=E * N, K=K, rows_per_group=N, stride_g=w.stride(0),
                       stride_r=w.stride(1), stride_k=w.stride(2))
        launch_expert_colwise_t(w, q_bwd, s_bwd, fmt, pow2)
        return
    rcfg = dict(row_config or rowwise_config(E * N, K))
    ccfg = dict(col_config or colwise_config(N))
    # One num_warps for the whole launch: the row programs' (they hold whole rows in registers).
    num_warps = rcfg.pop("num_warps")
    ccfg.pop("num_warps")
    nf = triton.cdiv(E * N, rcfg["BLOCK_M"])
    nb = triton.cdiv(K, ccfg["BLOCK_C"])
    n_items = E * nb
    per_sm = ccfg.pop("programs_per_sm")
    n_col_programs = n_items if per_sm <= 0 else min(n_items, multiprocessor_count(w.device) * per_sm)
    _expert_dual_kernel[(nf + n_col_programs,)](
        w, q_fwd, s_fwd, q_bwd, s_bwd, E, N, K, nf, nb, n_items, w.stride(0), w.stride(1), w.stride(2),
        POW2=bool(pow2), **rcfg, **ccfg, num_warps=num_warps, **format_constexprs(fmt),
    )
