"""``SwiGLUMLP``: the dense SwiGLU MLP of shared experts, its linears in FP8 where they can be."""

from __future__ import annotations

import torch
from torch import nn

from .fp8_linear import DENSE_RECIPES, FP8Linear
from .shared_input import SharedInput

__all__ = ["SwiGLUMLP"]


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with bias-free ``gate_proj``, ``up_proj``, ``down_proj``
    (the Hugging Face names of shared experts).

    With an FP8 dense recipe (``rowwise``, ``rowwise_gw_hp``, ``tensorwise``) the three linears
    are ``FP8Linear``; other recipes (``bf16``; ``blockwise``, which has no dense kernel yet) keep
    them ``nn.Linear``. Both dims must be multiples of 16 for FP8. The FP8 ``gate_proj`` and
    ``up_proj`` quantize their input once for both (``SharedInput``).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, recipe="rowwise", fmt=None,
                 device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        name = recipe if isinstance(recipe, str) else recipe.name
        if name in DENSE_RECIPES:
            make = lambda i, o: FP8Linear(i, o, recipe=recipe, fmt=fmt, **kw)  # noqa: E731
        else:
            make = lambda i, o: nn.Linear(i, o, **kw)  # noqa: E731
        self.gate_proj = make(hidden_size, intermediate_size)
        self.up_proj = make(hidden_size, intermediate_size)
        self.down_proj = make(intermediate_size, hidden_size)
        if name in DENSE_RECIPES:
            SharedInput([self.gate_proj, self.up_proj], self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
