"""The one place where ``fp8_grouped_mm`` quantizes: activations, gradients, weights, wgrad operands.

Every function states the layout it returns; the autograd op and the backends rely on nothing
else. With ``fused=True`` (the cuda, rocm and triton backends) the fused Triton kernels of
``moe_fp8.quant.ops`` run wherever Triton runs (GPU tensors, or CPU tensors under
``TRITON_INTERPRET=1``); otherwise (the emulated backend, or Triton unavailable) the pure-torch
reference quantizers of ``moe_fp8.quant.reference`` run. The kernels reproduce the reference
byte for byte, so the choice never changes a result.
"""

from __future__ import annotations

import torch

from ..kernel_backend import triton_runs_on
from ..quant import ops as kernels
from ..quant import reference as ref
from ..quant.formats import Float8Format
from ..quant.kernels.rowwise import col_amax_fits
from .padding import gather_rows_padded, gather_rows_padded_reference
from .transpose import transposed_copy

__all__ = [
    "BLOCK",
    "quantize_activation",
    "quantize_activation_group_amax",
    "group_amax",
    "quantize_weight",
    "quantize_weight_dgrad_layout",
    "quantize_weight_layout",
    "quantize_weight_forward_layout",
    "quantize_wgrad_operand",
    "quantize_wgrad_operands",
    "weight_amax",
    "wgrad_operand_layout",
]

BLOCK = 128  # blockwise recipe: 1 x 128 activation blocks, 128 x 128 weight blocks


def _kernels(t: torch.Tensor, fused: bool) -> bool:
    return fused and triton_runs_on(t)


