"""``hybrid``: the Triton kernel for the 2D x 3D GEMMs, ``torch._scaled_grouped_mm`` for wgrad (Hopper).

On one H200 (BENCHMARKS.md, "FP8 GEMM alone") our Triton kernel ran the forward/dgrad form
(2D x 3D, rowwise scales, fast accumulation) at 0.99-1.27x the speed of ``_scaled_grouped_mm``
on every MoE shape measured, while its 2D x 2D wgrad form ran at only 0.53-0.69x. This backend
takes the faster of the two for each form: ``mm_2d3d`` from the ``triton`` backend, ``mm_2d2d``
(and so the 16-row wgrad padding, the 1023-group limit and the bf16-only output) from ``cuda``.
It is the automatic choice on sm90 (see ``select.py``); it needs what ``cuda`` needs.
"""

from __future__ import annotations

from .cuda import CudaBackend

__all__ = ["HybridBackend"]


class HybridBackend(CudaBackend):
    name = "hybrid"

    def mm_2d3d(self, a, scale_a, b, scale_b, offs, out_dtype):
        return self._triton.mm_2d3d(a, scale_a, b, scale_b, offs, out_dtype)
