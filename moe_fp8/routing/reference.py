"""Pure-torch references of the dispatch plan, the permutes and the combine.

They define the results the Triton kernels must reproduce (bit for bit for the plan and the
permutes; the combine sums in the same slot order in fp32). They are sync-free too, and are
what runs on a CPU without the Triton interpreter.
"""

from __future__ import annotations

import functools
import math
import struct

import torch

from ..quant.formats import Float8Format
from ..quant.reference import EPS, quantize_rowwise

__all__ = [
    "dispatch_plan_reference",
    "permute_reference",
    "permute_quantize_reference",
    "combine_reference",
    "combine_backward_reference",
    "padding_scale",
]


def dispatch_plan_reference(
    topk_ids: torch.Tensor, num_experts: int, pad_multiple: int = 1, empty_group_rows: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(counts, offsets, pair_to_row, row_to_pair, pad_rows, wgrad_offsets)`` (all int32) by a
    stable sort.

    See :class:`moe_fp8.routing.plan.DispatchPlan` for the meaning of each tensor.
    """
    E, P = num_experts, pad_multiple
    own_rows = P - 1 + int(empty_group_rows)  # padding rows each expert owns
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    N = flat.numel()
    M = N + own_rows * E
    key = torch.where((flat >= 0) & (flat < E), flat, E)  # invalid ids sort last, in no group
    sorted_key, order = torch.sort(key, stable=True)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))[:E]
    padded = (counts + P - 1) // P * P
    if empty_group_rows:
        padded = padded.clamp_min(P)
    group_end = padded.cumsum(0)
    group_start = group_end - padded
    first = counts.cumsum(0) - counts  # index of the expert's first pair in sorted order
    e = sorted_key.clamp_max(E - 1)
    row = group_start[e] + torch.arange(N, device=dev) - first[e]
    row = torch.where(sorted_key < E, row, -1)
    pair_to_row = torch.empty(N, dtype=torch.int64, device=dev).scatter_(0, order, row)
    row_to_pair = torch.full((M + 1,), -1, dtype=torch.int64, device=dev)
    row_to_pair.scatter_(0, torch.where(row >= 0, row, M), order)  # dropped pairs land on slot M
    j = torch.arange(own_rows, device=dev)
    own_pad = padded - counts
    pads_before = group_start - first
    used = padded.sum()
    own = (group_start + counts)[:, None] + j
    tail = (used + torch.arange(E, device=dev) * own_rows - pads_before - own_pad)[:, None] + j
    pad_rows = torch.where(j < own_pad[:, None], own, tail).reshape(-1)
    # forward groups: an empty group's rows join the next non-empty group (or lie past the last)
    offsets = torch.cummax(torch.where(counts > 0, group_end, 0), 0).values if empty_group_rows else group_end
    i32 = torch.int32
    return (counts.to(i32), offsets.to(i32), pair_to_row.to(i32), row_to_pair[:M].to(i32), pad_rows.to(i32),
            group_end.to(i32))


def permute_reference(x: torch.Tensor, row_to_pair: torch.Tensor, top_k: int) -> torch.Tensor:
    """``out[r] = x[row_to_pair[r] // k]``; padding rows (``row_to_pair < 0``) are 0."""
    padded_x = torch.cat([x, x.new_zeros(1, x.shape[1])])  # row T: the zero source of padding rows
    src = torch.where(row_to_pair < 0, x.shape[0], row_to_pair.long() // top_k)
    return padded_x[src]


def permute_quantize_reference(
    x: torch.Tensor, row_to_pair: torch.Tensor, top_k: int, fmt: Float8Format, pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rowwise(permute_reference(x))``: zero padding rows get ``padding_scale(fmt)``."""
    return quantize_rowwise(permute_reference(x, row_to_pair, top_k), fmt, pow2=pow2)


def _f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


@functools.lru_cache(maxsize=None)
def padding_scale(fmt: Float8Format, pow2: bool = False) -> float:
    """The dequantization scale of an all-zero row (``EPS / max``, or its pow2 form), as
    ``quant.reference.amax_to_scales`` gives it for a zero amax. Host arithmetic (fp32 rounding of
    each step), no tensor op: it is called while torch.compile traces."""
    inv_scale = _f32(_f32(fmt.max) / _f32(EPS))  # a double quotient rounded to fp32 is fp32's quotient
    if pow2:
        inv_scale = math.ldexp(1.0, math.frexp(inv_scale)[1] - 1)  # keep the exponent bits
    return _f32(1.0 / inv_scale)


def _gather_slots(y: torch.Tensor, pair_to_row: torch.Tensor, top_k: int) -> torch.Tensor:
    """``(T, k, H)`` fp32 expert outputs of each (token, slot); dropped pairs (row -1) are 0."""
    rows = pair_to_row.long().view(-1, top_k)
    g = y.float()[rows.clamp_min(0)]
    return g.masked_fill((rows < 0)[..., None], 0)


def combine_reference(
    y: torch.Tensor, pair_to_row: torch.Tensor, weights: torch.Tensor | None, top_k: int
) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * y[pair_to_row[t*k + j]]`` summed in fp32 in slot order, cast to ``y.dtype``."""
    g = _gather_slots(y, pair_to_row, top_k)
    if weights is not None:
        g = g * weights.float()[..., None]
    out = torch.zeros(g.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
    for j in range(top_k):
        out = out + g[:, j]
    return out.to(y.dtype)


def combine_backward_reference(
    grad_out: torch.Tensor, y: torch.Tensor, pair_to_row: torch.Tensor, weights: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_y, grad_weights)`` of :func:`combine_reference`; rows of ``y`` no pair uses get 0."""
    rows = pair_to_row.long().view(-1, top_k)
    g = grad_out.float()
    grad_w = (_gather_slots(y, pair_to_row, top_k) * g[:, None, :]).sum(-1)
    per_slot = (weights.float()[..., None] * g[:, None, :]).to(y.dtype)
    grad_y = torch.zeros(y.shape[0] + 1, y.shape[1], dtype=y.dtype, device=y.device)
    grad_y[torch.where(rows >= 0, rows, y.shape[0]).reshape(-1)] = per_slot.reshape(-1, y.shape[1])
    return grad_y[: y.shape[0]], grad_w.to(weights.dtype)
