"""Bytes a routed row puts on the wire in each dispatch mode (what the docs and the benchmark report)."""

from __future__ import annotations

__all__ = ["dispatch_bytes_per_row"]


def dispatch_bytes_per_row(hidden_size: int, dispatch: str, *, training: bool = False) -> int:
    """Bytes one routed row sends to its expert's rank in the forward dispatch.

    ``"bf16"``: ``2H``. ``"fp8"``: ``H + 4`` (FP8 bytes + an fp32 row scale); with ``training`` (the
    expert weights need gradients) ``3H + 4``, as the BF16 row travels too for the weight gradient.
    The combine returns ``2H`` bytes per row in both modes; the backward sends ``2H`` each way.
    """
    if dispatch == "bf16":
        return 2 * hidden_size
    if dispatch == "fp8":
        return 3 * hidden_size + 4 if training else hidden_size + 4
    raise ValueError(f"dispatch: expected 'bf16' or 'fp8', got {dispatch!r}")
