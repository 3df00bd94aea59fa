"""Signal-to-quantization-noise ratio, the accuracy measure of every numerics test; the unit in the
last place of a 16-bit float grid, for bounds of single roundings."""

from __future__ import annotations

import torch

__all__ = ["sqnr", "ulp"]


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``20 log10(||ref|| / ||ref - x||)`` in dB (fp64).

    ``inf`` when ``x`` equals ``ref``; NaN anywhere gives NaN (which fails any ``>=`` check).
    """
    if ref.shape != x.shape:
        raise ValueError(f"x: expected shape {tuple(ref.shape)} like ref, got {tuple(x.shape)}")
    ref64, x64 = ref.detach().double().cpu(), x.detach().double().cpu()
    noise = torch.linalg.vector_norm(ref64 - x64)
    signal = torch.linalg.vector_norm(ref64)
    if torch.isnan(noise) or torch.isnan(signal):
        return float("nan")
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(signal / noise))


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype``'s grid (bf16, fp16) at each value of ``x``, fp32 of ``x``'s shape:
    ``eps * 2^(e-1)`` for ``|x|`` in ``[2^(e-1), 2^e)``, the subnormal spacing below the normal
    range. Rounding to ``dtype`` moves a value by at most half of it."""
    info = torch.finfo(dtype)
    _, exp = torch.frexp(x.float())
    spacing = torch.ldexp(torch.full_like(x, info.eps, dtype=torch.float32), exp - 1)
    return spacing.clamp_min(info.smallest_normal * info.eps)
