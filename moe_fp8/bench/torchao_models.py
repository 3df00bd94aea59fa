"""TorchAO's float8 training applied to a Hugging Face model, as a TorchAO user would apply it.

* dense linears: ``torchao.float8.convert_to_float8_training`` with the recipe's config and TorchAO's
  own size filter for rowwise scaling (``_auto_filter_for_recipe("rowwise", ...)``; ``lm_head``, the
  routers' gates and the ``shared_expert.down_proj`` of every ``Llama4TextMoe`` left out), for
  ``rowwise`` and ``rowwise_with_gw_hp``. ``Llama4TextMoe`` adds the routed output to its shared
  expert's output in place, which the output of TorchAO's ``Float8Linear`` (a view made inside its
  autograd Function) refuses, eagerly and compiled; a TorchAO user would leave that linear out;
* routed experts (``experts=True``): ``quantize_(model, Float8TrainingOpConfig())`` on every module
  holding 3D expert weights, with Hugging Face's ``grouped_mm`` experts implementation (the one that
  calls ``torch._grouped_mm``, which TorchAO's weight subclass overrides).

``available()`` says whether ``torchao`` imports with this torch.
"""

from __future__ import annotations

from torch import nn

RECIPES = ("rowwise", "rowwise_with_gw_hp")
#: substrings of the module names TorchAO leaves in BF16 (the output projection, the routers)
SKIPPED_FQNS = ["lm_head", "mlp.gate", "router"]


def available() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or not importable with this torch
        return False
    return True


def convert(model: nn.Module, recipe: str, *, experts: bool = False) -> nn.Module:
    """Converts ``model`` in place: dense linears with TorchAO's ``recipe``; with ``experts`` its
    routed experts with TorchAO's FP8 grouped GEMM too. Raises what TorchAO raises."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    if recipe not in RECIPES:
        raise ValueError(f"recipe: expected one of {RECIPES}, got {recipe!r}")
    keep = _auto_filter_for_recipe("rowwise", filter_fqns=skipped_fqns(model))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=keep)
    if experts:
        _convert_experts(model)
    return model


def skipped_fqns(model: nn.Module) -> list[str]:
    """``SKIPPED_FQNS`` and the full name of the shared expert's ``down_proj`` in every
    ``Llama4TextMoe`` of ``model`` (whose output that block adds to in place)."""
    return SKIPPED_FQNS + [f"{name}.shared_expert.down_proj" for name, m in model.named_modules()
                           if type(m).__name__ == "Llama4TextMoe"]


def _is_experts(module: nn.Module, _fqn: str = "") -> bool:
    return any(p.ndim == 3 for p in module.parameters(recurse=False))


def _convert_experts(model: nn.Module) -> None:
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    found = [m for m in model.modules() if _is_experts(m)]
    if not found:
        raise ValueError("model: no module with 3D expert weights")
    for module in found:
        config = getattr(module, "config", None)
        if config is not None:
            config._experts_implementation = "grouped_mm"
    quantize_(model, Float8TrainingOpConfig(), filter_fn=_is_experts)
