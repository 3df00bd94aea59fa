"""Group end offsets the library made itself (a dispatch plan's): valid by construction.

``fp8_grouped_mm`` clamps the offsets it is given to a non-decreasing sequence in ``[0, M]`` on the
device (two kernels per call) so that bad offsets never read out of bounds; offsets registered here
by their maker skip that, and the 16-row padded offsets of the weight gradient's groups
(``padding.padded_offsets``: five kernels) are made once for every GEMM that shares them (an MoE
layer's two). Eager mode only: under ``torch.compile`` nothing is registered or looked up (the
compiler fuses those kernels and shares their results itself). A registration holds while the
tensor lives and is not written in place (its version counter). Inference tensors
(``torch.inference_mode``) have no version counter: they are never registered, and take the checks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["mark_valid", "is_valid", "padded_once"]

_VALID: WeakIdKeyDictionary = WeakIdKeyDictionary()  # offs -> [version, num_rows, padded offsets or None]


def mark_valid(offs: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Register ``offs`` (int32 end offsets, non-decreasing, ``offs[0] >= 0``, ``offs[-1] <=
    num_rows``: the caller guarantees it) and return it."""
    if not torch.compiler.is_compiling() and not offs.is_inference():
        _VALID[offs] = [offs._version, num_rows, None]
    return offs


def _entry(offs: torch.Tensor) -> list | None:
    if torch.compiler.is_compiling() or offs.is_inference():
        return None
    entry = _VALID.get(offs)
    return entry if entry is not None and entry[0] == offs._version else None


def is_valid(offs: torch.Tensor, num_rows: int) -> bool:
    """Whether ``offs`` is registered, unchanged since, and ends within ``num_rows`` rows."""
    entry = _entry(offs)
    return entry is not None and entry[1] <= num_rows


def padded_once(offs: torch.Tensor, pad: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``pad(offs)``, made once per registered ``offs`` (every call for others)."""
    entry = _entry(offs)
    if entry is None:
        return pad(offs)
    if entry[2] is None:
        entry[2] = pad(offs)
    return entry[2]
