"""Integer arithmetic of kernel launches (grids, tile sizes) in plain Python.

``triton.cdiv`` and ``triton.next_power_of_2`` are Triton *constexpr functions* since triton 3.5:
every host call unwraps its arguments through Triton's constexpr machinery, ~1.5 µs a call, and
an FP8MoE forward+backward makes dozens of them. These give the same results for the ints the
launches pass (``n >= 1``).

Traced with a dynamic size (a ``torch.SymInt``: a token count under ``torch.compile``), ``cdiv`` stays
symbolic and ``next_power_of_2`` decides by comparisons only, so the graph is guarded on the range of
sizes that give the same power (and on ``n >= cap``), not on the size itself.
"""

from __future__ import annotations

__all__ = ["cdiv", "next_power_of_2"]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, ``b > 0``."""
    return -(a // -b)


def next_power_of_2(n, cap: int | None = None) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``), at most ``cap`` (a power of two) when given."""
    if isinstance(n, int):
        p = 1 << (n - 1).bit_length() if n > 1 else 1
        return p if cap is None else min(p, cap)
    p = 1
    while (cap is None or p < cap) and p < n:
        p *= 2
    return p
