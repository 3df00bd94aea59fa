"""``hybrid``: the Triton kernel for the 2D x 3D GEMMs, ``torch._scaled_grouped_mm`` for wgrad (Hopper).

Opt-in (``backend="hybrid"`` or ``MOE_FP8_BACKEND=hybrid``); it needs what ``cuda`` needs. Why it
exists: on one H200 our Triton kernel ran the forward-form GEMM alone (2D x 3D, rowwise scales,
fast accumulation) at 0.99-1.27x the speed of ``_scaled_grouped_mm`` on the MoE shapes of
BENCHMARKS.md (two runs), while its 2D x 2D wgrad form ran at only 0.53-0.72x then (0.86-1.06x
since its row blocks were aligned, 2026-12-01; ``triton`` takes both). This backend takes
``mm_2d3d`` (forward and dgrad) from the ``triton`` backend and ``mm_2d2d`` (with the 16-row wgrad
padding, the 1023-group limit and the bf16-only output) from ``cuda``.

It is not the automatic choice: in the whole layer the gain held only where the experts' groups
are small (DeepSeek-V3 with 32 experts at T=4096: 11.77 against ``cuda``'s 12.05 ms; with 8
experts 9.89 against 9.72; BENCHMARKS.md, grouped GEMM section, "Mixed backends"). The automatic
``cuda_auto`` takes the Triton kernel for those GEMMs only (``cuda_auto.py``).
"""

from __future__ import annotations

from .cuda import CudaBackend

__all__ = ["HybridBackend"]


class HybridBackend(CudaBackend):
    name = "hybrid"

    def mm_2d3d(self, a, scale_a, b, scale_b, offs, out_dtype):
        return self._triton.mm_2d3d(a, scale_a, b, scale_b, offs, out_dtype)

    def quantizes_w_in_gemm(self, rows, groups):
        return self._triton.quantizes_w_in_gemm(rows, groups)

    def mm_dgrad_quantize_w(self, a, scale_a, w, w_amax, offs, out_dtype, fmt, pow2):
        return self._triton.mm_dgrad_quantize_w(a, scale_a, w, w_amax, offs, out_dtype, fmt, pow2)
