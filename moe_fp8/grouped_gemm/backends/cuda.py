"""``cuda``: ``torch._scaled_grouped_mm`` (PyTorch's CUTLASS FP8 grouped GEMM, Hopper sm90).

How each recipe maps onto the op (torch 2.9-2.12 accept rowwise scales only):

* rowwise: ``scale_a (M,)``, ``scale_b (E, N)``; B passed column-major (``b.transpose(-2, -1)``
  of the contiguous ``(E, N, K)`` weights); ``use_fast_accum=True``.
* tensorwise: the per-tensor / per-expert scales are expanded to those rowwise vectors (the
  epilogue ``scale_b[col] * (scale_a[row] * acc)`` then computes exactly the tensorwise product).
* blockwise: the op has no blockwise form on these versions: the FP8 GEMMs go to the Triton
  backend (its kernel takes 1x128 / 128x128 block scales); wgrad is BF16 in that recipe anyway.
* wgrad: the 2D x 2D form, ``mat_a = a.t()`` (a column-major ``(rows, N)``) and ``mat_b = b``
  (column-major ``(rows, K)``), scales flattened to ``(E*N,)`` / ``(E*K,)``, groups padded to
  16 rows by the op (``pads_wgrad_groups``).

Output rows at or past ``offs[-1]`` (which the op leaves unwritten) and the wgrad outputs of empty
groups (empty reductions, which the op is not trusted to write) are zeroed on device.
"""

from __future__ import annotations

import torch

from ...quant.formats import E4M3FN, Float8Format, detect_format
from ..tail import zero_empty_groups, zero_rows_past_end
from .base import GroupedGemmBackend
from .triton_backend import TritonBackend

__all__ = ["CudaBackend"]


class CudaBackend(GroupedGemmBackend):
    name = "cuda"
    device_type = "cuda"
    pads_wgrad_groups = True
    max_groups = 1023  # the SM90 kernel raises "Can't process more than 1024 groups"
    out_dtypes = (torch.bfloat16,)
    #: use_fast_accum of the op (Hopper: skip the periodic fp32 promotion of the accumulator).
    fast_accum = True

    def __init__(self) -> None:
        self._triton = TritonBackend()

    def unavailable_reason(self, device: torch.device) -> str | None:
        if not hasattr(torch, "_scaled_grouped_mm"):
            return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
        if torch.version.hip is not None:
            return "this is a ROCm build of PyTorch (use the 'rocm' backend)"
        if not torch.cuda.is_available():
            return "no CUDA device is available"
        if device.type != self.device_type:
            return f"it takes CUDA tensors, got tensors on {device}"
        major, minor = torch.cuda.get_device_capability(device)
        if major != 9:
            return f"torch._scaled_grouped_mm's rowwise FP8 kernel is Hopper-only (sm90); this GPU is sm{major}{minor}"
        return None

    def fp8_format(self, device: torch.device) -> Float8Format:
        fmt = detect_format(device)
        if fmt is not E4M3FN:
            raise ValueError(f"the cuda backend takes e4m3fn operands, but the FP8 format in use is {fmt.name}")
        return fmt

    def _call(self, mat_a, mat_b, scale_a, scale_b, offs, out_dtype):
        return torch._scaled_grouped_mm(
            mat_a, mat_b, scale_a, scale_b, offs=offs, out_dtype=out_dtype, use_fast_accum=self.fast_accum
        )

    def mm_2d3d(self, a, scale_a, b, scale_b, offs, out_dtype):
        if scale_a.dim() == 2:  # blockwise scales
            return self._triton.mm_2d3d(a, scale_a, b, scale_b, offs, out_dtype)
        M, (E, N, _) = a.shape[0], b.shape
        if scale_a.dim() == 0:  # tensorwise -> rowwise vectors
            scale_a = scale_a.expand(M).contiguous()
            scale_b = scale_b[:, None].expand(E, N).contiguous()
        out = self._call(a, b.transpose(-2, -1), scale_a, scale_b, offs, out_dtype)
        return zero_rows_past_end(out, offs)

    def mm_2d2d(self, a, scale_a, b, scale_b, offs, out_dtype):
        E, N, K = offs.numel(), a.shape[1], b.shape[1]
        scale_a = scale_a.expand(E, N) if scale_a.dim() == 0 else scale_a
        scale_b = scale_b.expand(E, K) if scale_b.dim() == 0 else scale_b
        out = self._call(a.t(), b, scale_a.reshape(-1).contiguous(), scale_b.reshape(-1).contiguous(), offs, out_dtype)
        return zero_empty_groups(out, offs)
