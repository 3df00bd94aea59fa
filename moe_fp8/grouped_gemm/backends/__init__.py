"""Grouped-GEMM backends: ``cuda``, ``cuda_auto``, ``hybrid``, ``rocm``, ``triton``, ``emulated``
(see ``select.py``)."""

from .base import GroupedGemmBackend
from .select import BACKEND_ENV_VAR, BACKENDS, available_backends, get_backend, select_backend

__all__ = ["BACKEND_ENV_VAR", "BACKENDS", "GroupedGemmBackend", "available_backends", "get_backend", "select_backend"]
