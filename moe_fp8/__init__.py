"""moe_fp8: Mixture-of-Experts layers whose expert matmuls run in FP8."""

from . import testing
from .quant.formats import Float8Format, detect_format
from .quant.recipes import Float8Recipe, get_recipe

__all__ = ["Float8Format", "Float8Recipe", "detect_format", "get_recipe", "testing"]
__version__ = "0.1.0"
