"""``emulated``: the exact CPU reference (``emulated.py``) behind the backend interface.

Runs anywhere (GPU tensors are copied to the CPU and back, with host syncs): it is the yardstick
the other backends are tested against, and the default on the CPU.
"""

from __future__ import annotations

import torch

from ..emulated import emulated_grouped_mm_2d2d, emulated_grouped_mm_2d3d
from .base import GroupedGemmBackend

__all__ = ["EmulatedBackend"]


class EmulatedBackend(GroupedGemmBackend):
    name = "emulated"
    device_type = "any"
    fused_quant = False

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None

    def mm_2d3d(self, a, scale_a, b, scale_b, offs, out_dtype):
        return emulated_grouped_mm_2d3d(a, scale_a, b, scale_b, offs, out_dtype)

    def mm_2d2d(self, a, scale_a, b, scale_b, offs, out_dtype):
        return emulated_grouped_mm_2d2d(a, scale_a, b, scale_b, offs, out_dtype)
