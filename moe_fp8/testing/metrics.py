"""Signal-to-quantization-noise ratio: the accuracy measure of every numerics test."""

from __future__ import annotations

import torch

__all__ = ["sqnr"]


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
