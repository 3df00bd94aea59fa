"""``triton``: our own FP8 grouped GEMM in Triton (``moe_fp8.grouped_gemm.triton_kernel``).

The portable path: any CUDA or ROCm GPU Triton supports, and the CPU under
``TRITON_INTERPRET=1`` (so CI runs the real kernel). The kernels take any group sizes; rowwise,
tensorwise and blockwise scales, with the semantics of ``emulated.py``.

The op still hands the wgrad GEMM groups padded to 16 rows (``pads_wgrad_groups``): a group that
starts or ends inside a K tile costs the 2D x 2D kernel masked edge slices. A/B on one H200
(``benchmarks/ab_triton_wgrad_padding.py``: forward+backward of ``fp8_grouped_mm``, unaligned groups,
7 alternated rounds, 2026-11-30):
padded 6.35 against 6.87 ms on DeepSeek-V3 gate_up E = 8, 3.62 / 3.86 ms on its down projection,
8.91 / 10.07 ms on gate_up E = 32 and 3.27 / 3.68 ms on Qwen3 E = 128.
"""

from __future__ import annotations


import torch

from ...kernel_backend import interpreter_enabled
from ..triton_kernel import triton_grouped_mm_2d2d, triton_grouped_mm_2d3d, triton_grouped_mm_dgrad_quantize_w
from .base import GroupedGemmBackend

__all__ = ["TritonBackend"]


class TritonBackend(GroupedGemmBackend):
    name = "triton"
    device_type = "cuda"
    pads_wgrad_groups = True
    #: An uncached weight's dgrad (and its forward, where an amax-only weight cache holds its row
    #: amax) quantizes the weight inside the GEMM when the groups average at most this many rows (a
    #: static rule: no host sync). The GEMM converts each weight tile once per 256-row tile of its
    #: expert, where the layout kernel reads and writes every weight once. One H100
    #: (``benchmarks/results/dgrad_quantize_w_h100.md``, 65536 rows): 512 rows per
    #: group (Qwen3-30B-A3B) 1.31-1.38x faster than layout + GEMM, 2048 (DeepSeek-V3, 32 experts)
    #: 0.78-0.90x; from the conversion's cost per row tile the two meet near 1000 rows. The forward
    #: (``forward_quantize_w_h100.md``): 1.21-1.45x at Qwen3-30B-A3B's sizes, 0.65-0.82x at DeepSeek-V3's.
    quantize_w_max_rows_per_group: int = 768

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

    def quantizes_w_in_gemm(self, rows, groups):
        return rows <= self.quantize_w_max_rows_per_group * groups

    def mm_dgrad_quantize_w(self, a, scale_a, w, w_amax, offs, out_dtype, fmt, pow2):
        return triton_grouped_mm_dgrad_quantize_w(a, scale_a, w, w_amax, offs, out_dtype, fmt=fmt, pow2=pow2)
