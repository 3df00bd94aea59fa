"""FP8 formats, recipes, reference quantizers (the numerics spec) and quantization kernels."""

from .formats import E4M3FN, E4M3FNUZ, E5M2, E5M2FNUZ, Float8Format, detect_format, resolve_format
from .recipes import RECIPES, Float8Recipe, get_recipe
from .reference import (
    EPS,
    amax_to_scales,
    dequantize,
    quantize_blockwise,
    quantize_expert_colwise,
    quantize_expert_tensorwise,
    quantize_group_colwise,
    quantize_rowwise,
    quantize_tensorwise,
)

__all__ = [
    "E4M3FN",
    "E4M3FNUZ",
    "E5M2",
    "E5M2FNUZ",
    "EPS",
    "Float8Format",
    "Float8Recipe",
    "RECIPES",
    "amax_to_scales",
    "dequantize",
    "detect_format",
    "get_recipe",
    "quantize_blockwise",
    "quantize_expert_colwise",
    "quantize_expert_tensorwise",
    "quantize_group_colwise",
    "quantize_rowwise",
    "quantize_tensorwise",
    "resolve_format",
]
