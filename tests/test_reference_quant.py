"""Hand-computed and property tests of the reference quantizers (the numerics spec)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_fp8.quant.formats import E4M3FN, E4M3FNUZ, E5M2
from moe_fp8.quant.reference import (
    EPS,
    amax_to_scales,
    cast_to_fp8,
    dequantize,
    expert_amax,
    quantize_blockwise,
    quantize_expert_colwise,
    quantize_expert_tensorwise,
    quantize_group_colwise,
    quantize_rowwise,
    quantize_tensorwise,
)
from moe_fp8.testing import random_offsets, sqnr


def f32(*v):
    return torch.tensor(v, dtype=torch.float32)


def test_rowwise_hand_computed():
    x = torch.tensor([[1.0, -2.0, 4.0, 0.5], [0.0, 0.0, 0.0, 0.0], [-3.0, 1.5, 0.75, 6.0]])
    q, scale = quantize_rowwise(x, E4M3FN)
    # Row 0: amax 4 -> inv 448/4 = 112 -> q = x * 112, all on the e4m3fn grid.
    assert q[0].float().tolist() == [112.0, -224.0, 448.0, 56.0]
    assert scale[0] == torch.tensor(1.0) / torch.tensor(112.0)
    # All-zero row: amax clamped to EPS, zeros out, finite scale.
    assert q[1].float().tolist() == [0.0] * 4
    assert scale[1] == torch.tensor(1.0) / (torch.tensor(448.0) / torch.tensor(EPS))
    # Row 2: amax 6 -> inv 74.666..; -3*inv = -224, 1.5*inv = 112, 0.75*inv = 56, 6*inv = 448.
    assert q[2].float().tolist() == [-224.0, 112.0, 56.0, 448.0]
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (3,)


def test_rowwise_pow2_hand_computed():
    x = torch.tensor([[1.0, -2.0, 4.0, 0.5]])
    q, scale = quantize_rowwise(x, E4M3FN, pow2=True)
    # inv 112 floors to 64: the scale is exactly 1/64 and values stay below max.
    assert q[0].float().tolist() == [64.0, -128.0, 256.0, 32.0]
    assert scale.item() == 1 / 64


def test_rowwise_fnuz_uses_240():
    x = torch.tensor([[1.0, -2.0, 4.0, 0.5]])
    q, scale = quantize_rowwise(x, E4M3FNUZ)
    assert q.dtype == torch.float8_e4m3fnuz
    assert q[0].float().tolist() == [60.0, -120.0, 240.0, 30.0]
    assert scale.item() == pytest.approx(4 / 240, rel=1e-7)


@pytest.mark.parametrize("fmt", [E4M3FN, E4M3FNUZ, E5M2], ids=lambda f: f.name)
def test_cast_saturates_never_nan(fmt):
    x = f32(1e6, -1e6, fmt.max * 1.1, -fmt.max * 1.01, float("inf"), 256.0)
    q = cast_to_fp8(x, torch.tensor(1.0), fmt).float()
    assert not torch.isnan(q).any()
    assert q.tolist() == [fmt.max, -fmt.max, fmt.max, -fmt.max, fmt.max, min(256.0, fmt.max)]


def test_cast_subnormals_and_ties():
    one = torch.tensor(1.0)
    q = cast_to_fp8(f32(2.0**-9, 2.0**-10, 3 * 2.0**-10, -(2.0**-9), 2.0**-11), one, E4M3FN)
    # Smallest e4m3fn subnormal 2^-9 is kept; 2^-10 is a tie -> even (0); 1.5 quanta -> 2 quanta.
    assert q.float().tolist() == [2.0**-9, 0.0, 2.0**-8, -(2.0**-9), 0.0]
    q = cast_to_fp8(f32(2.0**-10, 2.0**-11), one, E4M3FNUZ)  # fnuz has one more subnormal binade
    assert q.float().tolist() == [2.0**-10, 0.0]
    # Normal-range ties to even: 17 lies between 16 and 18 -> 16; 19 -> 20.
    assert cast_to_fp8(f32(17.0, 19.0, 31.9), one, E4M3FN).float().tolist() == [16.0, 20.0, 32.0]


def test_negative_zero():
    one = torch.tensor(1.0)
    assert cast_to_fp8(f32(-0.0, -1e-6), one, E4M3FN).view(torch.uint8).tolist() == [0x80, 0x80]
    # fnuz has no negative zero (0x80 is its NaN): underflow gives +0.
    assert cast_to_fp8(f32(-0.0, -1e-6), one, E4M3FNUZ).view(torch.uint8).tolist() == [0, 0]


def test_tensorwise_and_expert_tensorwise():
    x = torch.tensor([[2.0, -8.0], [1.0, 0.5]])
    q, scale = quantize_tensorwise(x, E4M3FN)
    assert scale.shape == () and q[0, 1].item() == -448.0
    w = torch.stack([x, 2 * x])
    q, scale = quantize_expert_tensorwise(w, E4M3FN)
    assert scale.shape == (2,)
    assert scale[1] == torch.tensor(1.0) / (torch.tensor(448.0) / torch.tensor(16.0))
    assert q[1, 0, 1].item() == -448.0 and q[0, 0, 1].item() == -448.0


def test_expert_colwise_layouts():
    w = torch.tensor([[[1.0, 2.0, 4.0], [8.0, -1.0, 0.0]]])  # (E=1, N=2, K=3)
    q, scale = quantize_expert_colwise(w, E4M3FN)
    assert q.shape == (1, 2, 3) and scale.shape == (1, 2)
    assert q[0, 0].float().tolist() == [112.0, 224.0, 448.0]  # amax over K of row n=0 is 4
    assert q[0, 1].float().tolist() == [448.0, -56.0, 0.0]
    qt, scale_t = quantize_expert_colwise(w, E4M3FN, transposed=True)
    assert qt.shape == (1, 3, 2) and qt.is_contiguous() and scale_t.shape == (1, 3)
    assert qt[0, :, 0].float().tolist() == [56.0, 448.0, 448.0]  # amax over N per k: 8, 2, 4
    assert qt[0, :, 1].float().tolist() == [448.0, -224.0, 0.0]
    assert expert_amax(w).tolist() == [[4.0, 8.0]] and expert_amax(w, transposed=True).tolist() == [[8.0, 2.0, 4.0]]
    qa, scale_a = quantize_expert_colwise(w, E4M3FN, transposed=True, amax=torch.tensor([[16.0, 2.0, 4.0]]))
    assert qa[0, :, 0].float().tolist() == [28.0, 448.0, 448.0]  # a given amax sets the scales: 16 for k=0
    assert scale_a[0, 0] == 16.0 / 448 and torch.equal(scale_a[0, 1:], scale_t[0, 1:])
    assert expert_amax(torch.zeros(2, 0, 3), transposed=True).tolist() == [[0.0] * 3] * 2
    with pytest.raises(ValueError, match="amax"):  # would broadcast: refused
        quantize_expert_colwise(w, E4M3FN, transposed=True, amax=torch.tensor([[16.0, 2.0, 4.0]]).T)


def test_group_colwise_hand_computed():
    x = torch.tensor([[1.0, 2.0], [4.0, -1.0], [8.0, 0.5], [3.0, 3.0]])
    offs = torch.tensor([2, 2, 3], dtype=torch.int32)  # groups: rows 0-1, empty, row 2; row 3 unused
    q, scale = quantize_group_colwise(x, offs, E4M3FN, pow2=True)
    assert scale.shape == (3, 2)
    # Group 0: col amax (4, 2) -> inv floor_pow2(112)=64, floor_pow2(224)=128.
    assert q[0].float().tolist() == [64.0, 256.0] and q[1].float().tolist() == [256.0, -128.0]
    assert scale[0].tolist() == [1 / 64, 1 / 128]
    # Empty group: scale from EPS; group 2: col amax (8, 0.5) -> inv 32, 512.
    assert q[2].float().tolist() == [256.0, 256.0]
    assert q[3].float().tolist() == [0.0, 0.0]  # past offs[-1]


def test_blockwise_partial_blocks():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 300, generator=g)
    q, scale = quantize_blockwise(x, E4M3FN, block=(1, 128))
    assert scale.shape == (5, 3)
    for kb in range(3):
        cols = slice(kb * 128, (kb + 1) * 128)
        ref_q, ref_s = quantize_rowwise(x[:, cols], E4M3FN)
        assert torch.equal(q[:, cols].view(torch.uint8), ref_q.view(torch.uint8))
        assert torch.equal(scale[:, kb], ref_s)
    w = torch.randn(2, 200, 130, generator=g)
    q, scale = quantize_blockwise(w, E4M3FN, block=(128, 128))
    assert scale.shape == (2, 2, 2)
    assert scale[1, 1, 1] == amax_to_scales(w[1, 128:, 128:].abs().amax(), E4M3FN)[1]
    assert sqnr(w, dequantize(q, scale, block=(128, 128))) > 25


@pytest.mark.parametrize("fmt", [E4M3FN, E4M3FNUZ], ids=lambda f: f.name)
def test_rowwise_sqnr_gaussian(fmt):
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(1), dtype=torch.bfloat16)
    q, scale = quantize_rowwise(x, fmt)
    assert sqnr(x, dequantize(q, scale)) > 28


def test_group_colwise_matches_per_group_loop():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(70, 48, generator=g, dtype=torch.bfloat16)
    offs = random_offsets(64, 5, "empty", generator=g)
    q, scale = quantize_group_colwise(x, offs, E4M3FN)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            ref_q, ref_s = quantize_rowwise(x[start:end].T.contiguous(), E4M3FN)
            assert torch.equal(q[start:end].view(torch.uint8), ref_q.T.contiguous().view(torch.uint8))
            assert torch.equal(scale[e], ref_s)
        start = end
    assert (q[64:].float() == 0).all()


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.floats(-1e30, 1e30, allow_nan=False, allow_subnormal=True), min_size=1, max_size=8),
        min_size=1,
        max_size=4,
    ),
    pow2=st.booleans(),
)
def test_rowwise_properties(rows, pow2):
    width = min(len(r) for r in rows)
    x = torch.tensor([r[:width] for r in rows], dtype=torch.float32)  # rounds to fp32
    q, scale = quantize_rowwise(x, E4M3FN, pow2=pow2)
    assert torch.isfinite(q.float()).all() and (scale > 0).all()
    amax = x.abs().amax(dim=1).clamp_min(EPS)
    # The row's largest value maps to within one binade of max (exactly max without pow2 up to rounding).
    top = q.float().abs().amax(dim=1)
    assert (top <= 448).all()
    nonzero = amax > EPS
    lower = 448 / 2 if pow2 else 448 * (1 - 2**-4)
    assert (top[nonzero] >= lower).all()
    # Dequantization error of each element is at most half an fp8 ulp at the row's top binade.
    err = (dequantize(q, scale) - x).abs()
    assert (err <= amax[:, None] * 2**-3 + 1e-30).all()


def test_bad_inputs():
    with pytest.raises(TypeError, match="x: expected dtype"):
        quantize_rowwise(torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="x: expected a 2-D tensor"):
        quantize_rowwise(torch.zeros(2, 2, 2))
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        quantize_rowwise([[1.0]])
    with pytest.raises(ValueError, match="w: expected a 3-D tensor"):
        quantize_expert_colwise(torch.zeros(2, 2))
    x = torch.zeros(4, 2)
    with pytest.raises(TypeError, match="offs: expected dtype"):
        quantize_group_colwise(x, torch.tensor([1, 4]))
    with pytest.raises(ValueError, match="offs: expected a 1-D"):
        quantize_group_colwise(x, torch.tensor([[1, 4]], dtype=torch.int32))
    with pytest.raises(ValueError, match="non-decreasing"):
        quantize_group_colwise(x, torch.tensor([3, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"offs\[-1\] <= 4"):
        quantize_group_colwise(x, torch.tensor([1, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="block"):
        quantize_blockwise(x, block=(0, 128))
