"""Dirty the allocators, so that a kernel leaving memory unwritten shows garbage instead of
passing by luck on freshly zeroed pages."""

from __future__ import annotations

import torch

__all__ = ["dirty_allocator"]


def dirty_allocator(device: torch.device | str = "cpu", *, max_bytes: int = 64 << 20) -> None:
    """Allocate, fill with NaN and free tensors of many sizes on ``device``.

    CPU: blocks up to 1 MiB (the sizes malloc recycles rather than returning to the OS); CUDA:
    the same small blocks and one of ``max_bytes`` (the caching allocator keeps and splits it).
    """
    device = torch.device(device)
    sizes = [1 << p for p in range(6, 21)]  # 64 B .. 1 MiB
    if device.type == "cuda":
        sizes.append(max_bytes)
    held = [torch.full((s // 4,), float("nan"), dtype=torch.float32, device=device) for s in sizes for _ in range(2)]
    del held
