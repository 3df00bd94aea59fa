"""Backend registry and automatic choice.

Order of precedence: the ``backend=`` argument, then the ``MOE_FP8_BACKEND`` environment
variable, then the platform of the input tensors:

* CPU tensors: ``emulated``;
* ROCm GPU: ``rocm`` where PyTorch's CK grouped GEMM runs (gfx942 / gfx950), else ``triton``;
* CUDA GPU: ``cuda_auto`` on Hopper (sm90) with ``torch._scaled_grouped_mm`` (per GEMM, Triton
  or ``torch._scaled_grouped_mm`` by the groups' average size: see ``cuda_auto.py``), else
  ``triton``. ``cuda`` (always ``torch._scaled_grouped_mm``) and ``hybrid`` (always Triton for
  forward and dgrad) are there by name.

A backend asked for by name that cannot run here raises ``ValueError`` saying why.
"""

from __future__ import annotations

import os

import torch

from .base import GroupedGemmBackend
from .cuda import CudaBackend
from .cuda_auto import CudaAutoBackend
from .emulated_backend import EmulatedBackend
from .hybrid import HybridBackend
from .rocm import RocmBackend
from .triton_backend import TritonBackend

__all__ = ["BACKEND_ENV_VAR", "BACKENDS", "available_backends", "get_backend", "select_backend"]

BACKEND_ENV_VAR = "MOE_FP8_BACKEND"

BACKENDS: dict[str, GroupedGemmBackend] = {
    b.name: b
    for b in (CudaBackend(), CudaAutoBackend(), HybridBackend(), RocmBackend(), TritonBackend(), EmulatedBackend())
}


def get_backend(name: str) -> GroupedGemmBackend:
    """The backend object called ``name`` (no availability check)."""
    if not isinstance(name, str):
        raise TypeError(f"backend: expected a name (str), got {type(name).__name__}")
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {sorted(BACKENDS)}, got {name!r}")
    return BACKENDS[name]


def available_backends(device: torch.device | str) -> list[str]:
    """Names of the backends that can run on ``device`` here."""
    device = torch.device(device)
    return [name for name, b in BACKENDS.items() if b.unavailable_reason(device) is None]


def select_backend(name: str | None, device: torch.device | str) -> GroupedGemmBackend:
    """The backend to run tensors on ``device`` with (see the module docstring)."""
    device = torch.device(device)
    source = "backend"
    if name is None:
        name = os.environ.get(BACKEND_ENV_VAR) or None
        source = f"environment variable {BACKEND_ENV_VAR}"
    if name is None:
        if device.type == "cpu":
            return BACKENDS["emulated"]
        native = BACKENDS["rocm" if torch.version.hip is not None else "cuda_auto"]
        return native if native.unavailable_reason(device) is None else BACKENDS["triton"]
    try:
        backend = get_backend(name)
    except ValueError as e:
        raise ValueError(f"{source}: {str(e).removeprefix('backend: ')}") from None
    reason = backend.unavailable_reason(device)
    if reason is not None:
        raise ValueError(f"{source}: the {name!r} backend cannot run here: {reason}")
    return backend
