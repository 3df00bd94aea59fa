"""The emulated FP8 grouped GEMM against per-expert fp64 matmuls on dequantized values."""

import pytest
import torch

from moe_fp8.grouped_gemm.emulated import emulated_grouped_mm_2d2d, emulated_grouped_mm_2d3d
from moe_fp8.layers.scaled_mm import cpu_kernel_takes_row_scales
from moe_fp8.quant.formats import E4M3FN, E4M3FNUZ
from moe_fp8.quant.reference import (
    dequantize,
    quantize_blockwise,
    quantize_expert_colwise,
    quantize_expert_tensorwise,
    quantize_group_colwise,
    quantize_rowwise,
    quantize_tensorwise,
)
from moe_fp8.testing import OFFSET_KINDS, random_offsets, reference_grouped_mm, sqnr


def _bf16_close(out: torch.Tensor, ref64: torch.Tensor) -> None:
    """Output equals the fp64 result up to fp32 accumulation and one bf16 rounding."""
    assert out.dtype == torch.bfloat16
    tol = ref64.abs() * 2**-8 + ref64.abs().amax() * 1e-5
    assert ((out.double() - ref64).abs() <= tol).all()


@pytest.mark.parametrize("kind", OFFSET_KINDS)
@pytest.mark.parametrize("fmt", [E4M3FN, E4M3FNUZ], ids=lambda f: f.name)
def test_2d3d_rowwise(kind, fmt):
    g = torch.Generator().manual_seed(10)
    M, K, N, E = 75, 64, 48, 5
    x = torch.randn(M + 3, K, generator=g, dtype=torch.bfloat16)  # 3 rows past offs[-1]
    w = torch.randn(E, N, K, generator=g, dtype=torch.bfloat16) * 0.05
    offs = random_offsets(M, E, kind, generator=g)
    xq, xs = quantize_rowwise(x, fmt)
    wq, ws = quantize_expert_colwise(w, fmt)
    out = emulated_grouped_mm_2d3d(xq, xs, wq, ws, offs)
    ref = reference_grouped_mm(dequantize(xq, xs), dequantize(wq, ws), offs)
    _bf16_close(out, ref)
    assert (out[M:] == 0).all()
    assert sqnr(reference_grouped_mm(x, w, offs)[:M], out[:M]) > 26


def test_2d3d_dgrad_layout_and_tensorwise():
    g = torch.Generator().manual_seed(11)
    M, K, N, E = 40, 32, 64, 3
    dy = torch.randn(M, N, generator=g)
    w = torch.randn(E, N, K, generator=g)
    offs = random_offsets(M, E, "skewed", generator=g)
    dyq, dys = quantize_rowwise(dy, E4M3FN)
    wq_t, ws_t = quantize_expert_colwise(w, E4M3FN, transposed=True)  # (E, K, N), scale (E, K)
    dx = emulated_grouped_mm_2d3d(dyq, dys, wq_t, ws_t, offs)
    _bf16_close(dx, reference_grouped_mm(dequantize(dyq, dys), dequantize(wq_t, ws_t), offs))
    xq, xs = quantize_tensorwise(dy, E4M3FN)
    wq, ws = quantize_expert_tensorwise(wq_t.float(), E4M3FN)
    out = emulated_grouped_mm_2d3d(xq, xs, wq, ws, offs)
    _bf16_close(out, reference_grouped_mm(dequantize(xq, xs), dequantize(wq, ws), offs))


def test_2d3d_blockwise():
    g = torch.Generator().manual_seed(12)
    M, K, N, E = 33, 384, 160, 3
    x = torch.randn(M, K, generator=g)
    w = torch.randn(E, N, K, generator=g)
    offs = random_offsets(M, E, "balanced", generator=g)
    xq, xs = quantize_blockwise(x, E4M3FN, block=(1, 128))
    wq, ws = quantize_blockwise(w, E4M3FN, block=(128, 128))
    out = emulated_grouped_mm_2d3d(xq, xs, wq, ws, offs)
    ref = reference_grouped_mm(dequantize(xq, xs, block=(1, 128)), dequantize(wq, ws, block=(128, 128)), offs)
    _bf16_close(out, ref)
    assert sqnr(reference_grouped_mm(x, w, offs), out) > 26


@pytest.mark.parametrize("kind", OFFSET_KINDS)
def test_2d2d_wgrad(kind):
    g = torch.Generator().manual_seed(13)
    M, N, K, E = 90, 32, 48, 4
    dy = torch.randn(M, N, generator=g, dtype=torch.bfloat16)
    x = torch.randn(M, K, generator=g, dtype=torch.bfloat16)
    offs = random_offsets(M - 7, E, kind, generator=g)
    dyq, dys = quantize_group_colwise(dy, offs, E4M3FN)
    xq, xs = quantize_group_colwise(x, offs, E4M3FN)
    dw = emulated_grouped_mm_2d2d(dyq, dys, xq, xs, offs)
    assert dw.shape == (E, N, K)
    start = 0
    for e, end in enumerate(offs.tolist()):
        a = dyq[start:end].double() * dys[e].double()
        b = xq[start:end].double() * xs[e].double()
        _bf16_close(dw[e], a.T @ b)
        if end == start:
            assert (dw[e] == 0).all()
        else:
            assert sqnr(dy[start:end].double().T @ x[start:end].double(), dw[e]) > 24
        start = end


