"""``transposed_copy``: a new contiguous tensor holding ``t.transpose(-2, -1)`` (2D or 3D), one Triton launch.

The FP8 weights' dgrad layout in the ``tensorwise`` and ``blockwise`` recipes is the transpose of
their forward layout (one scale per expert, or per 128 x 128 block, so transposing commutes with
quantizing), and the unpadded column-major wgrad operands of ``tensorwise`` are transposes too.
torch's copy kernel moves a transposed 1-byte tensor element by element: 1.38 ms for
DeepSeek-V3's ``8 x 4096 x 7168`` FP8 weights on one H200 (0.34 TB/s; 2026-12-01 profile,
BENCHMARKS.md). Here each program copies one ``BLOCK x BLOCK`` tile: loads along the source's
rows, stores along the destination's, the compiler transposing the tile through shared memory.
Bits move, not values (any element size of 1, 2, 4 or 8 bytes, FP8 as uint8). Without a GPU or
the interpreter, torch's copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_tensor
from ..kernel_backend import device_guard, use_triton
from ..launch import launch
from ..launch_math import cdiv
from .padding_kernels import BITS_DTYPES

__all__ = ["transposed_copy"]

_TILE_BYTES = 128  # a tile row of the 1-byte source, and a tile column of its destination


@triton.jit
def _transpose_kernel(src_ptr, dst_ptr, A, B, stride_sb, stride_sa, stride_db, BLOCK_A: tl.constexpr,
                      BLOCK_B: tl.constexpr):  # fmt: skip
    """``dst[i] (B, A)`` contiguous = ``src[i] (A, B)`` transposed (unit column stride), batch ``i``
    = program id 2; program ids 0 and 1 pick the tile of ``A`` and of ``B``."""
    a = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
    b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    mask = (a < A)[:, None] & (b < B)[None, :]
    batch = tl.program_id(2).to(tl.int64)
    tile = tl.load(src_ptr + batch * stride_sb + a.to(tl.int64)[:, None] * stride_sa + b[None, :], mask=mask)
    tl.store(dst_ptr + batch * stride_db + b.to(tl.int64)[None, :] * A + a[:, None], tile, mask=mask)


def transposed_copy(t: torch.Tensor) -> torch.Tensor:
    """``t.transpose(-2, -1)`` as a new contiguous tensor (never a view of ``t``).

    Args:
        t: ``(A, B)`` or ``(E, A, B)``, any dtype of 1, 2, 4 or 8 bytes; a unit last stride avoids
            a copy of the input first.
    Returns:
        ``(B, A)`` or ``(E, B, A)`` contiguous, ``t.dtype``.
    """
    check_tensor("t", t, ndim=(2, 3))
    if t.element_size() not in BITS_DTYPES or t.is_complex():
        raise TypeError(f"t: expected a real dtype of 1, 2, 4 or 8 bytes, got {t.dtype}")
    if not use_triton(_transpose_kernel, t):
        return t.transpose(-2, -1).clone(memory_format=torch.contiguous_format)
    src = t if t.dim() == 3 else t[None]
    if src.stride(2) != 1 and src.shape[2] > 1:
        src = src.contiguous()
    E, A, B = src.shape
    out = src.new_empty(E, B, A)
    if out.numel():
        bits = BITS_DTYPES[t.element_size()]
        block = max(_TILE_BYTES // t.element_size(), 16)
        with device_guard(t):
            launch(_transpose_kernel)[(cdiv(A, block), cdiv(B, block), E)](
                src.view(bits), out.view(bits), A, B, src.stride(0), src.stride(1), B * A,
                BLOCK_A=block, BLOCK_B=block, num_warps=4,
            )  # fmt: skip
    return out if t.dim() == 3 else out[0]
