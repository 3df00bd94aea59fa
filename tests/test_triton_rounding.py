"""The Triton rounding/scale helpers reproduce torch's cast and the reference scales bit for bit.

Runs the helpers inside a tiny kernel: in the CPU interpreter in CI, on the GPU with `-m gpu`.
"""

import pytest
import torch
import triton
import triton.language as tl

from moe_fp8.quant.formats import E4M3FN, E4M3FNUZ, E5M2
from moe_fp8.quant.reference import amax_to_scales
from moe_fp8.quant.triton_helpers import fp8_constexprs, fp8_round, fp8_scales
from quant_kernel_cases import FNUZ_OK



@triton.jit
def _round_kernel(x_ptr, y_ptr, n, OUT_DTYPE: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
                  FP8_MANT: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_SUB_SCALE: tl.constexpr,
                  FP8_NEG_ZERO: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n)
    r = fp8_round(v, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)
    tl.store(y_ptr + offs, r.to(OUT_DTYPE), mask=offs < n)


@triton.jit
def _scales_kernel(amax_ptr, inv_ptr, scale_ptr, n, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inv, scale = fp8_scales(tl.load(amax_ptr + offs, mask=offs < n), FP8_MAX, POW2)
    tl.store(inv_ptr + offs, inv, mask=offs < n)
    tl.store(scale_ptr + offs, scale, mask=offs < n)


def _values(device):
    g = torch.Generator().manual_seed(0)
    special = [31.9, 31.13, 17.0, 19.0, 126.24, 15.8, -0.0, 0.0, 1e-9, -1e-9, 500.0, -500.0, 1e30, -1e30,
               2.0**-10, 3 * 2.0**-11, 2.0**-9, 2.0**-7, 239.9, 247.9, 248.0, 447.9, 464.0]
    return torch.cat([
        torch.randn(20000, generator=g) * 50,
        torch.randn(5000, generator=g) * 0.01,
        torch.randn(5000, generator=g) * 1e-3,
        torch.arange(-600.0, 600.0, 0.125),  # every tie in the normal range
        torch.tensor(special),
    ]).to(device)


def _check_round(fmt, device):
    x = _values(device)
    y = torch.empty(x.numel(), dtype=fmt.torch_dtype, device=device)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](
        x, y, x.numel(), OUT_DTYPE=fmt.triton_dtype, BLOCK=1024, **fp8_constexprs(fmt)
    )
    ref = x.clamp(-fmt.max, fmt.max).to(fmt.torch_dtype)
    bad = y.view(torch.uint8) != ref.view(torch.uint8)
    assert not bad.any(), f"{int(bad.sum())} mismatches, e.g. {x[bad][:5].tolist()}"


def _check_scales(device):
    g = torch.Generator().manual_seed(1)
    amax = torch.cat([torch.rand(5000, generator=g) * 1000, torch.rand(100, generator=g) * 1e-10,
                      torch.tensor([0.0, 1e-30, 3e38, 1.0, 448.0])]).to(device)
    for fmt in (E4M3FN, E4M3FNUZ):
        for pow2 in (False, True):
            inv = torch.empty_like(amax)
            scale = torch.empty_like(amax)
            _scales_kernel[(triton.cdiv(amax.numel(), 1024),)](amax, inv, scale, amax.numel(), BLOCK=1024,
                                                               FP8_MAX=fmt.max, POW2=pow2)
            ref_inv, ref_scale = amax_to_scales(amax, fmt, pow2)
            assert torch.equal(inv, ref_inv) and torch.equal(scale, ref_scale)


def _formats():
    return [E4M3FN, E5M2] + ([E4M3FNUZ] if FNUZ_OK else [])


@pytest.mark.interpreter
@pytest.mark.parametrize("fmt", _formats(), ids=lambda f: f.name)
def test_round_matches_torch_cast_cpu(fmt):
    _check_round(fmt, "cpu")


@pytest.mark.interpreter
def test_scales_match_reference_cpu():
    _check_scales("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [E4M3FN, E5M2], ids=lambda f: f.name)
def test_round_matches_torch_cast_gpu(fmt):
    _check_round(fmt, "cuda")


@pytest.mark.gpu
def test_scales_match_reference_gpu():
    _check_scales("cuda")
