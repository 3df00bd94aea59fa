"""Hugging Face transformers integration: ``moe_fp8.hf.convert(model)`` converts a whole model (MoE experts
and dense linears; a model without MoE blocks, its dense linears) in place and attaches a ``ConversionReport``
(see ``layers/hf_convert.py``, docs/conversion.md)."""

from .layers.conversion_report import ConversionReport
from .layers.convert import MIN_DENSE_SIZE
from .layers.hf_convert import MIN_BF16_EXPERT_SIZE, MIN_EXPERT_SIZE, MIN_FP8_WGRAD_SIZE, SUPPORTED_BLOCKS, convert

__all__ = ["ConversionReport", "MIN_BF16_EXPERT_SIZE", "MIN_DENSE_SIZE", "MIN_EXPERT_SIZE", "MIN_FP8_WGRAD_SIZE",
           "SUPPORTED_BLOCKS", "convert"]
