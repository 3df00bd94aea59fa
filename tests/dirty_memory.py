"""Dirty the allocator before a test of an empty or uninitialised case, so it cannot pass by luck.

``dirty_allocator(nbytes, device)`` allocates a few blocks of ``nbytes`` filled with bf16 NaN
(``0x7FC0`` in every 16-bit half: NaN read as bf16, fp16 and fp32) and frees them, so the next
allocation of that size is likely to reuse one of them (the CUDA caching allocator reuses the block;
glibc's malloc, on CPU, mostly does). ``test_empty_reductions.py`` checks that it does for the
sizes the tests use.
"""

from __future__ import annotations

import torch

__all__ = ["dirty_allocator", "nbytes_of"]


def nbytes_of(shape, dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def dirty_allocator(nbytes: int, device="cpu", copies: int = 8) -> None:
    """Fill ``copies`` fresh blocks of ``nbytes`` with NaN, then free them."""
    blocks = [torch.full(((max(nbytes, 2) + 1) // 2,), float("nan"), dtype=torch.bfloat16, device=device)
              for _ in range(copies)]
    del blocks
