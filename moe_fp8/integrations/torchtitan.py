"""torchtitan 0.3: FP8 expert GEMMs (and, on request, FP8 dense linears) through torchtitan's config seams.

torchtitan computes its MoE experts in ``GroupedExperts._grouped_mm(A, B_t, offs)``: ``A (R, K)`` bf16
tokens permuted by expert, ``B_t (E, K, N)`` bf16, the transposed view of weights kept in ``nn.Linear``
layout ``(E, N, K)`` (``w1``/``w3 (E, F, D)``, ``w2 (E, D, F)``), ``offs (E,)`` int32 cumulative END
offsets. The experts built here keep torchtitan's parameters, state-dict keys, initialisation,
dispatch and combine, and run that seam through :func:`moe_fp8.fp8_grouped_mm` with
``w = B_t.transpose(-2, -1)``: the weights' own ``(E, N, K)`` view, never a copy. Ragged groups and
empty experts need no padding (no dispatcher swap); rows at or past ``offs[-1]`` (left by a padding
dispatcher) come out as zeros, rows the combine never reads.

Dense layers: torchtitan builds every projection from a ``Linear.Config``; :func:`fp8_linears`
replaces those (exactly ``Linear.Config``, both dims multiples of 16) with a ``moe_fp8.FP8Linear``
that is also a torchtitan ``Module``: same parameters, same ``param_init``.

Ways in (no torchtitan file is edited):

* command line: ``--override.imports 'moe_fp8.integrations.torchtitan.fp8_experts={"recipe": "rowwise"}'``
  (and ``moe_fp8.integrations.torchtitan.fp8_linears`` for the dense projections of
  :data:`DENSE_FQNS`); torchtitan imports this module, whose ``@override`` factories then rewrite the
  config tree before the model is built;
* Python: ``model_registry(flavor, converters=[MoEFP8Converter.Config(recipe="rowwise")])``.

Importing this module never fails; without torchtitan (or with a torch it does not support), using
it raises ``ImportError`` naming the ``moe_fp8[torchtitan]`` extra.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Any

import torch

from ..grouped_gemm import fp8_grouped_mm
from ..grouped_gemm.backends import BACKENDS
from ..layers.fp8_linear import DENSE_RECIPES, FP8Linear
from ..quant.recipes import RECIPES

try:
    from torch.distributed.tensor import DTensor
    from torchtitan.components.quantization import QuantizationConverter
    from torchtitan.config.override import derive, override
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.protocols.module import Module
except ImportError as exc:  # torchtitan absent, or a torch it does not support (it needs >= 2.13)
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None

__all__ = ["DENSE_FQNS", "MoEFP8Converter", "fp8_experts", "fp8_linears"]

#: FQN globs (``fnmatch``; ``*`` crosses dots) of the dense projections :func:`fp8_linears` takes:
#: attention, dense FFNs and shared experts. Router gates (scored in fp32) and the LM head stay as
#: they are. The leading ``*`` matches the trainer's prefix (``model_spec.model.``) as well as none.
DENSE_FQNS: tuple[str, ...] = (
    "*layers.*.attention.*", "*layers.*.feed_forward.*", "*layers.*.moe.shared_experts.*",
)

_ALIGN = 16


def _require_torchtitan() -> None:
    if _IMPORT_ERROR is not None:
        raise ImportError(
            "moe_fp8.integrations.torchtitan needs torchtitan 0.3 and torch >= 2.13: install the extra with "
            f"`pip install 'moe_fp8[torchtitan]'` (importing torchtitan failed: {_IMPORT_ERROR})"
        ) from _IMPORT_ERROR


def _check_recipe(recipe: Any, allowed: tuple[str, ...], name: str) -> str:
    if not isinstance(recipe, str):
        raise TypeError(f"{name}: expected a recipe name (str), got {type(recipe).__name__}")
    if recipe not in allowed:
        raise ValueError(f"{name}: expected one of {list(allowed)}, got {recipe!r}")
    return recipe


def _check_backend(backend: Any) -> str | None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend: expected None or one of {sorted(BACKENDS)}, got {backend!r}")
    return backend


@functools.cache
def _fp8_experts_class(base: type) -> type:
    """The subclass of torchtitan experts module ``base`` whose ``_grouped_mm`` is ``fp8_grouped_mm``.

    Its ``Config`` is ``base.Config`` plus ``recipe`` and ``backend``. One class per ``base`` (cached),
    so ``GroupedExperts`` and its subclasses that call the same seam (gpt-oss) each keep their forward.
    """

    class FP8Experts(base):
        _moe_fp8_base = base

        @dataclass(kw_only=True, slots=True)
        class Config(base.Config):
            recipe: str = "rowwise"
            """moe_fp8 recipe of the expert GEMMs: rowwise, rowwise_gw_hp, tensorwise, blockwise or bf16."""
            backend: str | None = None
            """moe_fp8 grouped-GEMM backend; None: ``MOE_FP8_BACKEND``, else the platform's best."""

        def __init__(self, config: FP8Experts.Config):
            super().__init__(config)
            self.fp8_recipe = _check_recipe(config.recipe, tuple(RECIPES), "recipe")
            self.fp8_backend = _check_backend(config.backend)

        def _grouped_mm(self, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
            """``A (R, K) @ B_t[g] (K, N)`` per group of ``offs`` -> ``(R, N)`` bf16, through ``fp8_grouped_mm``
            on ``B_t.transpose(-2, -1)`` (the ``(E, N, K)`` weights themselves: a view, no copy)."""
            return fp8_grouped_mm(A, B_t.transpose(-2, -1), offs, recipe=self.fp8_recipe, backend=self.fp8_backend)

        def extra_repr(self) -> str:
            return f"recipe={self.fp8_recipe}, backend={self.fp8_backend}"

    FP8Experts.__name__ = FP8Experts.__qualname__ = f"MoEFP8{base.__name__}"
    FP8Experts.Config.__qualname__ = f"MoEFP8{base.__name__}.Config"
    return FP8Experts


@functools.cache
def _fp8_dense_class() -> type:
    """``moe_fp8.FP8Linear`` made a torchtitan ``Module`` whose ``Config`` is ``Linear.Config`` plus ``recipe``."""

    class TorchtitanFP8Linear(FP8Linear, Module):
        """``FP8Linear`` built from a torchtitan config: ``weight (out_features, in_features)`` as ``Linear``."""

        @dataclass(kw_only=True, slots=True)
        class Config(Linear.Config):
            recipe: str = "rowwise"
            """moe_fp8 dense recipe: rowwise, rowwise_gw_hp, tensorwise or bf16."""

        def __init__(self, config: TorchtitanFP8Linear.Config):
            FP8Linear.__init__(self, config.in_features, config.out_features, bias=config.bias, recipe=config.recipe)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if isinstance(self.weight, DTensor):
                raise NotImplementedError(
                    "TorchtitanFP8Linear: the weight is a DTensor in forward (tensor parallelism); FP8 dense "
                    "linears support data parallelism (FSDP2) only: leave tensor-parallel models' linears in BF16"
                )
            return FP8Linear.forward(self, x)

    TorchtitanFP8Linear.__qualname__ = "TorchtitanFP8Linear"
    TorchtitanFP8Linear.Config.__qualname__ = "TorchtitanFP8Linear.Config"
    return TorchtitanFP8Linear


def fp8_experts(cfg: Any, *, recipe: str = "rowwise", backend: str | None = None) -> Any:
    """Override factory: a torchtitan ``GroupedExperts.Config`` (or a subclass's) -> the same experts
    running their grouped GEMMs through ``moe_fp8.fp8_grouped_mm``.

    Args:
        cfg: the matched ``GroupedExperts.Config``; its fields are copied.
        recipe: ``"rowwise"`` (default), ``"rowwise_gw_hp"``, ``"tensorwise"``, ``"blockwise"`` or
            ``"bf16"`` (``torch._grouped_mm`` through the same path: the baseline).
        backend: a ``moe_fp8`` grouped-GEMM backend name, or None for the platform's best.
    Returns:
        A config that builds the FP8 experts: same parameters ``w1_EFD``, ``w2_EDF``, ``w3_EFD``.
    """
    _require_torchtitan()
    if not isinstance(cfg, GroupedExperts.Config):
        raise TypeError(f"cfg: expected a torchtitan GroupedExperts.Config, got {type(cfg).__name__}")
    recipe, backend = _check_recipe(recipe, tuple(RECIPES), "recipe"), _check_backend(backend)
    owner = type(cfg)._owner
    base = getattr(owner, "_moe_fp8_base", owner)  # a converted config gets new settings, not a second layer
    return derive(cfg, _fp8_experts_class(base).Config, recipe=recipe, backend=backend)


def fp8_linears(cfg: Any, *, recipe: str = "rowwise") -> Any:
    """Override factory: a torchtitan ``Linear.Config`` -> one that builds a ``moe_fp8.FP8Linear``.

    A linear with ``in_features`` or ``out_features`` not a multiple of 16 is returned unchanged.

    Args:
        cfg: the matched ``Linear.Config`` (exactly that class; subclasses with their own forward
            are never matched).
        recipe: ``"rowwise"`` (default), ``"rowwise_gw_hp"``, ``"tensorwise"`` or ``"bf16"``.
    """
    _require_torchtitan()
    if not isinstance(cfg, Linear.Config):
        raise TypeError(f"cfg: expected a torchtitan Linear.Config, got {type(cfg).__name__}")
    recipe = _check_recipe(recipe, (*DENSE_RECIPES, "bf16"), "recipe")
    if cfg.in_features % _ALIGN or cfg.out_features % _ALIGN:
        return cfg
    return derive(cfg, _fp8_dense_class().Config, recipe=recipe)


def _convert(model_config: Any, recipe: str, backend: str | None, linear_recipe: str | None,
             linear_fqns: list[str]) -> Any:
    """Replace every ``GroupedExperts.Config`` (and, with ``linear_recipe``, every ``Linear.Config`` whose
    FQN matches ``linear_fqns``) in the config tree rooted at ``model_config``, in place."""
    nodes = [(c, p, a, fp8_experts(c, recipe=recipe, backend=backend))
             for _, c, p, a in model_config.traverse(GroupedExperts.Config)]
    if linear_recipe is not None:
        nodes += [(c, p, a, fp8_linears(c, recipe=linear_recipe))
                  for fqn, c, p, a in model_config.traverse(Linear.Config)
                  if type(c) is Linear.Config and any(fnmatch(fqn, g) for g in linear_fqns)]
    for old, parent, attr, new in nodes:
        if parent is None:
            raise ValueError(f"model_config: the root config is a {type(old).__name__}; expected a model config")
        if isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    return model_config


@functools.cache
def _converter_class() -> type:
    _require_torchtitan()

    class MoEFP8Converter(QuantizationConverter):
        """torchtitan model converter: MoE experts (and optionally dense linears) to moe_fp8 FP8 GEMMs."""

        @dataclass(kw_only=True, slots=True)
        class Config(QuantizationConverter.Config):
            recipe: str = "rowwise"
            """Expert recipe: rowwise, rowwise_gw_hp, tensorwise, blockwise or bf16."""
            backend: str | None = None
            """moe_fp8 grouped-GEMM backend; None for the platform's best."""
            linear_recipe: str | None = None
            """Dense recipe (rowwise, rowwise_gw_hp, tensorwise, bf16); None leaves dense linears as they are."""
            linear_fqns: list[str] = field(default_factory=lambda: list(DENSE_FQNS))
            """FQN globs of the dense linears ``linear_recipe`` applies to."""

        def __init__(self, config: MoEFP8Converter.Config):
            _check_recipe(config.recipe, tuple(RECIPES), "recipe")
            _check_backend(config.backend)
            if config.linear_recipe is not None:
                _check_recipe(config.linear_recipe, (*DENSE_RECIPES, "bf16"), "linear_recipe")
            self.config = config

        def convert(self, model_config: Any) -> Any:
            c = self.config
            return _convert(model_config, c.recipe, c.backend, c.linear_recipe, c.linear_fqns)

    MoEFP8Converter.__qualname__ = "MoEFP8Converter"
    MoEFP8Converter.Config.__qualname__ = "MoEFP8Converter.Config"
    return MoEFP8Converter


def __getattr__(name: str) -> Any:
    if name == "MoEFP8Converter":
        return _converter_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if _IMPORT_ERROR is None:
    override(target=GroupedExperts.Config, description="moe_fp8 FP8 grouped GEMMs for the MoE experts")(fp8_experts)
    override(target=Linear.Config, fqns=list(DENSE_FQNS), exact=True,
             description="moe_fp8 FP8Linear for the dense projections")(fp8_linears)
