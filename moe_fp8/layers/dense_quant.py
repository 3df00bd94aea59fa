"""How ``FP8Linear`` quantizes its operands: rows, transposed columns, and the weight's two layouts.

Shapes: activations and gradients are 2-D ``(M, C)``; the weight is ``W (N, K)`` (``nn.Linear``).
Scales are fp32, ``(rows, 1)`` per row or ``()`` for one per tensor (``tensorwise``).

* Rows (:func:`quantize_rows`): ``q`` row-major, same shape.
* Transposed columns (:func:`quantize_cols_t`): ``t (R, C)`` -> ``t.T`` quantized per column of ``t``,
  row-major ``(C, R_pad)``, ``R`` zero-padded to a multiple of 16 (``torch._scaled_mm``'s rule for
  the reduction of the weight gradient; zero rows add nothing).
* The weight's forward layout ``(q (N, K), s)`` and dgrad layout ``(q (K, N), s)``
  (:func:`weight_forward_layout`, :func:`weight_dgrad_layout`): rowwise per output row and per
  input column; where the Triton kernels run, the forward layout also returns ``W``'s column amax
  ``(1, K)`` from the same read, from which the dgrad layout is written without a reduction of its
  own. Tensorwise: the same scale in both, the codes transposed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..grouped_gemm import quant_seam
from ..quant import quantize_expert_colwise, quantize_rowwise, quantize_tensorwise
from ..quant.formats import Float8Format
from ..quant.kernels.rowwise import col_amax_fits

__all__ = ["ALIGN", "pad_rows", "quantize_rows", "quantize_cols_t", "transposed_padded", "weight_forward_layout",
           "weight_dgrad_layout", "weight_layouts"]

ALIGN = 16

Quantized = tuple[torch.Tensor, torch.Tensor]


def pad_rows(t: torch.Tensor) -> torch.Tensor:
    """``t (R, C)`` with zero rows appended up to a multiple of 16 (``t`` itself when aligned)."""
    pad = -t.shape[0] % ALIGN
    return F.pad(t, (0, 0, 0, pad)) if pad else t


def quantize_rows(t: torch.Tensor, scaling: str, fmt: Float8Format, pow2: bool) -> Quantized:
    """Rows of ``t (R, C)``: ``q (R, C)`` row-major, scale ``(R, 1)`` (rowwise) or ``()`` (tensorwise)."""
    if scaling == "tensorwise":
        return quantize_tensorwise(t, fmt, pow2=pow2)
    q, scale = quantize_rowwise(t, fmt, pow2=pow2)
    return q, scale[:, None]


def transposed_padded(q: torch.Tensor) -> torch.Tensor:
    """FP8 ``q (R, C)`` -> ``q.T`` row-major ``(C, R_pad)``, rows zero-padded to 16 (byte 0 is +0)."""
    return pad_rows(q.view(torch.uint8)).t().contiguous().view(q.dtype)


def quantize_cols_t(t: torch.Tensor, scaling: str, fmt: Float8Format, pow2: bool) -> Quantized:
    """``t (R, C)`` -> ``t.T`` quantized row-major ``(C, R_pad)`` (per column of ``t``), scale ``(C, 1)``
    or ``()``."""
    if scaling == "tensorwise":
        q, scale = quantize_tensorwise(t, fmt, pow2=pow2)
        return transposed_padded(q), scale
    q, scale = quantize_expert_colwise(pad_rows(t)[None], fmt, pow2=pow2, transposed=True)
    return q[0], scale[0][:, None]


def weight_forward_layout(weight: torch.Tensor, scaling: str, fmt: Float8Format, pow2: bool, kernels: bool,
                          with_amax: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(q (N, K), s, col_amax)``: ``W`` per output row (or one scale), and with ``with_amax`` (rowwise,
    ``kernels``: the Triton kernels run on ``W``; ``K <= 16384``) its column amax ``(1, K)`` fp32 from
    the same read, else ``None``."""
    if scaling == "rowwise" and kernels and with_amax and col_amax_fits(weight.shape[1]):
        q, s, amax = quant_seam.quantize_weight_forward_layout(weight[None], fmt, pow2, True)
        return q[0], s[0][:, None], amax
    return (*quantize_rows(weight, scaling, fmt, pow2), None)


def weight_dgrad_layout(weight: torch.Tensor, scaling: str, fmt: Float8Format, pow2: bool, kernels: bool,
                        col_amax: torch.Tensor | None, after: torch.Tensor | None = None) -> Quantized:
    """``(q (K, N), s)``: ``W.T`` per input column (rowwise; scales from ``col_amax`` when given) or
    with ``W``'s one scale (tensorwise). ``after``: a tensor of the backward pass the kernel is
    ordered after (``quant_seam.quantize_weight_dgrad_layout``), or ``None``."""
    if col_amax is not None:
        q, s = quant_seam.quantize_weight_dgrad_layout(weight[None], col_amax, fmt, pow2, True, after)
    elif scaling == "rowwise" and kernels:
        q, s = quant_seam.quantize_weight_layout(weight[None], "rowwise", fmt, pow2, True, True, after)
    else:
        return quantize_cols_t(weight, scaling, fmt, pow2)
    return q[0], s[0][:, None]


def weight_layouts(weight: torch.Tensor, scaling: str, fmt: Float8Format, pow2: bool,
                   kernels: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both layouts of ``W``, ``(q (N, K), s, q (K, N), s)``, the same bytes as the two functions above
    (the dgrad one from the forward's column amax where there is one)."""
    q, s, amax = weight_forward_layout(weight, scaling, fmt, pow2, kernels, with_amax=True)
    return q, s, *weight_dgrad_layout(weight, scaling, fmt, pow2, kernels, amax)
