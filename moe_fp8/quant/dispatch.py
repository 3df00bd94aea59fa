"""The quantizers users call: Triton kernels where they run, the reference everywhere else.

Each function keeps the signature and results of its namesake in :mod:`moe_fp8.quant.reference`
and runs the Triton kernel when the tensor is on a GPU (CUDA or ROCm) or when the Triton
interpreter is on (``TRITON_INTERPRET=1`` set before ``moe_fp8`` is imported); otherwise the
pure-torch reference runs. Both give the same bytes. Block shapes the kernel does not take always
use the reference.
"""

from __future__ import annotations

import torch

from ..kernel_backend import triton_runs_on as _use_triton
from . import reference
from .kernels.blockwise import supported_block

__all__ = [
    "quantize_tensorwise",
    "quantize_rowwise",
    "quantize_expert_tensorwise",
    "quantize_expert_colwise",
    "quantize_group_colwise",
    "quantize_blockwise",
]


def quantize_tensorwise(x: torch.Tensor, fmt=None, *, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the tensor: see :func:`moe_fp8.quant.reference.quantize_tensorwise`."""
    if _use_triton(x):
        from .ops import triton_quantize_tensorwise

        return triton_quantize_tensorwise(x, fmt, pow2)
    return reference.quantize_tensorwise(x, fmt, pow2=pow2)


def quantize_rowwise(x: torch.Tensor, fmt=None, *, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row of ``x (M, K)``: see :func:`moe_fp8.quant.reference.quantize_rowwise`."""
    if _use_triton(x):
        from .ops import triton_quantize_rowwise

        return triton_quantize_rowwise(x, fmt, pow2)
    return reference.quantize_rowwise(x, fmt, pow2=pow2)


def quantize_expert_tensorwise(w: torch.Tensor, fmt=None, *, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per expert of ``w (E, N, K)``: see :func:`moe_fp8.quant.reference.quantize_expert_tensorwise`."""
    if _use_triton(w):
        from .ops import triton_quantize_expert_tensorwise

        return triton_quantize_expert_tensorwise(w, fmt, pow2)
    return reference.quantize_expert_tensorwise(w, fmt, pow2=pow2)


def quantize_expert_colwise(
    w: torch.Tensor, fmt=None, *, pow2: bool = False, transposed: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert column scales of ``w (E, N, K)``: see :func:`moe_fp8.quant.reference.quantize_expert_colwise`."""
    if _use_triton(w):
        from .ops import triton_quantize_expert_colwise

        return triton_quantize_expert_colwise(w, fmt, pow2, transposed)
    return reference.quantize_expert_colwise(w, fmt, pow2=pow2, transposed=transposed)


def quantize_group_colwise(
    x: torch.Tensor, offs: torch.Tensor, fmt=None, *, pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group column scales over jagged rows: see :func:`moe_fp8.quant.reference.quantize_group_colwise`.

    The Triton path does not check the offsets' values (that would sync the device).
    """
    if _use_triton(x):
        from .ops import triton_quantize_group_colwise

        return triton_quantize_group_colwise(x, offs, fmt, pow2)
    return reference.quantize_group_colwise(x, offs, fmt, pow2=pow2)


def quantize_blockwise(
    x: torch.Tensor, fmt=None, *, block: tuple[int, int] = (1, 128), pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block scales over the last two dims: see :func:`moe_fp8.quant.reference.quantize_blockwise`."""
    if _use_triton(x) and len(block) == 2 and supported_block(tuple(block)):
        from .ops import triton_quantize_blockwise

        return triton_quantize_blockwise(x, fmt, block, pow2)
    return reference.quantize_blockwise(x, fmt, block=block, pow2=pow2)
