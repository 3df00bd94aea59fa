"""The FP8 weight layout of the large groups, for the GEMM that otherwise quantizes the weight in
its tiles (:func:`.triton_kernel.triton_grouped_mm_dgrad_quantize_w`).

That GEMM converts each weight tile once per row tile of its expert: cheaper than a layout (one
read and one FP8 write of the whole weight) for experts of a few hundred rows, dearer for one of
thousands. So the experts whose groups hold at least ``min_rows`` rows get their FP8 weight
written here first, and the GEMM reads it for their tiles; the other experts' weights are neither
read nor written here.

* ``q (S, K, N)`` fp8, N (the GEMM's reduction) contiguous: slot ``s`` holds the ``s``-th large
  group's expert in expert order, ``S = min(E, M // min_rows)`` (no more groups of ``M`` rows can
  be that large). A group past the last slot (only with offsets that overlap) keeps the in-GEMM
  path, so every output stays defined.
* The same FP8 values as the in-GEMM quantization: the scales of the same amax, the same rounding
  and cast (:func:`quantize_tile`).
* Which groups are large is read from ``offs`` on the device (:func:`large_group_slot`): no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import launch
from ..launch_math import cdiv, next_power_of_2
from ..quant.formats import Float8Format
from ..quant.triton_helpers import fp8_constexprs, fp8_round, fp8_scales

__all__ = ["large_group_layout", "large_group_slot", "num_large_group_slots", "quantize_tile"]

_BLOCK_N = 64  # reduction rows of w per program
_BLOCK_K = 64  # output columns of w per program


@triton.jit
def large_group_slot(ends, starts, g, M, E, MIN_ROWS, NUM_SLOTS, BLOCK_E: tl.constexpr):
    """``(large, slot)`` of group ``g``: whether it holds at least ``MIN_ROWS`` rows (and has a
    slot), and the number of large groups before it. ``ends`` / ``starts``: ``offs[e]`` and
    ``offs[e - 1]`` over ``e < BLOCK_E`` as the kernels load them (clamped into ``[0, M]`` here)."""
    e = tl.arange(0, BLOCK_E)
    rows = tl.minimum(tl.maximum(ends, 0), M) - tl.minimum(tl.maximum(starts, 0), M)
    is_large = (rows >= MIN_ROWS) & (e < E)
    slot = tl.sum((is_large & (e < g)).to(tl.int32), 0)
    large = (tl.sum((is_large & (e == g)).to(tl.int32), 0) > 0) & (slot < NUM_SLOTS)
    return large, slot


@triton.jit
def quantize_tile(w, inv_scale, EXACT_CAST: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr,
                  FP8_MIN_NORMAL: tl.constexpr, FP8_SUB_SCALE: tl.constexpr, FP8_NEG_ZERO: tl.constexpr):
    """``w * inv_scale`` in fp32, rounded onto the FP8 grid unless ``EXACT_CAST`` (the hardware cast
    rounds and saturates alike); the caller casts it to its FP8 dtype."""
    w = w.to(tl.float32) * inv_scale
    if not EXACT_CAST:
        w = fp8_round(w, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)
    return w


@triton.jit
def _large_group_layout_kernel(
    w_ptr, amax_ptr, offs_ptr, q_ptr,
    M, N, K, E, NUM_SLOTS, MIN_ROWS,
    stride_we, stride_wn, stride_wk,
    stride_ae, stride_ak,
    stride_qs, stride_qk, stride_qn,
    BN: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr, POW2: tl.constexpr, EXACT_CAST: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):  # fmt: skip
    # One (expert, K block, N block) tile: returns at once unless the expert's group is large.
    g = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + e, mask=e < E, other=M)
    starts = tl.load(offs_ptr + e - 1, mask=(e >= 1) & (e < E), other=0)
    large, slot = large_group_slot(ends, starts, g, M, E, MIN_ROWS, NUM_SLOTS, BLOCK_E)
    if not large:
        return
    ks = tl.program_id(1) * BK + tl.arange(0, BK)
    ns = tl.program_id(2) * BN + tl.arange(0, BN)
    k_mask, n_mask = ks < K, ns < N
    amax = tl.load(amax_ptr + g.to(tl.int64) * stride_ae + ks.to(tl.int64) * stride_ak, mask=k_mask, other=0.0)
    inv_scale, _ = fp8_scales(amax, FP8_MAX, POW2)
    mask = n_mask[:, None] & k_mask[None, :]
    w = tl.load(w_ptr + g.to(tl.int64) * stride_we + ns.to(tl.int64)[:, None] * stride_wn
                + ks.to(tl.int64)[None, :] * stride_wk, mask=mask, other=0.0)
    q = quantize_tile(w, inv_scale[None, :], EXACT_CAST, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE,
                      FP8_NEG_ZERO)
    tl.store(q_ptr + slot.to(tl.int64) * stride_qs + ks.to(tl.int64)[None, :] * stride_qk
             + ns.to(tl.int64)[:, None] * stride_qn, q.to(q_ptr.dtype.element_ty), mask=mask)


def num_large_group_slots(rows: int, groups: int, min_rows: int) -> int:
    """The most groups of ``rows`` rows in all that can hold ``min_rows`` rows each, at most ``groups``."""
    return min(groups, rows // min_rows)


def large_group_layout(w: torch.Tensor, w_amax: torch.Tensor, offs: torch.Tensor, rows: int, min_rows: int,
                       fmt: Float8Format, pow2: bool, exact_cast: bool) -> torch.Tensor:
    """The FP8 ``(S, K, N)`` layout (N contiguous) of ``w (E, N, K)`` (any strides) for the experts
    whose groups of ``offs`` (int32 end offsets over ``rows`` rows) hold at least ``min_rows`` rows,
    in expert order, with the per-column scales of ``w_amax (E, K)``; ``S`` from
    :func:`num_large_group_slots`. The slots of fewer large groups are left unwritten."""
    E, N, K = w.shape
    slots = num_large_group_slots(rows, E, min_rows)
    q = torch.empty((slots, K, N), dtype=fmt.torch_dtype, device=w.device)
    if slots == 0:
        return q
    launch(_large_group_layout_kernel)[(E, cdiv(K, _BLOCK_K), cdiv(N, _BLOCK_N))](
        w, w_amax, offs, q,
        rows, N, K, E, slots, min_rows,
        w.stride(0), w.stride(1), w.stride(2),
        w_amax.stride(0), w_amax.stride(1),
        q.stride(0), q.stride(1), q.stride(2),
        BN=_BLOCK_N, BK=_BLOCK_K, BLOCK_E=next_power_of_2(E + 1), POW2=bool(pow2), EXACT_CAST=exact_cast,
        **fp8_constexprs(fmt),
    )  # fmt: skip
    return q