def test_2d2d_tensorwise():
    g = torch.Generator().manual_seed(14)
    dy, x = torch.randn(20, 16, generator=g), torch.randn(20, 32, generator=g)
    offs = torch.tensor([5, 5, 20], dtype=torch.int32)
    dyq, dys = quantize_tensorwise(dy, E4M3FN)
    xq, xs = quantize_tensorwise(x, E4M3FN)
    dw = emulated_grouped_mm_2d2d(dyq, dys, xq, xs, offs)
    a, b = dequantize(dyq, dys).double(), dequantize(xq, xs).double()
    _bf16_close(dw[0], a[:5].T @ b[:5])
    _bf16_close(dw[2], a[5:].T @ b[5:])
    assert (dw[1] == 0).all()


@pytest.mark.skipif(not cpu_kernel_takes_row_scales(),
                    reason="this torch's CPU torch._scaled_mm takes per-tensor scales only")
def test_matches_scaled_mm_per_group():
    """Each group equals torch._scaled_mm on the same FP8 operands (CPU kernel), to bf16 rounding."""
    g = torch.Generator().manual_seed(15)
    x, w = torch.randn(64, 32, generator=g), torch.randn(2, 48, 32, generator=g)
    offs = torch.tensor([16, 64], dtype=torch.int32)
    xq, xs = quantize_rowwise(x, E4M3FN)
    wq, ws = quantize_expert_colwise(w, E4M3FN)
    out = emulated_grouped_mm_2d3d(xq, xs, wq, ws, offs)
    for e, rows in enumerate((slice(0, 16), slice(16, 64))):
        ref = torch._scaled_mm(xq[rows], wq[e].t(), xs[rows, None], ws[e][None, :], out_dtype=torch.bfloat16)
        assert (out[rows].float() - ref.float()).abs().max() <= ref.float().abs().max() * 2**-7


def test_zero_rows_and_all_empty():
    wq, ws = quantize_expert_colwise(torch.randn(2, 16, 32), E4M3FN)
    xq, xs = quantize_rowwise(torch.randn(0, 32), E4M3FN)
    out = emulated_grouped_mm_2d3d(xq, xs, wq, ws, torch.zeros(2, dtype=torch.int32))
    assert out.shape == (0, 16)
    xq, xs = quantize_rowwise(torch.randn(4, 32), E4M3FN)
    out = emulated_grouped_mm_2d3d(xq, xs, wq, ws, torch.zeros(2, dtype=torch.int32))
    assert (out == 0).all()


def test_bad_inputs():
    xq, xs = quantize_rowwise(torch.randn(8, 32), E4M3FN)
    wq, ws = quantize_expert_colwise(torch.randn(2, 16, 32), E4M3FN)
    offs = torch.tensor([4, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match="a: expected dtype"):
        emulated_grouped_mm_2d3d(xq.float(), xs, wq, ws, offs)
    with pytest.raises(ValueError, match="b: expected shape"):
        emulated_grouped_mm_2d3d(xq, xs, wq[:, :, :16], ws, offs)
    with pytest.raises(ValueError, match="offs: expected length 2"):
        emulated_grouped_mm_2d3d(xq, xs, wq, ws, offs[:1])
    with pytest.raises(TypeError, match="offs: expected dtype"):
        emulated_grouped_mm_2d3d(xq, xs, wq, ws, offs.long())
    with pytest.raises(ValueError, match="non-decreasing"):
        emulated_grouped_mm_2d3d(xq, xs, wq, ws, offs.flip(0))
    with pytest.raises(ValueError, match=r"offs\[-1\] <= 8"):
        emulated_grouped_mm_2d3d(xq, xs, wq, ws, offs + 1)
    with pytest.raises(ValueError, match="scale_b: expected shape"):
        emulated_grouped_mm_2d3d(xq, xs, wq, ws[:, :8], offs)
    with pytest.raises(TypeError, match="scale_a: expected dtype"):
        emulated_grouped_mm_2d3d(xq, xs.double(), wq, ws, offs)
    with pytest.raises(TypeError, match="out_dtype"):
        emulated_grouped_mm_2d3d(xq, xs, wq, ws, offs, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="b: expected shape"):
        emulated_grouped_mm_2d2d(xq, xs, xq[:4], xs, offs)
