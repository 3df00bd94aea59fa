"""Balanced routing for benchmarks of untrained MoE models.

An untrained model's MoE inputs share a large common component, so most tokens' router logits
rank the same experts first: at Qwen3-30B-A3B sizes 47 of 128 experts get no token at
initialisation and 96-112 once the benchmark trains, and the expert GEMMs see a few groups of
thousands of rows where a trained model's balanced router gives 128 groups of about 512.

:func:`route_on_random_inputs` hooks each MoE block's router module so that it scores standard-normal
inputs of the hidden states' shape and dtype instead of the hidden states: the load is balanced in
expectation whatever the weights. The experts still compute on the hidden states, the router weight
still gets a gradient, and the unconverted model and a converted copy route alike, since both call
the same router module (transformers 5.x keeps it; a copy made with ``copy.deepcopy`` keeps the
hook). What no longer flows is the hidden states' gradient through the routing weights.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.convert import is_router

__all__ = ["ROUTINGS", "route_on_random_inputs", "routers_on_random_inputs"]

#: the benchmark's routings: the routers score the hidden states, or random inputs
ROUTINGS = ("learned", "balanced")


def _random_inputs(module: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook: the router's first argument replaced by standard-normal values like it."""
    if not args:
        raise TypeError(f"{type(module).__name__}: a router on random inputs needs its hidden states as the first "
                        "positional argument")
    return (torch.randn_like(args[0]),) + tuple(args[1:])


def _routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, router module)`` of each MoE block (a module with ``experts``), routers recognised as
    the dense converter recognises them (``layers.convert.is_router``)."""
    return [(f"{name}.{child_name}" if name else child_name, child)
            for name, block in model.named_modules() if isinstance(getattr(block, "experts", None), nn.Module)
            for child_name, child in block.named_children() if is_router(block, child_name, child)]


def routers_on_random_inputs(model: nn.Module) -> int:
    """How many of ``model``'s routers score random inputs (:func:`route_on_random_inputs`)."""
    return sum(any(h is _random_inputs for h in router._forward_pre_hooks.values()) for _, router in _routers(model))


def route_on_random_inputs(model: nn.Module) -> int:
    """Hooks every MoE router of ``model`` (in place) to score standard-normal inputs; returns how many.

    Raises ``ValueError`` where the model has no MoE router, and where a block routes without calling
    its router module (transformers 4.x blocks replaced by ``FP8HFMoEBlock``), which no hook reaches.
    """
    from ..layers.hf_blocks import FP8HFMoEBlock

    if any(isinstance(m, FP8HFMoEBlock) for m in model.modules()):
        raise ValueError("route_on_random_inputs: FP8HFMoEBlock computes its router logits without calling the "
                         "router module; hook the unconverted model, then convert a copy (transformers >= 5)")
    routers = _routers(model)
    if not routers:
        raise ValueError(f"route_on_random_inputs: no MoE router found in {type(model).__name__}")
    for _, router in routers:
        if not any(h is _random_inputs for h in router._forward_pre_hooks.values()):
            router.register_forward_pre_hook(_random_inputs)
    return len(routers)
