"""Training recipes: which GEMMs run in FP8 and how their operands are scaled.

| recipe          | forward                                      | dgrad | wgrad                     |
|-----------------|----------------------------------------------|-------|---------------------------|
| ``rowwise``       | FP8, row scales x per-expert column scales   | FP8   | FP8, per-group col scales |
| ``rowwise_gw_hp`` | FP8                                          | FP8   | BF16                      |
| ``tensorwise``    | FP8, one scale per tensor / per expert       | FP8   | FP8                       |
| ``blockwise``     | FP8, 1x128 activations, 128x128 weights      | FP8   | BF16                      |
| ``bf16``          | BF16 baseline through the same API           | BF16  | BF16                      |
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

__all__ = ["Float8Recipe", "RECIPES", "get_recipe"]

Scaling = Literal["rowwise", "tensorwise", "blockwise"]


@dataclass(frozen=True)
class Float8Recipe:
    """How one grouped or dense linear is run.

    Attributes:
        name: the recipe's name (``"rowwise"``, ...).
        scaling: granularity of the FP8 scales, or ``None`` for the BF16 baseline.
        fp8_wgrad: whether the weight-gradient GEMM runs in FP8 (else BF16).
        pow2_scales: round every dequantization scale up to a power of two, so scaling is exact
            in both directions (TorchAO's rowwise convention). On by default in the rowwise and
            tensorwise recipes: FP8 dense linears trained a DeepSeek-V3-sized model to +2-3%
            above BF16's loss with it, +4-7% without (BENCHMARKS.md).
        grad_format: FP8 format name for gradients (e.g. ``"e5m2"``); ``None`` uses the E4M3
            format of the platform for gradients too.
        block_size: block edge of the ``blockwise`` recipe (1 x block for activations,
            block x block for weights).
        fast_accum_grads: dense layers (``FP8Linear``) on CUDA run their dgrad and wgrad GEMMs
            with ``use_fast_accum`` (Hopper's FP8 accumulation without the periodic promotion to
            fp32), as their forward always does; ``False`` promotes in both (TorchAO's choice).
    """

    name: str
    scaling: Scaling | None
    fp8_wgrad: bool
    pow2_scales: bool = False
    grad_format: str | None = None
    block_size: int = 128
    fast_accum_grads: bool = True

    @property
    def is_fp8(self) -> bool:
        return self.scaling is not None

    def replace(self, **changes) -> "Float8Recipe":
        return dataclasses.replace(self, **changes)


RECIPES: dict[str, Float8Recipe] = {
    r.name: r
    for r in (
        Float8Recipe("rowwise", "rowwise", fp8_wgrad=True, pow2_scales=True),
        Float8Recipe("rowwise_gw_hp", "rowwise", fp8_wgrad=False, pow2_scales=True),
        Float8Recipe("tensorwise", "tensorwise", fp8_wgrad=True, pow2_scales=True),
        Float8Recipe("blockwise", "blockwise", fp8_wgrad=False),
        Float8Recipe("bf16", None, fp8_wgrad=False),
    )
}


def get_recipe(recipe: "str | Float8Recipe", *, pow2_scales: bool | None = None) -> Float8Recipe:
    """Look a recipe up by name (or pass one through), optionally overriding ``pow2_scales``."""
    if isinstance(recipe, str):
        if recipe not in RECIPES:
            raise ValueError(f"recipe: expected one of {sorted(RECIPES)}, got {recipe!r}")
        recipe = RECIPES[recipe]
    elif not isinstance(recipe, Float8Recipe):
        raise TypeError(f"recipe: expected str or Float8Recipe, got {type(recipe).__name__}")
    if pow2_scales is not None:
        recipe = recipe.replace(pow2_scales=pow2_scales)
    return recipe
