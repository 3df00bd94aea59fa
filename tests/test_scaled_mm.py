"""The dense FP8 GEMM helper: torch's CPU kernel where it takes row scales, else the plain-torch
stand-in; both against an fp64 product of the same FP8 operands."""

from __future__ import annotations

import pytest
import torch

import moe_fp8.layers.scaled_mm as scaled_mm_mod
from moe_fp8.layers.scaled_mm import cpu_kernel_takes_row_scales, scaled_mm
from moe_fp8.quant.formats import E4M3FN
from moe_fp8.quant.reference import quantize_rowwise, quantize_tensorwise


def _operands(rowwise: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a, b_t = torch.randn(48, 64, generator=g), torch.randn(32, 64, generator=g) * 3
    if rowwise:
        (a_q, a_s), (b_q, b_s) = quantize_rowwise(a, E4M3FN), quantize_rowwise(b_t, E4M3FN)
        return a_q, a_s[:, None], b_q, b_s[:, None]
    (a_q, a_s), (b_q, b_s) = quantize_tensorwise(a, E4M3FN), quantize_tensorwise(b_t, E4M3FN)
    return a_q, a_s, b_q, b_s


def _exact(a_q, a_s, b_q_t, b_s_t):
    return (a_q.double() * a_s.double()) @ (b_q_t.double() * b_s_t.double()).t()


@pytest.mark.parametrize("stand_in", [True, False])
@pytest.mark.parametrize("rowwise", [True, False])
def test_cpu_product_within_bf16_rounding(stand_in, rowwise, monkeypatch):
    if not stand_in and rowwise and not cpu_kernel_takes_row_scales():
        pytest.skip("this torch's CPU torch._scaled_mm takes per-tensor scales only")
    if stand_in:
        monkeypatch.setattr(scaled_mm_mod, "cpu_kernel_takes_row_scales", lambda: False)
    ops = _operands(rowwise)
    want = _exact(*ops)
    for out_dtype in (torch.bfloat16, torch.float32):
        got = scaled_mm(*ops, out_dtype)
        assert got.dtype == out_dtype and got.shape == (48, 32)
        assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-6).all()  # one bf16 rounding

