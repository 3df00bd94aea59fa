"""FP8 formats, recipes, reference quantizers (the numerics spec) and quantization kernels.

``quantize_*`` run the Triton kernels on GPUs (and under ``TRITON_INTERPRET=1``) and the pure-torch
reference elsewhere, with identical results; the reference stays in :mod:`.reference`, the
kernels' own entry points (``triton_quantize_*``, torch custom ops) in :mod:`.ops`.
"""

from .dispatch import (
    quantize_blockwise,
    quantize_expert_colwise,
    quantize_expert_tensorwise,
    quantize_group_colwise,
    quantize_rowwise,
    quantize_tensorwise,
)
from .formats import E4M3FN, E4M3FNUZ, E5M2, E5M2FNUZ, Float8Format, detect_format, resolve_format
from .ops import (
    triton_group_amax,
    triton_quantize_blockwise,
    triton_quantize_expert_colwise,
    triton_quantize_expert_colwise_dual,
    triton_quantize_expert_colwise_from_amax,
    triton_quantize_expert_rowwise_with_amax,
    triton_quantize_expert_tensorwise,
    triton_quantize_group_colwise,
    triton_quantize_group_colwise_dual,
    triton_quantize_rowwise,
    triton_quantize_rowwise_with_group_amax,
    triton_quantize_tensorwise,
)
from .recipes import RECIPES, Float8Recipe, get_recipe
from .reference import EPS, amax_to_scales, dequantize

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
    "triton_group_amax",
    "triton_quantize_blockwise",
    "triton_quantize_expert_colwise",
    "triton_quantize_expert_colwise_dual",
    "triton_quantize_expert_colwise_from_amax",
    "triton_quantize_expert_rowwise_with_amax",
    "triton_quantize_expert_tensorwise",
    "triton_quantize_group_colwise",
    "triton_quantize_group_colwise_dual",
    "triton_quantize_rowwise",
    "triton_quantize_rowwise_with_group_amax",
    "triton_quantize_tensorwise",
]
