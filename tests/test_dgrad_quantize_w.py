"""The dgrad that quantizes the high-precision weight inside the GEMM
(``triton_grouped_mm_dgrad_quantize_w``) against the dgrad layout kernel + the 2D x 3D GEMM.

Both multiply the same FP8 values (the weight quantized with the scales of its amax over N) and
accumulate in fp32, in a different order (the new kernel computes the transposed product), so with
``out_dtype=float32`` they agree to fp32 rounding; one FP8 value that differed would move an output
by about a twentieth of a term, far outside that tolerance. Every check runs on fresh random data,
with empty experts, skewed routing, tail rows past ``offs[-1]`` and tiles that overhang the shapes.
"""

from __future__ import annotations

import pytest
import torch
import triton

from moe_fp8 import fp8_grouped_mm
from moe_fp8.grouped_gemm.backends import get_backend
from moe_fp8.grouped_gemm.backends.triton_backend import TritonBackend
from moe_fp8.grouped_gemm.emulated import emulated_grouped_mm_2d3d
from moe_fp8.grouped_gemm.triton_configs import GemmConfig
from moe_fp8.grouped_gemm.triton_kernel import triton_grouped_mm_2d3d, triton_grouped_mm_dgrad_quantize_w
from moe_fp8.kernel_backend import interpreter_enabled
from moe_fp8.quant.reference import quantize_expert_colwise, quantize_rowwise
from moe_fp8.testing import random_offsets, sqnr, ulp
from moe_fp8.testing.launches import count_launches

needs_cpu_kernel = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FNUZ_IN_INTERPRETER = tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 8)


def _problem(M, N, K, E, used, kind, *, fmt="e4m3fn", w_dtype=torch.bfloat16, stored_transposed=False, seed=0,
             device="cpu"):
    """grad_out's rowwise FP8 ``(M, N)``, the weight ``w (E, N, K)`` (a transposed view of an
    ``(E, K, N)`` storage with ``stored_transposed``), its amax over N, offsets over ``used`` rows."""
    gen = torch.Generator().manual_seed(seed)
    g, gs = quantize_rowwise(torch.randn(M, N, generator=gen) * 3, fmt)
    w = torch.randn(E, N, K, generator=gen) / N**0.5
    w[0, :, 1] = 0  # an all-zero column: the scale of an amax of 0
    w = w.to(w_dtype)
    if stored_transposed:
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    offs = random_offsets(used, E, kind, generator=gen)
    amax = w.float().abs().amax(dim=1)
    return tuple(t.to(device) for t in (g, gs, w, amax, offs))


def _layout_then_gemm(g, gs, w, amax, offs, fmt="e4m3fn", pow2=False, out_dtype=torch.float32):
    q, s = quantize_expert_colwise(w.cpu(), fmt, pow2=pow2, transposed=True, amax=amax.cpu())
    return q, s, triton_grouped_mm_2d3d(g, gs, q.to(g.device), s.to(g.device), offs, out_dtype)


def _assert_fp32_close(out, ref):
    assert not torch.isnan(out).any(), "NaN in the output (an unwritten element?)"
    torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=1e-5, atol=1e-6 * float(ref.abs().max().clamp_min(1e-30)))


@pytest.fixture
def dirty_allocator():
    """Leave freed float blocks full of NaN, so an unwritten output cannot read as zeros."""
    torch.full((1 << 16,), float("nan")).sum()


@needs_cpu_kernel
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty", "one"])
@pytest.mark.parametrize("pow2", [False, True])
def test_matches_layout_then_gemm(kind, pow2, dirty_allocator):
    M, used = 77, 70
    g, gs, w, amax, offs = _problem(M, 48, 64, 5, used, kind, seed=hash((kind, pow2)) % 1000)
    _, _, ref = _layout_then_gemm(g, gs, w, amax, offs, pow2=pow2)
    out = triton_grouped_mm_dgrad_quantize_w(g, gs, w, amax, offs, torch.float32, pow2=pow2)
    _assert_fp32_close(out, ref)
    assert bool((out[used:] == 0).all()), "rows past offs[-1] must be zero"
    bf16 = triton_grouped_mm_dgrad_quantize_w(g, gs, w, amax, offs, pow2=pow2)
    assert bf16.dtype == torch.bfloat16 and bool((bf16.float() - out).abs().le(out.abs() * 2**-8).all())


