"""The inputs of a battery case: random data with per-row magnitude spread, the tail rows filled
as the case says, laid out contiguous or strided.

Rows of ``x``, ``grad_out``, ``a`` and ``b`` are ``N(0, 1) * exp(N(0, 0.5))`` (tokens of different
norms) and rows of ``w`` ``0.1 N(0, 1) * exp(N(0, 0.5))`` per output column (channels of different
norms), so a scale applied along the wrong axis shows; all are multiplied by ``case.magnitude``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cases import GroupedMMCase

__all__ = ["CaseInputs", "make_inputs"]


@dataclass
class CaseInputs:
    """``2d3d``: ``lhs = x (M, K)``, ``rhs = w (E, N, K)``, ``grad = grad_out (M, N)``.
    ``2d2d``: ``lhs = a (M, N)``, ``rhs = b (M, K)``, ``grad = None``. ``offs (E,)`` int32."""

    lhs: torch.Tensor
    rhs: torch.Tensor
    grad: torch.Tensor | None
    offs: torch.Tensor


def _rows(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """fp32 ``N(0, 1)`` of ``shape``, each row (all but the last dim) scaled by ``exp(N(0, 0.5))``."""
    spread = torch.exp(0.5 * torch.randn(*shape[:-1], 1, generator=gen))
    return torch.randn(*shape, generator=gen) * spread


def _activation(case: GroupedMMCase, gen: torch.Generator, cols: int, device) -> torch.Tensor:
    """``(M, cols)`` in the case's dtype: routed rows, then the tail rows as ``case.tail_fill`` says."""
    t = _rows(gen, case.rows, cols) * case.magnitude
    used = case.used_rows
    if case.tail_fill == "nan":
        t[used:] = float("nan")
    elif case.tail_fill == "huge":
        t[used:] = torch.finfo(case.torch_dtype).max / 2
    t = t.to(case.torch_dtype)
    if case.layout == "strided":  # a column slice of a wider buffer: row stride 2 * cols
        wide = torch.full((case.rows, 2 * cols), float("nan"), dtype=case.torch_dtype)
        wide[:, :cols] = t
        return wide.to(device)[:, :cols]
    return t.to(device)


def make_inputs(case: GroupedMMCase, device: torch.device | str = "cpu") -> CaseInputs:
    """The case's tensors on ``device`` (generated on the CPU from ``case.seed``: the same in every run)."""
    gen = torch.Generator().manual_seed(case.seed)
    offs = case.offsets(device)
    if case.form == "2d2d":
        a = _activation(case, gen, case.n, device)
        b = _activation(case, gen, case.k, device)
        return CaseInputs(a, b, None, offs)
    x = _activation(case, gen, case.k, device)
    w = (0.1 * _rows(gen, case.num_groups, case.n, case.k) * case.magnitude).to(case.torch_dtype)
    w = w.transpose(1, 2).contiguous().to(device).transpose(1, 2) if case.layout == "strided" else w.to(device)
    grad = _activation(case, gen, case.n, device)
    return CaseInputs(x, w, grad, offs)
