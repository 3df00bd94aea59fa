"""Launch helpers shared by the kernel families: format constexprs and device facts."""

from __future__ import annotations

import functools

import torch
import triton

from ..formats import Float8Format
from ..triton_helpers import fp8_constexprs

__all__ = ["format_constexprs", "multiprocessor_count", "next_power_of_2"]

# Programs a persistent launch gets per multiprocessor in the CPU interpreter (no device to ask).
_INTERPRETER_SMS = 4


def format_constexprs(fmt: Float8Format) -> dict:
    """``OUT_DTYPE`` plus the rounding constexprs of ``fmt`` (``**`` them into a kernel launch)."""
    return dict(OUT_DTYPE=fmt.triton_dtype, **fp8_constexprs(fmt))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors (CUs on ROCm) of ``device``; a small constant on the CPU."""
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))
