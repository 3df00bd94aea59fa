"""Optimizer-side FP8 weight quantization: the expert weights' FP8 copies made in the optimizer step.

* :func:`quantize_after_step`: a post-step hook for any optimizer that re-quantizes the updated
  weights into the ``FP8GroupedExperts`` caches, so the next forward and backward hit.
* :class:`AdamWQuantize`: ``torch.optim.AdamW`` whose step updates the expert weights with the
  fused ``adamw_quantize`` kernel (update and forward-layout FP8 copy in one pass).
"""

from .adamw import AdamWQuantize
from .adamw_quantize import adamw_hyper, adamw_quantize, adamw_quantize_reference
from .after_step import cached_experts, quantize_after_step, refresh_weight_caches

__all__ = [
    "AdamWQuantize",
    "adamw_hyper",
    "adamw_quantize",
    "adamw_quantize_reference",
    "cached_experts",
    "quantize_after_step",
    "refresh_weight_caches",
]
