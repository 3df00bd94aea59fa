"""FP8 grouped GEMM of MoE experts: the differentiable op, its backends and the weight cache."""

from .backends import BACKEND_ENV_VAR, available_backends, select_backend
from .emulated import emulated_grouped_mm_2d2d, emulated_grouped_mm_2d3d
from .op import fp8_grouped_mm
from .weight_cache import Fp8WeightCache

__all__ = [
    "BACKEND_ENV_VAR",
    "Fp8WeightCache",
    "available_backends",
    "emulated_grouped_mm_2d2d",
    "emulated_grouped_mm_2d3d",
    "fp8_grouped_mm",
    "select_backend",
]
