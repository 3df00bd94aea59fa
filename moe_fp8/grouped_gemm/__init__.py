"""FP8 grouped GEMM of MoE experts: the differentiable op, its backends, the weight cache and weights
given as their FP8 operands."""

from .backends import BACKEND_ENV_VAR, available_backends, select_backend
from .compiled_cache import compiled_weight_cache
from .emulated import emulated_grouped_mm_2d2d, emulated_grouped_mm_2d3d
from .op import fp8_grouped_mm
from .quantized_weight import QuantizedExpertWeight, WeightOperands
from .weight_cache import Fp8WeightCache

__all__ = [
    "BACKEND_ENV_VAR",
    "Fp8WeightCache",
    "QuantizedExpertWeight",
    "WeightOperands",
    "available_backends",
    "compiled_weight_cache",
    "emulated_grouped_mm_2d2d",
    "emulated_grouped_mm_2d3d",
    "fp8_grouped_mm",
    "select_backend",
]
