"""``triton``: our own FP8 grouped GEMM in Triton (``moe_fp8.grouped_gemm.triton_kernel``).

The portable path: any CUDA or ROCm GPU Triton supports, and the CPU under
``TRITON_INTERPRET=1`` (so CI runs the real kernel). Any group sizes, no padding; rowwise,
tensorwise and blockwise scales, with the semantics of ``emulated.py``.
"""

from __future__ import annotations


import torch

from ...kernel_backend import interpreter_enabled
from ..triton_kernel import triton_grouped_mm_2d2d, triton_grouped_mm_2d3d
from .base import GroupedGemmBackend

__all__ = ["TritonBackend"]


class TritonBackend(GroupedGemmBackend):
    name = "triton"
    device_type = "cuda"

    def unavailable_reason(self, device: torch.device) -> str | None:
        if device.type == "cpu":
            return None if interpreter_enabled() else "CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)"
        if device.type != "cuda" or not torch.cuda.is_available():
            return f"Triton runs on CUDA/ROCm GPUs (or the CPU interpreter), not on {device.type}"
        return None

    def mm_2d3d(self, a, scale_a, b, scale_b, offs, out_dtype):
        return triton_grouped_mm_2d3d(a, scale_a, b, scale_b, offs, out_dtype)

    def mm_2d2d(self, a, scale_a, b, scale_b, offs, out_dtype):
        return triton_grouped_mm_2d2d(a, scale_a, b, scale_b, offs, out_dtype)
