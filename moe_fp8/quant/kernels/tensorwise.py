"""Tensor-wise FP8 quantization: one scale per tensor (or per expert of ``(E, N, K)`` weights), two launches.

The contiguous input is seen as ``G`` equal groups (``G = 1``: the whole tensor; ``G = E``: the
experts). Launch 1: per group, a fixed number of programs reduce partial amaxes (no atomics).
Launch 2: every program of a group reduces the group's partials to its amax, its program 0 stores
the scale, and all of them scale, round and store their share. The tensor is read twice (the amax
must be known before the first write): 5 bytes moved per bf16 element for 3 bytes of input and
output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...launch import launch
from ...launch_math import cdiv, next_power_of_2
from ..formats import Float8Format
from ..triton_helpers import fp8_scales
from .common import format_constexprs, multiprocessor_count, to_fp8

__all__ = ["launch_tensorwise", "launch_expert_tensorwise"]

_BLOCK = 4096
_PROGRAMS_PER_SM = 4


@triton.jit
def _partial_amax_kernel(x_ptr, partial_ptr, numel, rows_ptr, row_len, HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``(p, g)``: the amax of its share of group ``g`` (``numel`` elements) -> ``partial[g, p]``;
    with ``HAS_ROWS`` only of its first ``rows_ptr[0]`` rows of ``row_len`` elements."""
    base = x_ptr + tl.cast(tl.program_id(1), tl.int64) * numel
    limit = tl.cast(numel, tl.int64)
    if HAS_ROWS:
        limit = tl.minimum(limit, tl.maximum(tl.load(rows_ptr).to(tl.int64), 0) * row_len)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for chunk in range(tl.program_id(0), tl.cdiv(numel, BLOCK), tl.num_programs(0)):
        offs = tl.cast(chunk, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < limit, other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    tl.store(partial_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), tl.max(acc, axis=0))


@triton.jit
def _tensorwise_cast_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    partial_ptr,
    n_partials,
    numel,
    POW2: tl.constexpr,
    BLOCK: tl.constexpr,
    PARTIALS: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    HW_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):
    """Program ``(p, g)``: group ``g``'s scale (stored by ``p == 0``) and its share of ``q``."""
    g = tl.program_id(1)
    idx = tl.arange(0, PARTIALS)
    partials = tl.load(partial_ptr + g * n_partials + idx, mask=idx < n_partials, other=0.0)
    inv_scale, scale = fp8_scales(tl.max(partials, axis=0), FP8_MAX, POW2)
    if tl.program_id(0) == 0:
        tl.store(s_ptr + g, scale)
    base = tl.cast(g, tl.int64) * numel
    for chunk in range(tl.program_id(0), tl.cdiv(numel, BLOCK), tl.num_programs(0)):
        offs = tl.cast(chunk, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        x = tl.load(x_ptr + base + offs, mask=mask, other=0.0)
        q = to_fp8(x, inv_scale, OUT_DTYPE, HW_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)
        tl.store(q_ptr + base + offs, q, mask=mask)


def _launch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, groups: int, fmt: Float8Format, pow2: bool,
            hw_cast: bool | None, rows: torch.Tensor | None = None) -> None:
    numel = x.numel() // groups if groups else 0
    per_group = max(1, multiprocessor_count(x.device) * _PROGRAMS_PER_SM // groups)
    programs = max(1, min(cdiv(numel, _BLOCK), per_group))
    partial = torch.empty((groups, programs), dtype=torch.float32, device=x.device)
    row_len = x.shape[1:].numel() if rows is not None else 1  # elements per row along dim 0
    launch(_partial_amax_kernel)[(programs, groups)](x, partial, numel, x if rows is None else rows, row_len,
                                             HAS_ROWS=rows is not None, BLOCK=_BLOCK, num_warps=8)  # fmt: skip
    launch(_tensorwise_cast_kernel)[(programs, groups)](
        x, q, scale, partial, programs, numel, POW2=bool(pow2), BLOCK=_BLOCK, PARTIALS=next_power_of_2(programs),
        num_warps=8, **format_constexprs(fmt, x.device, hw_cast),
    )


def launch_tensorwise(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, fmt: Float8Format, pow2: bool,
                      hw_cast: bool | None = None, rows: torch.Tensor | None = None) -> None:
    """``x`` contiguous (any shape) -> ``q`` contiguous, ``scale`` 0-d. ``rows``: an int32 tensor
    whose first element (read on the device) counts the leading rows (along dim 0) of ``x`` that
    the amax covers; the rest are cast with that scale but do not enter it."""
    _launch(x, q, scale, 1, fmt, pow2, hw_cast, rows)


def launch_expert_tensorwise(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, fmt: Float8Format, pow2: bool,
                             hw_cast: bool | None = None) -> None:
    """``w (E, N, K)`` contiguous -> ``q (E, N, K)`` contiguous, ``scale (E,)`` (one per expert)."""
    if w.shape[0]:
        _launch(w, q, scale, w.shape[0], fmt, pow2, hw_cast)
