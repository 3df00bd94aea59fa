"""FP8MoE, FP8Linear and converters (see DESIGN.md)."""

from .convert import convert_to_fp8
from .fp8_linear import DENSE_RECIPES, FP8Linear, fp8_linear

__all__ = ["DENSE_RECIPES", "FP8Linear", "convert_to_fp8", "fp8_linear"]
