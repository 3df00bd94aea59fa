"""SQNR floors (dB, against the fp64 reference) of each recipe's three GEMMs.

The battery's data are Gaussian rows of spread norms (``inputs.py``); on such data e4m3 rowwise
scaling gives ~28.5 dB and BF16 rounding ~50 dB, so the floors leave a few dB of margin for the
small, skewed groups of the battery and for other kernels' accumulation orders, while a
dropped group, a wrong scale or a leaked garbage row falls far below them.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Floors", "THRESHOLDS", "floors_for"]


class Floors(NamedTuple):
    """SQNR floors in dB: ``out`` (forward), ``dx`` (dgrad), ``dw`` (wgrad, and the 2d2d form)."""

    out: float
    dx: float
    dw: float


THRESHOLDS: dict[str, Floors] = {
    "bf16": Floors(40, 40, 40),
    "rowwise": Floors(25, 25, 23),
    "rowwise_gw_hp": Floors(25, 25, 40),
    "tensorwise": Floors(24, 24, 23),
    "blockwise": Floors(25, 25, 40),
    "mxfp8": Floors(25, 23, 22),
}


def floors_for(recipe: str) -> Floors:
    """The floors of ``recipe`` (a key of :data:`THRESHOLDS`)."""
    if recipe not in THRESHOLDS:
        raise ValueError(f"recipe: expected one of {sorted(THRESHOLDS)}, got {recipe!r}")
    return THRESHOLDS[recipe]
