"""Checks of a layer's parameters against its input, before anything runs (see ``moe_fp8.checks``)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["check_parameters"]


def check_parameters(module: nn.Module, x: torch.Tensor, x_name: str = "x") -> None:
    """Raise ``ValueError`` naming the parameter when one of ``module``'s parameters is on the meta
    device (built with ``device="meta"`` and not materialised) or on another device than ``x``.

    Reads metadata only (no sync).
    """
    for name, p in module.named_parameters():
        if p.is_meta:
            raise ValueError(
                f"{name}: the weights are on the meta device (uninitialised): call to_empty(device=...) "
                "and load the weights (or reset_parameters()) first"
            )
        if p.device != x.device:
            raise ValueError(f"{x_name}: expected device {p.device} (that of parameter {name}), got {x.device}")
