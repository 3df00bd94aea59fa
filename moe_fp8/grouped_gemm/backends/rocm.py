"""``rocm``: ``torch._scaled_grouped_mm`` on ROCm (Composable Kernel via FBGEMM-GenAI / MSLK).

Same calling convention as the ``cuda`` backend for the 2D x 3D GEMMs (forward, dgrad): A
row-major, B column-major, rowwise scales ``(M,)`` / ``(E, N)``, tensorwise expanded to them,
blockwise on the Triton kernel. Differences:

* FP8 format by architecture: gfx942 (MI300X/MI325X) takes ``float8_e4m3fnuz`` (max 240),
  gfx950 (MI350X/MI355X) ``float8_e4m3fn`` (max 448) (PyTorch's GroupedBlas, MSLK era). Builds
  with FBGEMM-GenAI instead of MSLK (torch 2.9 / 2.10) carry the kernel for gfx942 only, so on
  gfx950 with those the backend is unavailable and the automatic choice is ``triton``.
* BF16 grouped GEMMs (the ``bf16`` recipe, the BF16 wgrad of ``rowwise_gw_hp`` / ``blockwise``)
  go through ``torch._grouped_mm`` on every backend. On ROCm, per PyTorch's GroupedBlas source
  (not run here), that is a CK kernel only in builds with ``USE_ROCM_CK_GEMM`` and with
  ``ROCM_ALLOW_GROUP_GEMM_CK=1`` set; otherwise a per-group loop over offsets copied to the host:
  a host sync, so those recipes are not CUDA-graph capturable there.
* wgrad (2D x 2D) runs on the Triton kernel: the CK path does not cover that form on every
  PyTorch version (https://github.com/pytorch/pytorch/pull/161366), and Primus-Turbo measured
  CK's FP8 backward ~8x slower than Triton on DeepSeek-V3 shapes. So no group padding is needed.
* ``use_fast_accum`` is ignored by CK; it is passed as False.

Not run on AMD hardware here: the tests fake the platform and check what would be called.
"""

from __future__ import annotations

import os

import torch

from ...quant.formats import E4M3FN, E4M3FNUZ, FORMAT_ENV_VAR, Float8Format, resolve_format
from .cuda import CudaBackend

__all__ = ["RocmBackend", "ROCM_ARCHS"]

#: architectures whose PyTorch builds run the FP8 grouped GEMM, and the E4M3 format each takes.
ROCM_ARCHS: dict[str, Float8Format] = {"gfx942": E4M3FNUZ, "gfx950": E4M3FN}
_BUILD_FLAGS = ("USE_FBGEMM_GENAI", "USE_MSLK")


def _arch(device: torch.device) -> str:
    index = device.index if device.type == "cuda" and device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]


class RocmBackend(CudaBackend):
    name = "rocm"
    pads_wgrad_groups = False
    fast_accum = False

    def unavailable_reason(self, device: torch.device) -> str | None:
        if torch.version.hip is None:
            return "this is not a ROCm build of PyTorch"
        if not hasattr(torch, "_scaled_grouped_mm"):
            return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
        if not torch.cuda.is_available():
            return "no ROCm device is available"
        if device.type != self.device_type:
            return f"it takes GPU tensors, got tensors on {device}"
        arch = _arch(device)
        if arch not in ROCM_ARCHS:
            return f"PyTorch's FP8 grouped GEMM runs on {sorted(ROCM_ARCHS)}; this GPU is {arch}"
        config = torch.__config__.show()
        if not any(flag in config for flag in _BUILD_FLAGS):
            return f"this PyTorch build has neither {' nor '.join(_BUILD_FLAGS)} (no CK grouped GEMM)"
        if arch == "gfx950" and "USE_MSLK" not in config:
            return ("gfx950 needs a PyTorch build with USE_MSLK (torch >= 2.11): the FBGEMM-GenAI grouped GEMM of "
                    "torch 2.9 / 2.10 is built for gfx942 only and takes e4m3fnuz")
        return None

    def fp8_format(self, device: torch.device) -> Float8Format:
        fmt = ROCM_ARCHS[_arch(device)]
        env = os.environ.get(FORMAT_ENV_VAR)
        if env and resolve_format(env) is not fmt:
            raise ValueError(f"the rocm backend on {_arch(device)} takes {fmt.name}, but {FORMAT_ENV_VAR}={env}")
        return fmt

    def mm_2d2d(self, a, scale_a, b, scale_b, offs, out_dtype):
        return self._triton.mm_2d2d(a, scale_a, b, scale_b, offs, out_dtype)
