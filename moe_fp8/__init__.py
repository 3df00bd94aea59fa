"""moe_fp8: Mixture-of-Experts layers whose expert matmuls run in FP8."""

from . import testing
from .grouped_gemm import Fp8WeightCache, fp8_grouped_mm
from .layers import MIN_DENSE_SIZE, ConversionReport, FP8GroupedExperts, FP8Linear, FP8MoE, convert_to_fp8
from .quant.formats import Float8Format, detect_format
from .quant.recipes import Float8Recipe, get_recipe
from . import optim  # after .layers: it fills their weight caches

__all__ = [
    "ConversionReport",
    "FP8GroupedExperts",
    "FP8Linear",
    "FP8MoE",
    "Float8Format",
    "Float8Recipe",
    "Fp8WeightCache",
    "MIN_DENSE_SIZE",
    "convert_to_fp8",
    "detect_format",
    "fp8_grouped_mm",
    "get_recipe",
    "optim",
    "testing",
]
__version__ = "0.1.0"
