"""``convert_to_fp8``: swap a model's dense ``nn.Linear`` layers for ``FP8Linear`` in place."""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn

from .fp8_linear import FP8Linear, _check_dense_recipe

__all__ = ["convert_to_fp8"]

log = logging.getLogger("moe_fp8")


def convert_to_fp8(
    model: nn.Module,
    recipe="rowwise",
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    *,
    fmt=None,
) -> nn.Module:
    """Replace every plain ``nn.Linear`` of ``model`` (in place) by an ``FP8Linear`` sharing its
    parameters, and return ``model``.

    ``filter_fn(module, fqn)`` chooses which layers to convert (default: all). Layers whose
    ``in_features`` or ``out_features`` is not a multiple of 16 stay in BF16, with the reason logged
    on the ``moe_fp8`` logger at INFO level. A bare ``nn.Linear`` passed as ``model`` is returned
    converted.
    """
    recipe = _check_dense_recipe(recipe)
    if isinstance(model, nn.Linear) and type(model) is nn.Linear:
        return _convert_one(model, "", recipe, filter_fn, fmt) or model
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            fqn = f"{parent_name}.{name}" if parent_name else name
            new = _convert_one(child, fqn, recipe, filter_fn, fmt)
            if new is not None:
                setattr(parent, name, new)
    return model


def _convert_one(module, fqn, recipe, filter_fn, fmt) -> FP8Linear | None:
    if type(module) is not nn.Linear:
        return None
    if filter_fn is not None and not filter_fn(module, fqn):
        return None
    bad = [f"{n}={v}" for n, v in (("in_features", module.in_features), ("out_features", module.out_features)) if v % 16]
    if bad:
        log.info("convert_to_fp8: %s stays in BF16: %s not a multiple of 16", fqn or "<model>", ", ".join(bad))
        return None
    return FP8Linear.from_linear(module, recipe=recipe, fmt=fmt)
