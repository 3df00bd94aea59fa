"""FP8MoE, its routed experts, FP8Linear and converters (see DESIGN.md)."""

from .convert import convert_to_fp8
from .experts import FP8GroupedExperts
from .fp8_linear import DENSE_RECIPES, FP8Linear, fp8_linear
from .mlp import SwiGLUMLP
from .moe import FP8MoE

__all__ = ["DENSE_RECIPES", "FP8GroupedExperts", "FP8Linear", "FP8MoE", "SwiGLUMLP", "convert_to_fp8", "fp8_linear"]
