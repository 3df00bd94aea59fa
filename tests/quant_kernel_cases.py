"""Inputs and comparisons shared by the Triton quantization kernel tests.

``hard_input`` draws fresh random data and plants the cases that break quantizers: an all-zero row
and column, huge values, values that land on FP8 subnormals, negative zeros and exact rounding
ties. ``assert_same`` compares FP8 bytes (not values: ``-0`` and ``+0`` differ) and fp32 scales.
"""

from __future__ import annotations

import torch
import triton

from moe_fp8.quant.formats import E4M3FN, E4M3FNUZ

FNUZ_OK = tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 8)
FORMATS = [E4M3FN] + ([E4M3FNUZ] if FNUZ_OK else [])
FORMAT_IDS = [f.name for f in FORMATS]


def hard_input(shape, dtype=torch.bfloat16, *, seed=0, device="cpu") -> torch.Tensor:
    """Random data over many magnitudes with planted edge cases along the last two dims."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    # Per-row magnitudes from 1e-6 to 1e6 so scales span a wide range.
    x = x * torch.pow(10.0, torch.randint(-6, 7, (*shape[:-1], 1), generator=g, dtype=torch.float64))
    big = torch.finfo(dtype).max / 4
    x = x.clamp(-big, big)  # finite in every input dtype (fp16 tops out at 65504)
    flat = x.reshape(-1, shape[-1]) if len(shape) > 1 else x.reshape(1, -1)
    rows, cols = flat.shape
    if rows and cols:
        flat[0] = 0.0  # all-zero row
        if rows > 1:
            flat[1, cols // 2] = big  # huge value: the rest of its row lands on subnormals or underflows
            flat[1, : cols // 2] = torch.randn(cols // 2, generator=g, dtype=torch.float64) * big * 2.0**-15
        if rows > 2:
            flat[2] = 16.0 + torch.arange(cols, dtype=torch.float64) % 16  # odd integers are ties (grid step 2)
            flat[2, -1] = 448.0  # amax 448: inv_scale 1 for e4m3fn
        if rows > 3:
            flat[3] = -flat[3].abs()  # a negative row: underflows give -0
        flat[:, 0] = -0.0  # negative zeros in every row
    return flat.reshape(shape).to(dtype).to(device)


def poison_device_cache(device, nbytes: int = 1 << 30) -> None:
    """Fill cached GPU memory with 0x55 bytes so that unwritten outputs show up as garbage."""
    if torch.device(device).type == "cuda":
        torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(0x55)


def assert_same(got, want, what: str = "") -> None:
    """Same shape, dtype and bytes for FP8 tensors; bitwise-equal values for fp32 scales."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if got.dtype.itemsize == 1:
        bad = got.view(torch.uint8) != want.view(torch.uint8)
        assert not bad.any(), (
            f"{what}: {int(bad.sum())} of {bad.numel()} bytes differ, first at {bad.nonzero()[0].tolist()}: "
            f"{got.float()[bad][:4].tolist()} vs {want.float()[bad][:4].tolist()}"
        )
    else:
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (
            f"{what}: scales differ at {(got != want).nonzero()[:4].tolist()}"
        )
