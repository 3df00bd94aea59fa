"""How the harness calls a grouped GEMM: a small adapter in the library's conventions.

Conventions (those of ``moe_fp8.fp8_grouped_mm``): ``offs (E,)`` int32 cumulative END offsets
on the inputs' device (no leading 0, ``offs[-1] <= M``, empty groups legal); weights ``(E, N, K)``
in ``nn.Linear`` layout; ``mm_2d3d(x (M, K), w (E, N, K), offs) -> (M, N)``, differentiable in
``x`` and ``w`` when ``differentiable``; ``mm_2d2d(a (M, N), b (M, K), offs) -> (E, N, K)`` with
``out[g] = a_g.T @ b_g``. An adapter translates these to its kernel's own layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from .cases import GroupedMMCase
from .thresholds import floors_for

__all__ = ["GroupedMMAdapter", "Part", "as_adapter"]

Part = Literal["forward", "backward"]
Mm2d3d = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Mm2d2d = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_ALL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class GroupedMMAdapter:
    """A grouped GEMM as the harness sees it.

    Attributes:
        name: how tables name it (``"moe_fp8:triton:rowwise"``, ``"torch._grouped_mm"``, ...).
        recipe: the key of its SQNR floors in ``thresholds.THRESHOLDS``.
        mm_2d3d: the forward form, or ``None`` (its cases are skipped).
        mm_2d2d: the wgrad form, or ``None``.
        differentiable: ``mm_2d3d`` gives ``dx`` and ``dw`` through autograd.
        dtypes: input dtypes it takes; cases of other dtypes are skipped.
        zero_tail: rows at or past ``offs[-1]`` of ``out`` and ``dx`` are zero by its contract
            (checked exactly); ``False`` where they are undefined (not checked).
        unsupported: ``(case, part, device) -> reason or None``: declared limits of the kernel
            (alignment, devices...); a part it refuses is reported as ``skip``, not run.
        spec: the ``get_adapter`` spec that rebuilds it (how a worker process gets a built-in).
    """

    name: str
    recipe: str
    mm_2d3d: Mm2d3d | None = None
    mm_2d2d: Mm2d2d | None = None
    differentiable: bool = True
    dtypes: tuple[torch.dtype, ...] = _ALL_DTYPES
    zero_tail: bool = True
    unsupported: Callable[[GroupedMMCase, Part, torch.device], str | None] | None = field(default=None, repr=False)
    spec: str | None = None

    def __post_init__(self) -> None:
        floors_for(self.recipe)  # a ValueError naming the recipe if it has no floors
        if self.mm_2d3d is None and self.mm_2d2d is None:
            raise ValueError(f"{self.name}: an adapter needs mm_2d3d or mm_2d2d")

    def skip_reason(self, case: GroupedMMCase, part: Part, device: torch.device) -> str | None:
        """Why ``part`` of ``case`` is not run on ``device``, or ``None``."""
        fn = self.mm_2d3d if case.form == "2d3d" else self.mm_2d2d
        if fn is None:  # a differentiable 2d3d GEMM's wgrad is its dw, checked in the 2d3d cases
            return f"no {case.form} form" + (" (its wgrad is checked as dw)" if self.differentiable else "")
        if part == "backward" and not self.differentiable:
            return "not differentiable"
        if case.torch_dtype not in self.dtypes:
            return f"takes {', '.join(str(d).removeprefix('torch.') for d in self.dtypes)} inputs"
        return self.unsupported(case, part, device) if self.unsupported is not None else None


def as_adapter(fn: Mm2d3d | GroupedMMAdapter, recipe: str | None = None, **kw) -> GroupedMMAdapter:
    """``fn`` itself if it is an adapter, else an adapter whose ``mm_2d3d`` is ``fn`` (differentiable,
    all dtypes, zero tail rows; ``kw`` overrides these); ``recipe`` picks the SQNR floors (default ``"bf16"``)."""
    if isinstance(fn, GroupedMMAdapter):
        return fn
    if not callable(fn):
        raise TypeError(f"fn: expected a callable (x, w, offs) -> out or a GroupedMMAdapter, got {type(fn).__name__}")
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return GroupedMMAdapter(name=name, recipe=recipe or "bf16", mm_2d3d=fn, **kw)
