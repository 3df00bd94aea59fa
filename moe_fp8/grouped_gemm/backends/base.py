"""What a grouped-GEMM backend provides to the autograd op.

A backend runs the two FP8 GEMM forms on quantized operands and the BF16 forms of the baseline
recipe; the op does the quantization (``quant_seam``) and the bookkeeping. Operand layouts:

* ``mm_2d3d(a (M, K) row-major, scale_a, b (E, N, K) contiguous, scale_b, offs) -> (M, N)``:
  forward (``b`` = weights) and dgrad (``b`` = weights quantized in the ``(E, K_in, N_out)``
  layout). Scales: rowwise ``(M,)`` / ``(E, N)``; tensorwise ``()`` / ``(E,)``; blockwise
  ``(M, ceil(K/128))`` / ``(E, ceil(N/128), ceil(K/128))``.
* ``mm_2d2d(a (rows, N), scale_a, b (rows, K), scale_b, offs) -> (E, N, K)``: wgrad
  ``out[g] = a_g^T b_g``; ``a``/``b`` column-major as ``quant_seam.quantize_wgrad_operands``
  returns them. Scales: rowwise ``(E, N)`` / ``(E, K)``; tensorwise ``()`` / ``()``. When
  ``pads_wgrad_groups`` is set, the op hands over groups padded to 16 rows (``padding.py``)
  and the padded offsets.

Every output row at or past ``offs[-1]`` is zero, so is every empty group's ``mm_2d2d`` output,
and no method syncs with the host, except the
BF16 GEMMs on ROCm where PyTorch's grouped GEMM falls back to a host loop (see
:func:`warn_rocm_bf16_host_loop`).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from ...quant.formats import Float8Format, detect_format
from ..tail import zero_empty_groups, zero_rows_past_end

__all__ = ["GroupedGemmBackend", "warn_rocm_bf16_host_loop"]

_CK_ENV_VAR = "ROCM_ALLOW_GROUP_GEMM_CK"


def warn_rocm_bf16_host_loop(device: torch.device) -> None:
    """Warn (once per process) when ``torch._grouped_mm`` is about to run on a ROCm GPU without
    ``ROCM_ALLOW_GROUP_GEMM_CK`` set: PyTorch then loops over the groups on the host, after copying
    the offsets to the CPU (per its GroupedBlas source; not run here: no AMD GPU)."""
    if torch.version.hip is None or device.type != "cuda":
        return
    if os.environ.get(_CK_ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on", "y"):
        return
    _warn_once()


@functools.lru_cache(maxsize=None)
def _warn_once() -> None:
    warnings.warn(
        "BF16 grouped GEMM on ROCm (the bf16 recipe, or the BF16 wgrad of rowwise_gw_hp / blockwise): "
        f"torch._grouped_mm runs PyTorch's CK kernel only in builds with USE_ROCM_CK_GEMM and with {_CK_ENV_VAR}=1; "
        "otherwise it loops over the groups on the host after copying the offsets to the CPU: a host sync "
        "on every call, and not CUDA-graph capturable.",
        stacklevel=3,
    )


class GroupedGemmBackend:
    """Base class; subclasses set the attributes and implement ``unavailable_reason`` and the GEMMs."""

    name: str = ""
    #: device type of the tensors this backend takes (``"cuda"`` covers ROCm too).
    device_type: str = "cuda"
    #: quantize with the fused Triton kernels (else the pure-torch reference quantizers).
    fused_quant: bool = True
    #: wgrad operands must come with groups padded to 16 rows (``torch._scaled_grouped_mm``).
    pads_wgrad_groups: bool = False
    #: most expert groups one call may have, or ``None``.
    max_groups: int | None = None
    #: output dtypes of the FP8 GEMMs.
    out_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why this backend cannot run on ``device`` here, or ``None`` if it can."""
        raise NotImplementedError

    def fp8_format(self, device: torch.device) -> Float8Format:
        """The E4M3 format this backend's GEMMs take on ``device``."""
        return detect_format(device)

    def mm_2d3d(self, a, scale_a, b, scale_b, offs, out_dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def mm_2d2d(self, a, scale_a, b, scale_b, offs, out_dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def quantizes_w_in_gemm(self, rows: int, groups: int) -> bool:
        """Whether a rowwise 2D x 3D GEMM of ``rows`` rows over ``groups`` experts (the dgrad, or the
        forward where the weight's row amax is known) takes the high-precision weight and quantizes
        it inside the GEMM (:meth:`mm_dgrad_quantize_w`; the forward passes ``w.transpose(1, 2)``)."""
        return False

    def mm_dgrad_quantize_w(self, a, scale_a, w, w_amax, offs, out_dtype: torch.dtype, fmt: Float8Format,
                            pow2: bool) -> torch.Tensor:
        """``a[rows of g] @ w[g]`` for rowwise FP8 ``a (M, N)`` and high-precision ``w (E, N, K)``
        with its amax over N ``w_amax (E, K)``: ``mm_2d3d`` on the dgrad layout those scales give."""
        raise NotImplementedError

    # BF16 GEMMs (the ``bf16`` recipe, BF16 wgrad): torch._grouped_mm on every backend.
    def bf16_mm_2d3d(self, a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, transpose_w: bool) -> torch.Tensor:
        """For ``w (E, N, K)``: ``a[rows of g] @ w[g].T`` (``transpose_w``: forward, ``a (M, K)``
        -> ``(M, N)``) or ``a[rows of g] @ w[g]`` (dgrad, ``a (M, N)`` -> ``(M, K)``).
        """
        warn_rocm_bf16_host_loop(a.device)
        out = torch._grouped_mm(a, w.transpose(-2, -1) if transpose_w else w, offs=offs)
        return zero_rows_past_end(out, offs)

    def bf16_mm_2d2d(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """``out[g] = a_g^T @ b_g`` for row-major ``a (M, N)``, ``b (M, K)``; ``(E, N, K)``.

        Groups of any size, unpadded: with both operands row-major a group starts a whole row
        further on (16-byte aligned for N, K multiples of 8), the call PyTorch's own autograd makes
        for the weight gradient of ``torch._grouped_mm``. (FP8 2D x 2D GEMMs take column-major
        operands, whose groups must start on 16-row boundaries: ``padding.py``.)
        """
        warn_rocm_bf16_host_loop(a.device)
        return zero_empty_groups(torch._grouped_mm(a.contiguous().t(), b.contiguous(), offs=offs), offs)
