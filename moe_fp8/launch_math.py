"""Integer arithmetic of kernel launches (grids, tile sizes) in plain Python.

``triton.cdiv`` and ``triton.next_power_of_2`` are Triton *constexpr functions* since triton 3.5:
every host call unwraps its arguments through Triton's constexpr machinery, ~1.5 µs a call, and
an FP8MoE forward+backward makes dozens of them. These give the same results for the ints the
launches pass (``n >= 1``).
"""

from __future__ import annotations

__all__ = ["cdiv", "next_power_of_2"]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, ``b > 0``."""
    return -(a // -b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n``; 1 for ``n <= 1``."""
    n = int(n)
    return 1 << (n - 1).bit_length() if n > 1 else 1
