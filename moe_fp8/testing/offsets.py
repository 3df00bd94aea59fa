"""Random token-group offsets (cumulative END offsets) and group sizes."""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["OFFSET_KINDS", "random_offsets", "group_sizes"]

OffsetKind = Literal["balanced", "skewed", "empty", "one"]
OFFSET_KINDS: tuple[str, ...] = ("balanced", "skewed", "empty", "one")


def random_offsets(
    num_rows: int,
    num_groups: int,
    kind: OffsetKind = "balanced",
    *,
    multiple_of: int = 1,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Random cumulative end offsets ``(num_groups,)`` int32 with ``offs[-1] == num_rows``.

    Kinds: ``balanced`` (each row lands in a uniformly random group), ``skewed`` (group
    probabilities ~ U^4, a few hot experts), ``empty`` (about a third of the groups, at least one,
    get no rows), ``one`` (every row in one random group). With ``multiple_of`` > 1, every group
    size is a multiple of it and ``num_rows`` must be one too.
    """
    if kind not in OFFSET_KINDS:
        raise ValueError(f"kind: expected one of {OFFSET_KINDS}, got {kind!r}")
    if num_groups < 1:
        raise ValueError(f"num_groups: expected >= 1, got {num_groups}")
    if num_rows < 0 or num_rows % multiple_of:
        raise ValueError(f"num_rows: expected a non-negative multiple of {multiple_of}, got {num_rows}")
    units = num_rows // multiple_of
    u = torch.rand(num_groups, generator=generator, dtype=torch.float64)
    if kind == "balanced":
        p = torch.ones(num_groups, dtype=torch.float64)
    elif kind == "skewed":
        p = u**4 + 1e-3
    elif kind == "empty":
        p = torch.ones(num_groups, dtype=torch.float64)
        n_empty = max(1, num_groups // 3) if num_groups > 1 else 0
        p[torch.randperm(num_groups, generator=generator)[:n_empty]] = 0
    else:
        p = torch.zeros(num_groups, dtype=torch.float64)
        p[int(torch.randint(num_groups, (1,), generator=generator))] = 1
    if units:
        picks = torch.multinomial(p, units, replacement=True, generator=generator)
        sizes = torch.bincount(picks, minlength=num_groups)
    else:
        sizes = torch.zeros(num_groups, dtype=torch.int64)
    return (torch.cumsum(sizes, 0) * multiple_of).to(torch.int32).to(device)


def group_sizes(offs: torch.Tensor) -> torch.Tensor:
    """Rows per group ``(E,)`` int64 from cumulative end offsets."""
    o = offs.to(torch.int64)
    return torch.diff(o, prepend=o.new_zeros(1))