@needs_cpu_kernel
@pytest.mark.parametrize("w_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("stored_transposed", [False, True])
def test_weight_dtypes_and_layouts(w_dtype, stored_transposed):
    g, gs, w, amax, offs = _problem(40, 32, 48, 3, 40, "skewed", w_dtype=w_dtype, stored_transposed=stored_transposed)
    _, _, ref = _layout_then_gemm(g, gs, w, amax, offs)
    _assert_fp32_close(triton_grouped_mm_dgrad_quantize_w(g, gs, w, amax, offs, torch.float32), ref)


@needs_cpu_kernel
@pytest.mark.parametrize("cfg", [GemmConfig(32, 32, 32, 2, 1, 1), GemmConfig(16, 32, 16, 1, 1, 1)],
                         ids=["32x32x32", "16x32x16"])
def test_tiles_overhanging_the_shapes(cfg, dirty_allocator):
    # N = 48 is no multiple of 32 (a masked last reduction slice), K = 80 of 32 (a partial column tile)
    g, gs, w, amax, offs = _problem(53, 48, 80, 4, 50, "empty", seed=3)
    _, _, ref = _layout_then_gemm(g, gs, w, amax, offs)
    _assert_fp32_close(triton_grouped_mm_dgrad_quantize_w(g, gs, w, amax, offs, torch.float32, config=cfg), ref)


@needs_cpu_kernel
@pytest.mark.parametrize("fmt", ["e5m2", pytest.param("e4m3fnuz", marks=pytest.mark.skipif(
    not FNUZ_IN_INTERPRETER, reason="fnuz types fail in the interpreter below triton 3.8"))])
def test_other_formats(fmt):
    g, gs, w, amax, offs = _problem(40, 32, 48, 3, 36, "balanced", fmt=fmt)
    _, _, ref = _layout_then_gemm(g, gs, w, amax, offs, fmt=fmt)
    _assert_fp32_close(triton_grouped_mm_dgrad_quantize_w(g, gs, w, amax, offs, torch.float32, fmt=fmt), ref)


@needs_cpu_kernel
def test_against_fp64():
    """The numbers themselves: against the fp64 product of the dequantized operands (exact
    reference) and of the unquantized ones (FP8's own error)."""
    g, gs, w, amax, offs = _problem(64, 64, 48, 4, 64, "skewed", seed=5)
    q, s, _ = _layout_then_gemm(g, gs, w, amax, offs)
    out = triton_grouped_mm_dgrad_quantize_w(g, gs, w, amax, offs, torch.float32)
    assert sqnr(emulated_grouped_mm_2d3d(g, gs, q, s, offs, torch.float32), out) >= 100
    exact = torch.cat([g[a:b].double() * gs[a:b, None].double() @ w[e].double()
                       for e, (a, b) in enumerate(zip([0, *offs[:-1].tolist()], offs.tolist()))])
    assert sqnr(exact, out) >= 25


@needs_cpu_kernel
def test_no_rows():
    g, gs, w, amax, offs = _problem(0, 32, 48, 3, 0, "balanced")
    assert triton_grouped_mm_dgrad_quantize_w(g, gs, w, amax, offs).shape == (0, 48)


def _bad_cases():
    a = torch.zeros(8, 32, dtype=torch.float8_e4m3fn)
    w = torch.zeros(2, 32, 48, dtype=torch.bfloat16)
    sa, amax = torch.ones(8), torch.ones(2, 48)
    offs = torch.tensor([4, 8], dtype=torch.int32)
    ok = dict(a=a, scale_a=sa, w=w, w_amax=amax, offs=offs)
    return [
        (dict(ok, a=a.to(torch.bfloat16)), TypeError, "a:"),
        (dict(ok, fmt="e5m2"), TypeError, "a:.*e5m2"),
        (dict(ok, w=w.to(torch.float8_e4m3fn)), TypeError, "w:"),
        (dict(ok, w=torch.zeros(2, 48, 48, dtype=torch.bfloat16)), ValueError, "w:"),
        (dict(ok, w=torch.zeros(2, 32, 40, dtype=torch.bfloat16), w_amax=torch.ones(2, 40)), ValueError, "K"),
        (dict(ok, w_amax=torch.ones(2, 32)), ValueError, "w_amax:"),
        (dict(ok, w_amax=amax.bfloat16()), TypeError, "w_amax:"),
        (dict(ok, scale_a=torch.ones(7)), ValueError, "scale_a:"),
        (dict(ok, offs=torch.tensor([8], dtype=torch.int32)), ValueError, "offs:"),
        (dict(ok, out_dtype=torch.int32), TypeError, "out_dtype:"),
        (dict(ok, w_amax=amax.to("meta")), ValueError, "w_amax:.*one device"),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input(case):
    kwargs, exc, match = _bad_cases()[case]
    with pytest.raises(exc, match=match):
        triton_grouped_mm_dgrad_quantize_w(**kwargs)


def test_backends_take_it_for_small_groups_only(monkeypatch):
    """The rule reads static shapes: the Triton kernel for groups of at most
    ``quantize_w_max_rows_per_group`` rows on average (on ``cuda_auto`` only where it runs the
    2D x 3D GEMMs on Triton); never on ``cuda`` (its GEMMs take FP8 operands only)."""
    triton_be = get_backend("triton")
    limit = triton_be.quantize_w_max_rows_per_group
    assert triton_be.quantizes_w_in_gemm(limit * 8, 8) and not triton_be.quantizes_w_in_gemm(limit * 8 + 1, 8)
    for name in ("hybrid", "cuda_auto"):
        be = get_backend(name)
        assert be.quantizes_w_in_gemm(limit * 8, 8) and not be.quantizes_w_in_gemm(limit * 8 + 1, 8)
    auto = get_backend("cuda_auto")  # only where its own rule runs the 2D x 3D GEMMs on Triton
    monkeypatch.setattr(type(auto), "triton_max_rows_per_group", 1)
    assert not auto.quantizes_w_in_gemm(8 * 8, 8) and auto.quantizes_w_in_gemm(8, 8)
    assert not get_backend("cuda").quantizes_w_in_gemm(8, 8)


# ---- GPU: the sizes it runs at ---------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["skewed", "empty"])
@pytest.mark.parametrize("pow2", [False, True])
def test_gpu_matches_layout_then_gemm(kind, pow2):
    """Qwen3-30B-A3B's gate_up dgrad at a quarter of its rows (16384 over 128 experts), default tiles."""
    M, used = 16400, 16384
    g, gs, w, amax, offs = _problem(M, 1536, 2048, 128, used, kind, seed=7, device="cuda")
    _, _, ref = _layout_then_gemm(g, gs, w, amax, offs, pow2=pow2)
    out = triton_grouped_mm_dgrad_quantize_w(g, gs, w, amax, offs, torch.float32, pow2=pow2)
    assert bool((out[used:] == 0).all())
    _assert_fp32_close(out, ref)


@needs_cpu_kernel
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp"])
@pytest.mark.parametrize("stored_transposed", [False, True])
def test_fp8_grouped_mm_backward_either_way(recipe, stored_transposed, monkeypatch):
    """``fp8_grouped_mm`` on an uncached parameter (a transposed view of one: Llama 4's storage):
    the dgrad that quantizes the weight in the GEMM gives the two-step dgrad's ``dx`` and the same
    ``dw``, and launches no dgrad layout kernel."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(60, 48, generator=gen).bfloat16().requires_grad_()
    param = torch.nn.Parameter(torch.randn(4, 48, 32, generator=gen).bfloat16() if stored_transposed
                               else torch.randn(4, 32, 48, generator=gen).bfloat16())
    offs = random_offsets(56, 4, "skewed", generator=gen)
    dy = torch.randn(60, 32, generator=gen).bfloat16()

    def run():
        x.grad = param.grad = None
        w = param.transpose(1, 2) if stored_transposed else param
        with count_launches() as n:
            out = fp8_grouped_mm(x, w, offs, recipe=recipe, backend="triton")
            out.backward(dy)
        return out, x.grad, param.grad, n.ops

    out1, dx1, dw1, ops1 = run()
    monkeypatch.setattr(TritonBackend, "quantize_w_max_rows_per_group", 0)
    out2, dx2, dw2, ops2 = run()
    assert ops1.get("triton:_grouped_mm_dgrad_quantize_w_kernel") == 1, sorted(ops1)
    assert "triton:_grouped_mm_dgrad_quantize_w_kernel" not in ops2
    assert ops2["triton:_colwise_kernel"] == ops1.get("triton:_colwise_kernel", 0) + 1  # the dgrad layout
    assert torch.equal(out1, out2) and torch.equal(dw1, dw2)
    diff = (dx1.float() - dx2.float()).abs()  # fp32 sums in another order, then one bf16 rounding
    assert bool((diff <= ulp(dx2, torch.bfloat16)).all()) and float((diff > 0).float().mean()) <= 0.02