def quantize_activation(
    x: torch.Tensor, scaling: str, fmt: Float8Format, pow2: bool, fused: bool, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the left operand of a 2D x 3D GEMM (x in forward, grad_out in dgrad).

    Args:
        x: ``(M, K)`` row-major, bf16/fp16/fp32.
        scaling: ``"rowwise"`` | ``"tensorwise"`` | ``"blockwise"``.
        rows: ``tensorwise`` only, optional int32 ``(n,)`` on ``x``'s device: the amax covers the
            first ``rows[0]`` rows (the routed tokens, ``offs[-1:]``); the rows past them, which
            may hold anything, are cast but never enter a GEMM.
    Returns:
        ``q (M, K)`` row-major fp8 and fp32 scales ``(M,)`` (rowwise), ``()`` (tensorwise) or
        ``(M, ceil(K/128))`` (blockwise, 1 x 128 blocks).
    """
    k = _kernels(x, fused)
    if scaling == "rowwise":
        return kernels.triton_quantize_rowwise(x, fmt, pow2) if k else ref.quantize_rowwise(x, fmt, pow2=pow2)
    if scaling == "tensorwise":
        if k:
            return kernels.triton_quantize_tensorwise(x, fmt, pow2, rows)
        return ref.quantize_tensorwise(x, fmt, pow2=pow2, rows=rows)
    if k:
        return kernels.triton_quantize_blockwise(x, fmt, (1, BLOCK), pow2)
    return ref.quantize_blockwise(x, fmt, block=(1, BLOCK), pow2=pow2)


def quantize_activation_group_amax(
    x: torch.Tensor, offs: torch.Tensor, fmt: Float8Format, pow2: bool, fused: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rowwise`` :func:`quantize_activation` of ``x (M, K)`` (grad_out in dgrad), and ``x``'s
    per-group column amax ``(E, K)`` fp32 over the groups of ``offs``, for
    :func:`quantize_wgrad_operands` (``a_amax``). The kernels take it from the same read
    (``K <= 16384``; longer rows, and the reference path, reduce it with torch)."""
    if _kernels(x, fused) and col_amax_fits(x.shape[1]):
        return kernels.triton_quantize_rowwise_with_group_amax(x, offs, fmt, pow2)
    q, s = quantize_activation(x, "rowwise", fmt, pow2, fused)
    return q, s, ref.group_amax(x, offs)


def group_amax(x: torch.Tensor, offs: torch.Tensor, fused: bool) -> torch.Tensor:
    """``x``'s per-group column amax ``(E, K)`` fp32 alone, for an ``x`` whose rows were quantized
    upstream (:func:`quantize_wgrad_operands`' ``b_amax``): one read of the groups' rows
    (``K <= 16384``; longer rows, and the reference path, reduce it with torch)."""
    if _kernels(x, fused) and col_amax_fits(x.shape[1]):
        return kernels.triton_group_amax(x, offs)
    return ref.group_amax(x, offs)


def quantize_weight(
    w: torch.Tensor, scaling: str, fmt: Float8Format, pow2: bool, fused: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize expert weights once, in the forward and the dgrad layout.

    Args:
        w: ``(E, N, K)`` (``nn.Linear`` layout per expert), any strides.
    Returns:
        ``q_fwd (E, N, K)`` contiguous with ``s_fwd``, and ``q_bwd (E, K, N)`` contiguous with
        ``s_bwd``. Scales: rowwise ``(E, N)`` (amax over K) and ``(E, K)`` (amax over N), one op
        of two launches that each read ``w`` (see ``triton_quantize_expert_colwise_dual``);
        tensorwise ``(E,)`` both; blockwise
        ``(E, ceil(N/128), ceil(K/128))`` and its transpose (128 x 128 blocks: transposing
        commutes with quantizing).
    """
    if scaling == "rowwise":
        if _kernels(w, fused):
            return kernels.triton_quantize_expert_colwise_dual(w, fmt, pow2)
        return (*ref.quantize_expert_colwise(w, fmt, pow2=pow2),
                *ref.quantize_expert_colwise(w, fmt, pow2=pow2, transposed=True))
    q_fwd, s_fwd = _forward_layout(w, scaling, fmt, pow2, fused)
    return q_fwd, s_fwd, *_dgrad_from_forward(q_fwd, s_fwd, scaling, _kernels(w, fused))


def quantize_weight_layout(
    w: torch.Tensor, scaling: str, fmt: Float8Format, pow2: bool, fused: bool, dgrad: bool,
    after: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layout of :func:`quantize_weight`, the same bytes: ``(q_fwd, s_fwd)``, or with ``dgrad``
    ``(q_bwd, s_bwd)``. Rowwise quantizes that layout alone (one launch, its own amax); tensorwise
    and blockwise quantize the forward layout and, for ``dgrad``, transpose it. ``after`` (rowwise
    dgrad): a tensor of the backward pass the kernel is ordered after (see
    :func:`quantize_weight_dgrad_layout`)."""
    if scaling == "rowwise":
        if _kernels(w, fused):
            return kernels.triton_quantize_expert_colwise(w, fmt, pow2, transposed=dgrad,
                                                          after=after if dgrad else None)
        return ref.quantize_expert_colwise(w, fmt, pow2=pow2, transposed=dgrad)
    q_fwd, s_fwd = _forward_layout(w, scaling, fmt, pow2, fused)
    return _dgrad_from_forward(q_fwd, s_fwd, scaling, _kernels(w, fused)) if dgrad else (q_fwd, s_fwd)


def _forward_layout(w: torch.Tensor, scaling: str, fmt: Float8Format, pow2: bool,
                    fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensorwise or blockwise (128 x 128) forward layout of ``w (E, N, K)``: ``q (E, N, K)``, ``s``."""
    k = _kernels(w, fused)
    if scaling == "tensorwise":
        if k:
            return kernels.triton_quantize_expert_tensorwise(w, fmt, pow2)
        return ref.quantize_expert_tensorwise(w, fmt, pow2=pow2)
    if k:
        return kernels.triton_quantize_blockwise(w, fmt, (BLOCK, BLOCK), pow2)
    return ref.quantize_blockwise(w, fmt, block=(BLOCK, BLOCK), pow2=pow2)


def _dgrad_from_forward(q_fwd: torch.Tensor, s_fwd: torch.Tensor, scaling: str,
                        kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The dgrad layout of a tensorwise or blockwise forward layout: its transposes (one scale per
    expert, or per 128 x 128 block: transposing commutes with quantizing)."""
    s_bwd = s_fwd.clone() if scaling == "tensorwise" else _transposed_copy(s_fwd, kernel)
    return _transposed_copy(q_fwd, kernel), s_bwd


def weight_amax(w: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``w (E, N, K)``'s amax over K ``(E, N)`` and over N ``(E, K)``, fp32: the scales of both rowwise
    layouts, for GEMMs that quantize ``w``'s tiles as they read them. One read of ``w`` with the
    kernels (contiguous rows of at most 16384 elements), else two torch reductions."""
    if _kernels(w, fused) and kernels.expert_amax_fits(w):
        return kernels.triton_expert_amax(w)
    return ref.expert_amax(w), ref.expert_amax(w, transposed=True)


def quantize_weight_forward_layout(
    w: torch.Tensor, fmt: Float8Format, pow2: bool, fused: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward layout of :func:`quantize_weight`'s ``rowwise`` pair, and what its dgrad layout needs.

    Args:
        w: ``(E, N, K)`` (``nn.Linear`` layout per expert), any strides.
    Returns:
        ``q (E, N, K)`` contiguous and ``s (E, N)`` (amax over K), the same bytes as
        ``quantize_weight``; and ``col_amax (E, K)`` fp32, the amax over N, for
        :func:`quantize_weight_dgrad_layout`. The kernels take it from the same read of ``w``
        (contiguous rows of at most 16384 elements; longer rows reduce it with torch; a view of
        ``(E, K, N)`` storage is read twice along the storage's rows).
    Used when no cache holds the weights: the forward quantizes its layout and the backward the
    dgrad one from the saved ``w`` and ``col_amax``, so no FP8 copy lives from forward to backward.
    """
    if _kernels(w, fused) and kernels.expert_amax_fits(w):
        return kernels.triton_quantize_expert_rowwise_with_amax(w, fmt, pow2)
    if _kernels(w, fused):
        q, s = kernels.triton_quantize_expert_colwise(w, fmt, pow2)
    else:
        q, s = ref.quantize_expert_colwise(w, fmt, pow2=pow2)
    return q, s, ref.expert_amax(w, transposed=True)


def quantize_weight_dgrad_layout(
    w: torch.Tensor, col_amax: torch.Tensor, fmt: Float8Format, pow2: bool, fused: bool,
    after: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dgrad layout of :func:`quantize_weight`'s ``rowwise`` pair: ``q (E, K, N)`` contiguous and
    ``s (E, K)``, with the scales from ``col_amax (E, K)`` (made by
    :func:`quantize_weight_forward_layout` from the same ``w``), one read and one write of ``w``.

    ``after``: a float32 tensor of the backward pass (grad_out's scales), handed to the kernel and
    never read. The layout depends on ``w`` and ``col_amax`` alone, so torch.compile's partitioner
    would otherwise make it in the forward and keep it until the backward (one byte per weight
    element, for every layer at once); ordered after ``after`` it is made in the backward and freed
    after its GEMM. The reference quantizers ignore it."""
    if _kernels(w, fused):
        return kernels.triton_quantize_expert_colwise_from_amax(w, col_amax, fmt, pow2, after=after)
    return ref.quantize_expert_colwise(w, fmt, pow2=pow2, transposed=True, amax=col_amax)


def _transposed_copy(t: torch.Tensor, kernel: bool) -> torch.Tensor:
    """A new contiguous tensor holding ``t.transpose(-2, -1)`` (never a view of ``t``): the Triton
    copy with ``kernel`` (:mod:`.transpose`), else torch's."""
    return transposed_copy(t) if kernel else t.transpose(-2, -1).clone(memory_format=torch.contiguous_format)


def quantize_wgrad_operands(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    fmt: Float8Format,
    pow2: bool,
    fused: bool,
    *,
    padded_offs: torch.Tensor | None = None,
    padded_rows: int | None = None,
    a_amax: torch.Tensor | None = None,
    b_amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize both wgrad operands of the ``rowwise`` FP8 wgrad: per group and column (amax over
    the group's rows; rows past ``offs[-1]`` become 0). (``tensorwise`` reuses the FP8 tensors of
    the forward and the dgrad: :func:`wgrad_operand_layout`.)

    Args:
        a: ``(M, N)`` grad_output; b: ``(M, K)`` input activations; offs: ``(E,)`` int32.
        padded_offs, padded_rows: when given, group ``g``'s rows land at the 16-aligned start
            ``padded_offs[g-1]`` of a ``padded_rows``-row buffer; rows outside the groups are
            never read by the GEMM (zero, or tail rows past ``padded_offs[-1]``).
        a_amax, b_amax: optional, the per-group column amaxes ``(E, N)`` and ``(E, K)`` from
            :func:`quantize_activation_group_amax`; a tensor with its amax is quantized without a
            reduction.
    Returns:
        ``qa (rows, N)`` and ``qb (rows, K)`` fp8, both column-major (strides ``(1, rows)``),
        ``rows`` = M or ``padded_rows``; scales ``sa (E, N)``, ``sb (E, K)``.
    """
    if _kernels(a, fused):
        return kernels.triton_quantize_group_colwise_dual(
            a, b, offs, fmt, pow2, padded_offs=padded_offs, padded_rows=padded_rows, a_amax=a_amax, b_amax=b_amax
        )
    padded = dict(padded_offs=padded_offs, padded_rows=padded_rows)
    return (*quantize_wgrad_operand(a, offs, fmt, pow2, False, a_amax=a_amax, **padded),
            *quantize_wgrad_operand(b, offs, fmt, pow2, False, a_amax=b_amax, **padded))


def quantize_wgrad_operand(a: torch.Tensor, offs: torch.Tensor, fmt: Float8Format, pow2: bool, fused: bool, *,
                           padded_offs: torch.Tensor | None = None, padded_rows: int | None = None,
                           a_amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One operand of :func:`quantize_wgrad_operands`: ``(qa (rows, N) column-major, sa (E, N))``, the
    same bytes as that function's first pair (for a wgrad whose other operand is already made)."""
    if _kernels(a, fused):
        return kernels.triton_quantize_group_colwise(a, offs, fmt, pow2, column_major=True, padded_offs=padded_offs,
                                                     padded_rows=padded_rows, amax=a_amax)
    qa, sa = ref.quantize_group_colwise(a, offs, fmt, pow2=pow2, amax=a_amax)
    return wgrad_operand_layout(qa, offs, False, padded_offs=padded_offs, padded_rows=padded_rows), sa


def wgrad_operand_layout(
    q: torch.Tensor,
    offs: torch.Tensor,
    fused: bool,
    *,
    padded_offs: torch.Tensor | None = None,
    padded_rows: int | None = None,
) -> torch.Tensor:
    """An FP8 wgrad operand ``q (M, C)`` (row-major, e.g. the forward's or the dgrad's ``tensorwise``
    quantization of x or grad_out) in the layout the wgrad GEMM takes: column-major ``(rows, C)``
    (strides ``(1, rows)``), with ``padded_offs`` / ``padded_rows`` in the padded row layout of
    :func:`quantize_wgrad_operands`, else ``rows = M``. Bytes move, values do not; one Triton launch
    with ``fused`` (:func:`.padding.gather_rows_padded`, :func:`.transpose.transposed_copy`)."""
    if padded_offs is None:
        return _transposed_copy(q, _kernels(q, fused)).t()
    if _kernels(q, fused):
        return gather_rows_padded(q, offs, padded_offs, padded_rows, column_major=True)
    return gather_rows_padded_reference(q, offs, padded_offs, padded_rows, column_major=True)
