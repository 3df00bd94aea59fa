"""Bytes a token row puts on the wire in each dispatch mode (what the docs and the benchmark report)."""

from __future__ import annotations

__all__ = ["dispatch_bytes_per_row"]


def dispatch_bytes_per_row(hidden_size: int, dispatch: str, *, top_k: int = 0) -> int:
    """Bytes one token row sends to a rank in the forward dispatch (a token sends one row to each
    rank that owns one of its experts), in training as in inference.

    The row: ``"bf16"`` ``2H``; ``"fp8"`` ``H + 4`` (FP8 bytes + its fp32 scale). With ``top_k``, plus
    the token's routing: ``k`` int32 expert ids and ``k`` fp32 router weights (``8k`` bytes). Each
    row comes back as one BF16 row (``2H``), and the backward sends ``2H`` per row each way (plus
    ``4k`` for the router weights' gradients).
    """
    if dispatch == "bf16":
        row = 2 * hidden_size
    elif dispatch == "fp8":
        row = hidden_size + 4
    else:
        raise ValueError(f"dispatch: expected 'bf16' or 'fp8', got {dispatch!r}")
    return row + 8 * top_k
