"""``quantize_after_step``: the FP8 copies of the expert weights made in the optimizer step.

``FP8GroupedExperts`` quantizes its weights (forward and dgrad layout) on a miss of its
``Fp8WeightCache``; without gradient accumulation every step misses, in the forward. A post-step
hook on the optimizer re-quantizes every cache entry whose weight the step changed, so the next
forward and backward find both layouts ready (hits), keyed on the post-step state: any later
in-place write to a weight (``p.add_()``, ``load_state_dict``) bumps its version and misses.
Under ``torch.compile`` the GEMMs read the process-wide compiled cache, which the hook refreshes too.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..grouped_gemm.compiled_cache import compiled_weight_cache
from ..layers.experts import FP8GroupedExperts

__all__ = ["cached_experts", "quantize_after_step", "refresh_weight_caches"]


def cached_experts(model: nn.Module) -> list[FP8GroupedExperts]:
    """The ``FP8GroupedExperts`` of ``model`` (itself included) whose weights go through the cache.

    Raises ``ValueError`` for a module built with ``cache_weights=False`` (there is nothing to fill:
    its forward quantizes the weights), or when ``model`` holds no FP8 experts at all. Modules on
    the ``bf16`` recipe quantize nothing and are left out."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    found = [m for m in model.modules() if isinstance(m, FP8GroupedExperts)]
    if not found:
        raise ValueError("model: expected at least one FP8GroupedExperts module, found none")
    for name, m in model.named_modules():
        if isinstance(m, FP8GroupedExperts) and not m.cache_weights:
            raise ValueError(f"model: {name or type(model).__name__} was built with cache_weights=False; "
                             "its weights are quantized in every forward, there is no cache to fill")
    return [m for m in found if m.recipe.is_fp8]


def refresh_weight_caches(modules: list[FP8GroupedExperts]) -> int:
    """Re-quantize every stale cache entry of ``modules``' weights, in their own caches and in the
    compiled cache (see ``Fp8WeightCache.refresh``), and keep the copies.

    Entries exist once a forward has run (their settings: dtype, format, scaling, backend, come
    from it); before that there are none and this does nothing. Returns how many entries were
    re-quantized."""
    caches = [cache for m in modules for cache in m._caches]
    weights = [w for m in modules for w in m._weights()]
    return sum(cache.refresh() for cache in caches) + compiled_weight_cache().refresh(of=weights)


def quantize_after_step(optimizer: torch.optim.Optimizer, model: nn.Module) -> RemovableHandle:
    """After every ``optimizer.step()``, quantize the updated expert weights of ``model`` into their caches.

    Args:
        optimizer: any ``torch.optim.Optimizer`` updating (some of) ``model``'s expert weights in place.
        model: a module holding ``FP8GroupedExperts`` (``FP8MoE``, a converted Hugging Face model):
            those it holds now (see :func:`cached_experts`).
    Returns:
        The hook's handle (``.remove()`` it to stop).

    The step quantizes what it changed; the next forward/backward then hits both layouts (the same
    bytes as quantizing them there). Weights the step did not touch keep their entries. Memory: the
    cache's, one BF16-sized copy of the weights, held from the step onwards instead of from the
    forward. Under ``torch.compile`` the same holds for the compiled cache.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    modules = cached_experts(model)

    def hook(opt, args, kwargs) -> None:
        refresh_weight_caches(modules)

    return optimizer.register_step_post_hook(hook)
