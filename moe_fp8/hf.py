"""Hugging Face transformers integration: ``moe_fp8.hf.convert(model)`` (see ``layers/hf_convert.py``)."""

from .layers.hf_convert import SUPPORTED_BLOCKS, convert

__all__ = ["SUPPORTED_BLOCKS", "convert"]
