"""FP8MoE, its routed experts, FP8Linear and converters (see DESIGN.md)."""

from .conversion_report import ConversionReport, ModuleConversion
from .convert import MIN_DENSE_SIZE, convert_to_fp8
from .experts import FP8GroupedExperts
from .fp8_linear import DENSE_RECIPES, FP8Linear, fp8_linear, fp8_linears_shared_input
from .mlp import SwiGLUMLP
from .moe import FP8MoE
from .shared_input import SharedInput

__all__ = [
    "ConversionReport", "DENSE_RECIPES", "FP8GroupedExperts", "FP8Linear", "FP8MoE", "MIN_DENSE_SIZE",
    "ModuleConversion", "SharedInput", "SwiGLUMLP", "convert_to_fp8", "fp8_linear",
    "fp8_linears_shared_input",
]
