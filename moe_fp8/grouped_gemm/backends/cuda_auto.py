"""``cuda_auto``: the automatic choice on Hopper. Per 2D x 3D GEMM (forward, dgrad), our Triton
kernel when the experts' groups are small on average, ``torch._scaled_grouped_mm`` otherwise; the
2D x 2D wgrad always on ``torch._scaled_grouped_mm``.

The rule reads static shapes only (rows ``M`` of the activations, groups ``E = offs.numel()``), so
it needs no host sync and a given layer shape always takes the same kernels: Triton when
``M <= CudaAutoBackend.triton_max_rows_per_group * E``.

Why 1536 rows: whole-layer A/B on one H200 (a one-off script, FP8MoE
``rowwise`` forward+backward, 5-9 alternated rounds, 2026-11-30), the Triton 2D x 3D GEMM against
``cuda``'s, by average rows per group:

* 512 (Llama 4, E = 16, top-1, T = 8192): 15.21 against 16.56 ms, 9% faster;
* 1024 (DeepSeek-V3, E = 32, T = 4096): 2-4% faster in four runs;
* 2048 (DeepSeek-V3, E = 32, T = 8192): 2.6% slower; 4096-16384 (E = 8; E = 32 at T = 16384):
  from 3.6% slower to 0.7% faster.

The threshold sits between the last size where Triton won every run and the first where it did
not. Where a dgrad runs on Triton, an uncached weight's is quantized inside the GEMM by Triton's
own rule (``TritonBackend.quantize_w_max_rows_per_group``). ``cuda`` (always
``torch._scaled_grouped_mm``) and ``hybrid`` (always Triton for 2D x 3D) stay available by name.
"""

from __future__ import annotations

from .cuda import CudaBackend

__all__ = ["CudaAutoBackend"]


class CudaAutoBackend(CudaBackend):
    name = "cuda_auto"
    #: 2D x 3D GEMMs whose groups average at most this many rows run on the Triton kernel.
    triton_max_rows_per_group: int = 1536

    def triton_2d3d(self, rows: int, groups: int) -> bool:
        """Whether a 2D x 3D GEMM of ``rows`` activation rows over ``groups`` experts runs on Triton."""
        return rows <= self.triton_max_rows_per_group * groups

    def mm_2d3d(self, a, scale_a, b, scale_b, offs, out_dtype):
        if self.triton_2d3d(a.shape[0], offs.numel()):
            return self._triton.mm_2d3d(a, scale_a, b, scale_b, offs, out_dtype)
        return super().mm_2d3d(a, scale_a, b, scale_b, offs, out_dtype)

    def quantizes_w_in_gemm(self, rows, groups):  # where this dgrad runs on Triton, and by Triton's own rule
        return self.triton_2d3d(rows, groups) and self._triton.quantizes_w_in_gemm(rows, groups)

    def mm_dgrad_quantize_w(self, a, scale_a, w, w_amax, offs, out_dtype, fmt, pow2):
        return self._triton.mm_dgrad_quantize_w(a, scale_a, w, w_amax, offs, out_dtype, fmt, pow2)
