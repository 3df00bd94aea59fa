"""The Triton FP8 grouped GEMM against the exact CPU reference (``emulated``) and fp64.

CPU tests run the real kernels in the Triton interpreter (``TRITON_INTERPRET=1``) on small shapes.
What "equal" means here: the kernel and the reference both multiply the same FP8 values exactly
and accumulate in fp32, only in a different order, then apply the same scales in the same order.
So with ``out_dtype=float32`` they agree to fp32 rounding (``rtol=1e-5`` plus ``1e-6 * max|ref|``),
and with bf16 output every element is either identical or one bf16 ulp away (a tie broken
differently after an fp32-order difference), and at most 2% of them are not identical.
SQNR against the fp64 product of the unquantized inputs checks the numbers themselves.
"""

from __future__ import annotations

import pytest
import torch
import triton

from moe_fp8.grouped_gemm.emulated import emulated_grouped_mm_2d2d, emulated_grouped_mm_2d3d
from moe_fp8.grouped_gemm.triton_configs import GemmConfig
from moe_fp8.kernel_backend import interpreter_enabled
from moe_fp8.grouped_gemm.triton_kernel import triton_grouped_mm_2d2d, triton_grouped_mm_2d3d
from moe_fp8.quant.reference import (
    dequantize,
    quantize_blockwise,
    quantize_expert_colwise,
    quantize_expert_tensorwise,
    quantize_group_colwise,
    quantize_rowwise,
    quantize_tensorwise,
)
from moe_fp8.testing import random_offsets, reference_grouped_mm, sqnr, ulp

CUDA = torch.cuda.is_available()
needs_cpu_kernel = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
FNUZ_IN_INTERPRETER = tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 8)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Make ``torch.empty`` return NaN-filled float tensors, so unwritten outputs show up."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point() and t.element_size() >= 2:
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)


def assert_matches_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to fp32 accumulation order (see the module docstring)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not torch.isnan(out).any(), "NaN in the output (an unwritten element?)"
    out, ref = out.cpu(), ref.cpu()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max().clamp_min(1e-30)))
        return
    diff = (out.float() - ref.float()).abs()
    bound = torch.maximum(ulp(out, torch.bfloat16), ulp(ref, torch.bfloat16))
    assert bool((diff <= bound).all()), f"max diff {float(diff.max())}"
    assert float((diff > 0).float().mean()) <= 0.02


def _quantize_2d3d(x, w, mode, fmt):
    if mode == "rowwise":
        return (*quantize_rowwise(x, fmt), *quantize_expert_colwise(w, fmt))
    if mode == "tensorwise":
        return (*quantize_tensorwise(x, fmt), *quantize_expert_tensorwise(w, fmt))
    return (*quantize_blockwise(x, fmt, block=(1, 128)), *quantize_blockwise(w, fmt, block=(128, 128)))


def _problem_2d3d(M, K, N, E, used, kind, mode="rowwise", fmt="e4m3fn", seed=0, device="cpu"):
    """Random ``x (M, K)``, ``w (E, N, K)``, offsets over the first ``used`` rows, quantized."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen) * 3
    w = torch.randn(E, N, K, generator=gen) / K**0.5
    offs = random_offsets(used, E, kind, generator=gen)
    a, sa, b, sb = (t.to(device) for t in _quantize_2d3d(x, w, mode, fmt))
    return x, w, offs.to(device), a, sa, b, sb


@needs_cpu_kernel
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty", "one"])
@pytest.mark.parametrize("mode", ["rowwise", "tensorwise"])
def test_2d3d_matches_emulated(kind, mode, poisoned_empty):
    # 100 rows, 91 of them routed: group sizes are not multiples of 16 and 9 tail rows must be 0.
    x, w, offs, a, sa, b, sb = _problem_2d3d(100, 64, 48, 4, 91, kind, mode, seed=len(kind))
    out = triton_grouped_mm_2d3d(a, sa, b, sb, offs)
    assert_matches_reference(out, emulated_grouped_mm_2d3d(a, sa, b, sb, offs))
    assert bool((out[91:] == 0).all())
    out32 = triton_grouped_mm_2d3d(a, sa, b, sb, offs, torch.float32)
    assert_matches_reference(out32, emulated_grouped_mm_2d3d(a, sa, b, sb, offs, torch.float32))
    assert sqnr(reference_grouped_mm(x, w, offs), out32) >= (28 if mode == "rowwise" else 25)


@needs_cpu_kernel
def test_2d3d_blockwise_matches_emulated(poisoned_empty):
    # K = 384: three 128-deep scale slices; N = 128: one weight block row.
    x, w, offs, a, sa, b, sb = _problem_2d3d(70, 384, 128, 3, 64, "skewed", "blockwise")
    for dtype in (torch.bfloat16, torch.float32):
        out = triton_grouped_mm_2d3d(a, sa, b, sb, offs, dtype)
        assert_matches_reference(out, emulated_grouped_mm_2d3d(a, sa, b, sb, offs, dtype))
        assert bool((out[64:] == 0).all())
    assert sqnr(reference_grouped_mm(x, w, offs), out) >= 28


@needs_cpu_kernel
def test_2d3d_blockwise_partial_blocks():
    # K = N = 144: the last 1x128 / 128x128 scale blocks are partial (16 wide). Checked against
    # the fp64 product of the dequantized operands (emulated_grouped_mm_2d3d infers the block
    # size as ceil(K / blocks) = 72 here, so it is not the reference for this case).
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(40, 144, generator=gen), torch.randn(3, 144, 144, generator=gen)
    x[:, 128:] *= 100  # a wrongly applied scale slice would show
    offs = random_offsets(37, 3, "skewed", generator=gen)
    a, sa = quantize_blockwise(x, block=(1, 128))
    b, sb = quantize_blockwise(w, block=(128, 128))
    out = triton_grouped_mm_2d3d(a, sa, b, sb, offs, torch.float32)
    ref = reference_grouped_mm(dequantize(a, sa, block=(1, 128)), dequantize(b, sb, block=(128, 128)), offs)
    assert sqnr(ref, out) >= 100


@needs_cpu_kernel
def test_2d3d_k_tail_and_fp16_out():
    # K = 48 is not a multiple of the 32-deep K tile: the masked-K path.
    _, _, offs, a, sa, b, sb = _problem_2d3d(40, 48, 32, 3, 40, "balanced")
    out = triton_grouped_mm_2d3d(a, sa, b, sb, offs, torch.float16)
    torch.testing.assert_close(out, emulated_grouped_mm_2d3d(a, sa, b, sb, offs, torch.float16), rtol=1e-3, atol=1e-3)


@needs_cpu_kernel
def test_2d3d_dgrad_layout():
    # dgrad: dx = dy @ w[g], b = w quantized along N in the transposed (E, K, N) layout.
    gen = torch.Generator().manual_seed(3)
    E, N, K, M = 3, 32, 64, 50
    dy, w = torch.randn(M, N, generator=gen), torch.randn(E, N, K, generator=gen)
    offs = random_offsets(M, E, "skewed", generator=gen)
    a, sa = quantize_rowwise(dy)
    b, sb = quantize_expert_colwise(w, transposed=True)
    out = triton_grouped_mm_2d3d(a, sa, b, sb, offs)
    assert out.shape == (M, K)
    assert_matches_reference(out, emulated_grouped_mm_2d3d(a, sa, b, sb, offs))
    assert sqnr(reference_grouped_mm(dy, w.transpose(1, 2), offs), out) >= 28


@needs_cpu_kernel
def test_2d3d_strided_a_and_scales():
    _, _, offs, a, sa, b, sb = _problem_2d3d(40, 64, 32, 2, 33, "balanced")
    wide = torch.zeros(40, 96, dtype=a.dtype)
    wide[:, 16:80] = a
    sa_strided = torch.zeros(40, 2)
    sa_strided[:, 1] = sa
    out = triton_grouped_mm_2d3d(wide[:, 16:80], sa_strided[:, 1], b, sb, offs)
    assert_matches_reference(out, emulated_grouped_mm_2d3d(a, sa, b, sb, offs))


@needs_cpu_kernel
def test_2d3d_degenerate_routing(poisoned_empty):
    _, _, _, a, sa, b, sb = _problem_2d3d(24, 32, 16, 3, 24, "balanced")
    empty = triton_grouped_mm_2d3d(a[:0], sa[:0], b, sb, torch.zeros(3, dtype=torch.int32))
    assert empty.shape == (0, 16)
    nothing_routed = triton_grouped_mm_2d3d(a, sa, b, sb, torch.zeros(3, dtype=torch.int32))
    assert bool((nothing_routed == 0).all())
    last_only = torch.tensor([0, 0, 24], dtype=torch.int32)
    out = triton_grouped_mm_2d3d(a, sa, b, sb, last_only)
    assert_matches_reference(out, emulated_grouped_mm_2d3d(a, sa, b, sb, last_only))


@needs_cpu_kernel
@pytest.mark.parametrize(
    "fmt",
    ["e5m2", pytest.param("e4m3fnuz", marks=pytest.mark.skipif(not FNUZ_IN_INTERPRETER, reason="triton < 3.8"))],
)
def test_2d3d_other_formats(fmt):
    x, w, offs, a, sa, b, sb = _problem_2d3d(40, 64, 32, 3, 37, "empty", fmt=fmt)
    out = triton_grouped_mm_2d3d(a, sa, b, sb, offs)
    assert_matches_reference(out, emulated_grouped_mm_2d3d(a, sa, b, sb, offs))
    assert sqnr(reference_grouped_mm(x, w, offs), out) >= (20 if fmt == "e5m2" else 28)


def _problem_2d2d(M, N, K, E, used, kind, seed=0, tensorwise=False):
    gen = torch.Generator().manual_seed(seed)
    dy = torch.randn(M, N, generator=gen)
    x = torch.randn(M, K, generator=gen) * 2
    offs = random_offsets(used, E, kind, generator=gen)
    if tensorwise:
        (a, sa), (b, sb) = quantize_tensorwise(dy), quantize_tensorwise(x)
    else:
        (a, sa), (b, sb) = quantize_group_colwise(dy, offs), quantize_group_colwise(x, offs)
    return dy, x, offs, a, sa, b, sb


def _reference_wgrad(dy, x, offs):
    out = torch.zeros(offs.numel(), dy.shape[1], x.shape[1], dtype=torch.float64)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[g] = dy[start:end].double().T @ x[start:end].double()
        start = end
    return out


def _col_major(t):
    return t.t().contiguous().t()


@needs_cpu_kernel
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty", "one"])
@pytest.mark.parametrize("layout", ["row", "col"])
def test_2d2d_matches_emulated(kind, layout, poisoned_empty):
    # 75 of 80 rows routed into 4 groups of arbitrary (not 16-multiple) sizes.
    dy, x, offs, a, sa, b, sb = _problem_2d2d(80, 48, 32, 4, 75, kind, seed=len(kind))
    if layout == "col":
        a, b = _col_major(a), _col_major(b)
    ref = emulated_grouped_mm_2d2d(a, sa, b, sb, offs)
    out = triton_grouped_mm_2d2d(a, sa, b, sb, offs)
    assert_matches_reference(out, ref)
    out32 = triton_grouped_mm_2d2d(a, sa, b, sb, offs, torch.float32)
    assert_matches_reference(out32, emulated_grouped_mm_2d2d(a, sa, b, sb, offs, torch.float32))
    ref64 = _reference_wgrad(dy, x, offs)
    nonempty = ref64.flatten(1).abs().amax(1) > 0
    assert bool((out32[~nonempty] == 0).all())
    assert sqnr(ref64[nonempty], out32[nonempty]) >= 25


@needs_cpu_kernel
@pytest.mark.parametrize("layout", ["row", "col"])
def test_2d2d_group_edges(layout):
    # Groups that start and end inside 16-row blocks, lie inside one block, or are exactly aligned
    # ([144, 176): the kernel skips its head/tail slice there): every head / body / tail split.
    sizes = torch.tensor([1, 0, 15, 17, 16, 33, 5, 3, 40, 14, 32])
    offs = torch.cumsum(sizes, 0).to(torch.int32)
    gen = torch.Generator().manual_seed(7)
    dy, x = torch.randn(184, 32, generator=gen), torch.randn(184, 16, generator=gen)
    (a, sa), (b, sb) = quantize_group_colwise(dy, offs), quantize_group_colwise(x, offs)
    if layout == "col":
        a, b = _col_major(a), _col_major(b)
    out = triton_grouped_mm_2d2d(a, sa, b, sb, offs, torch.float32)
    assert_matches_reference(out, emulated_grouped_mm_2d2d(a, sa, b, sb, offs, torch.float32))


@needs_cpu_kernel
def test_2d2d_tensorwise_and_degenerate(poisoned_empty):
    dy, x, offs, a, sa, b, sb = _problem_2d2d(50, 32, 16, 3, 50, "skewed", tensorwise=True)
    out = triton_grouped_mm_2d2d(a, sa, b, sb, offs)
    assert_matches_reference(out, emulated_grouped_mm_2d2d(a, sa, b, sb, offs))
    assert sqnr(_reference_wgrad(dy, x, offs), out) >= 25
    zeros = triton_grouped_mm_2d2d(a[:0], sa, b[:0], sb, torch.zeros(3, dtype=torch.int32))
    assert zeros.shape == (3, 32, 16) and bool((zeros == 0).all())


@needs_cpu_kernel
@pytest.mark.parametrize("operands", ["rowwise", "tensorwise", "bf16"])
@pytest.mark.parametrize("layout", ["row", "col"])
def test_2d2d_accumulates_in_place(operands, layout):
    """``accumulate_into``: each non-empty group's slice becomes its old values plus the product, summed
    in fp32 and rounded once, written through the target's strides (a transposed view here); an empty
    group's slice keeps its bits (negative zeros included: it is not rewritten)."""
    dy, x, offs, a, sa, b, sb = _problem_2d2d(80, 48, 32, 5, 75, "empty", seed=3, tensorwise=operands == "tensorwise")
    if operands == "bf16":
        a, sa, b, sb = dy.bfloat16(), None, x.bfloat16(), None
    if layout == "col":
        a, b = _col_major(a), _col_major(b)
    gen = torch.Generator().manual_seed(11)
    target = torch.randn(5, 32, 48, generator=gen).bfloat16().transpose(1, 2)  # (E, N, K), K-major
    target[:, 0, 0] = -0.0
    before = target.clone()
    out = triton_grouped_mm_2d2d(a, sa, b, sb, offs, accumulate_into=target)
    assert out is target
    product = emulated_grouped_mm_2d2d(a, sa, b, sb, offs, torch.float32)
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    assert bool((sizes == 0).any()) and bool((sizes > 0).any())
    expected = torch.where((sizes > 0)[:, None, None], (before.float() + product).bfloat16(), before)
    assert_matches_reference(target, expected)
    assert torch.equal(target[sizes == 0].view(torch.int16), before[sizes == 0].view(torch.int16))


@needs_cpu_kernel
def test_2d2d_bf16_operands_match_fp64(poisoned_empty):
    """Unscaled bf16 operands (the BF16 weight gradient): the fp64 product rounded to bf16, empty
    groups zero."""
    dy, x, offs, *_ = _problem_2d2d(90, 32, 48, 4, 83, "skewed", seed=5)
    a, b = dy.bfloat16(), x.bfloat16()
    out = triton_grouped_mm_2d2d(a, None, b, None, offs)
    ref = _reference_wgrad(a.float(), b.float(), offs)
    assert_matches_reference(out, ref.bfloat16())
    assert_matches_reference(out, emulated_grouped_mm_2d2d(a, None, b, None, offs))
    with pytest.raises(TypeError, match="a: expected dtype"):
        triton_grouped_mm_2d2d(a.float(), None, b.float(), None, offs)
    with pytest.raises(ValueError, match="scale_b: expected None"):
        triton_grouped_mm_2d2d(a, None, b, torch.ones(()), offs)
    with pytest.raises(TypeError, match="accumulate_into"):
        triton_grouped_mm_2d2d(a, None, b, None, offs, accumulate_into=torch.zeros(4, 32, 48))


# ---- CPU: explicit tiles larger than the 16-alignment of N, K and the wgrad row body ---------
# The interpreter's default tiles (16 wide) divide every legal N and K, so their column / K masks
# are always all-true there, and the wgrad body loop's row mask (BK = 16 rows) never cuts a block.
# Here N = 48 and K = 80 are multiples of 16 but not of the 32 / 64 tiles: the last column tile,
# the last K slice and the last body block of a group are partial.
_WIDE_TILES = [GemmConfig(32, 32, 32, 2, 1, 1), GemmConfig(64, 64, 64, 2, 1, 1)]
_WIDE_IDS = ["tile32", "tile64"]


def _offs_from_sizes(sizes):
    return torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)


@needs_cpu_kernel
@pytest.mark.parametrize("cfg", _WIDE_TILES, ids=_WIDE_IDS)
@pytest.mark.parametrize("mode", ["rowwise", "tensorwise"])
def test_2d3d_partial_tiles(cfg, mode, poisoned_empty):
    # 139 of 150 rows routed; empty groups and groups of 37, 5, 64, 33 rows (not tile multiples).
    M, K, N = 150, 80, 48
    offs = _offs_from_sizes([0, 37, 5, 64, 0, 33])
    gen = torch.Generator().manual_seed(11)
    x, w = torch.randn(M, K, generator=gen) * 3, torch.randn(6, N, K, generator=gen) / K**0.5
    a, sa, b, sb = _quantize_2d3d(x, w, mode, "e4m3fn")
    for dtype in (torch.bfloat16, torch.float32):
        out = triton_grouped_mm_2d3d(a, sa, b, sb, offs, dtype, config=cfg)
        assert_matches_reference(out, emulated_grouped_mm_2d3d(a, sa, b, sb, offs, dtype))
        assert bool((out[139:] == 0).all())
    assert sqnr(reference_grouped_mm(x, w, offs), out) >= (28 if mode == "rowwise" else 25)


@needs_cpu_kernel
def test_2d3d_blockwise_partial_tiles(poisoned_empty):
    # K = 208, N = 176: partial 128-deep K slice and partial 128x128 scale blocks, 32-wide tiles.
    M, K, N = 90, 208, 176
    offs = _offs_from_sizes([37, 0, 5, 41])
    gen = torch.Generator().manual_seed(12)
    x, w = torch.randn(M, K, generator=gen) * 3, torch.randn(4, N, K, generator=gen) / K**0.5
    x[:, 128:] *= 50  # a misapplied scale slice would show
    a, sa, b, sb = _quantize_2d3d(x, w, "blockwise", "e4m3fn")
    out = triton_grouped_mm_2d3d(a, sa, b, sb, offs, torch.float32, config=GemmConfig(32, 32, 128, 2, 1, 1))
    assert_matches_reference(out, emulated_grouped_mm_2d3d(a, sa, b, sb, offs, torch.float32))
    assert bool((out[83:] == 0).all())
    assert sqnr(reference_grouped_mm(x, w, offs), out) >= 28


@needs_cpu_kernel
@pytest.mark.parametrize("cfg", _WIDE_TILES, ids=_WIDE_IDS)
@pytest.mark.parametrize("layout", ["row", "col"])
def test_2d2d_partial_tiles(cfg, layout, poisoned_empty):
    # Group bodies (16-aligned row ranges) of 32, 80 and 16 rows: with BK = 32 / 64 the last body
    # block of a group runs past body_end into the group's tail rows and the next group's rows,
    # and the first block starts at the multiple of BK below body_start, in the previous group's
    # rows: the row mask must cut both. Empty groups, a group inside one 16-row block, 8 tail rows.
    sizes = [0, 37, 5, 90, 0, 16, 51, 33]
    offs = _offs_from_sizes(sizes)
    M, N, K = 240, 48, 80
    gen = torch.Generator().manual_seed(13)
    dy, x = torch.randn(M, N, generator=gen), torch.randn(M, K, generator=gen) * 2
    (a, sa), (b, sb) = quantize_group_colwise(dy, offs), quantize_group_colwise(x, offs)
    if layout == "col":
        a, b = _col_major(a), _col_major(b)
    for dtype in (torch.bfloat16, torch.float32):
        out = triton_grouped_mm_2d2d(a, sa, b, sb, offs, dtype, config=cfg)
        assert_matches_reference(out, emulated_grouped_mm_2d2d(a, sa, b, sb, offs, dtype))
    empty = torch.tensor(sizes) == 0
    assert bool((out[empty] == 0).all())
    assert sqnr(_reference_wgrad(dy, x, offs)[~empty], out[~empty]) >= 25


@needs_cpu_kernel
def test_2d2d_tensorwise_partial_tiles(poisoned_empty):
    offs = _offs_from_sizes([19, 0, 61, 28])  # 4 tail rows
    gen = torch.Generator().manual_seed(14)
    dy, x = torch.randn(112, 48, generator=gen), torch.randn(112, 80, generator=gen)
    (a, sa), (b, sb) = quantize_tensorwise(dy), quantize_tensorwise(x)
    out = triton_grouped_mm_2d2d(a, sa, b, sb, offs, torch.float32, config=GemmConfig(32, 32, 32, 2, 1, 1))
    assert_matches_reference(out, emulated_grouped_mm_2d2d(a, sa, b, sb, offs, torch.float32))
    assert bool((out[1] == 0).all())


# Bad input: each case names the argument it must blame.
def _bad_2d3d_cases():
    a = torch.zeros(8, 32, dtype=torch.float8_e4m3fn)
    b = torch.zeros(2, 16, 32, dtype=torch.float8_e4m3fn)
    sa, sb = torch.ones(8), torch.ones(2, 16)
    offs = torch.tensor([4, 8], dtype=torch.int32)
    ok = dict(a=a, scale_a=sa, b=b, scale_b=sb, offs=offs)
    return [
        (dict(ok, a=a.to(torch.bfloat16)), TypeError, "a:"),
        (dict(ok, b=b.to(torch.float8_e5m2)), TypeError, "b:"),
        (dict(ok, b=b.float()), TypeError, "b:"),
        (dict(ok, b=None), TypeError, "b:"),
        (dict(ok, b=torch.zeros(2, 16, 48, dtype=torch.float8_e4m3fn)), ValueError, "b:"),
        (dict(ok, a=torch.zeros(8, 40, dtype=torch.float8_e4m3fn), b=torch.zeros(2, 16, 40, dtype=torch.float8_e4m3fn)),
         ValueError, "K"),
        (dict(ok, b=torch.zeros(2, 24, 32, dtype=torch.float8_e4m3fn), scale_b=torch.ones(2, 24)), ValueError, "N"),
        (dict(ok, offs=offs.long()), TypeError, "offs:"),
        (dict(ok, offs=torch.tensor([8], dtype=torch.int32)), ValueError, "offs:"),
        (dict(ok, offs=torch.tensor([[4, 8]], dtype=torch.int32)), ValueError, "offs:"),
        (dict(ok, scale_a=torch.ones(7)), ValueError, "scale_a:"),
        (dict(ok, scale_a=sa.bfloat16()), TypeError, "scale_a:"),
        (dict(ok, scale_b=torch.ones(2)), ValueError, "scale_b:"),
        (dict(ok, scale_a=torch.ones(()), scale_b=torch.ones(2, 16)), ValueError, "scale_b:"),
        (dict(ok, scale_a=torch.ones(8, 1), scale_b=torch.ones(2, 16)), ValueError, "scale_b:"),
        (dict(ok, out_dtype=torch.int32), TypeError, "out_dtype:"),
        (dict(ok, scale_a=sa.to("meta")), ValueError, "scale_a:.*one device"),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(len(_bad_2d3d_cases())))
def test_2d3d_bad_input(case):
    kwargs, exc, match = _bad_2d3d_cases()[case]
    with pytest.raises(exc, match=match):
        triton_grouped_mm_2d3d(**kwargs)


def _bad_2d2d_cases():
    a = torch.zeros(8, 32, dtype=torch.float8_e4m3fn)
    b = torch.zeros(8, 16, dtype=torch.float8_e4m3fn)
    offs = torch.tensor([4, 8], dtype=torch.int32)
    ok = dict(a=a, scale_a=torch.ones(2, 32), b=b, scale_b=torch.ones(2, 16), offs=offs)
    return [
        (dict(ok, a=a.float()), TypeError, "a:"),
        (dict(ok, b=torch.zeros(9, 16, dtype=torch.float8_e4m3fn)), ValueError, "b:"),
        (dict(ok, a=torch.zeros(8, 24, dtype=torch.float8_e4m3fn), scale_a=torch.ones(2, 24)), ValueError, "N"),
        (dict(ok, b=torch.zeros(8, 8, dtype=torch.float8_e4m3fn), scale_b=torch.ones(2, 8)), ValueError, "K"),
        (dict(ok, offs=offs[None]), ValueError, "offs:"),
        (dict(ok, offs=offs[:0]), ValueError, "offs:"),
        (dict(ok, scale_a=torch.ones(3, 32)), ValueError, "scale_a:"),
        (dict(ok, scale_b=torch.ones(())), ValueError, "scale_b:"),
        (dict(ok, scale_a=torch.ones(()), scale_b=torch.ones(2, 16)), ValueError, "scale_b:"),
        (dict(ok, offs=offs.to("meta")), ValueError, "offs:.*one device"),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(len(_bad_2d2d_cases())))
def test_2d2d_bad_input(case):
    kwargs, exc, match = _bad_2d2d_cases()[case]
    with pytest.raises(exc, match=match):
        triton_grouped_mm_2d2d(**kwargs)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    a = torch.zeros(8, 32, dtype=torch.float8_e4m3fn)
    b = torch.zeros(2, 16, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        triton_grouped_mm_2d3d(a, torch.ones(8), b, torch.ones(2, 16), torch.tensor([4, 8], dtype=torch.int32))


@needs_cpu_kernel
def test_blockwise_rejects_other_k_tiles():
    _, _, offs, a, sa, b, sb = _problem_2d3d(16, 128, 16, 2, 16, "balanced", "blockwise")
    with pytest.raises(ValueError, match="config:"):
        triton_grouped_mm_2d3d(a, sa, b, sb, offs, config=GemmConfig(16, 16, 64))


# ---- GPU: the real kernels on large random shapes ----------------------------------------------

# On sm90 the FP8 tensor-core accumulator keeps fewer bits than fp32 (measured 51-55 dB against the
# exact reference with Triton's default fast accumulation, on the H200): GPU results are checked
# against the exact reference by SQNR, far above the FP8 quantization noise (~28 dB).
FAST_ACCUM_MIN_SQNR = 45.0


@pytest.mark.parametrize("kind", ["skewed", "empty"])
@pytest.mark.parametrize("mode", ["rowwise", "tensorwise", "blockwise"])
@pytest.mark.gpu
@needs_cuda
def test_gpu_2d3d_large(kind, mode, poisoned_empty):
    M, used = 4133, 4000
    x, w, offs, a, sa, b, sb = _problem_2d3d(M, 1024, 2048, 8, used, kind, mode, device="cuda")
    ref = emulated_grouped_mm_2d3d(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), offs.cpu(), torch.float32)
    out = triton_grouped_mm_2d3d(a, sa, b, sb, offs, torch.float32)
    assert bool((out[used:] == 0).all())
    assert sqnr(ref, out) >= FAST_ACCUM_MIN_SQNR
    assert sqnr(reference_grouped_mm(x, w, offs.cpu()), out) >= (28 if mode != "tensorwise" else 25)


@pytest.mark.gpu
@needs_cuda
def test_gpu_2d3d_precise_accum():
    # Promoting the accumulator every 128-deep slice is CUTLASS's non-fast-accum scheme: on the
    # H200 the bf16 outputs were identical to torch._scaled_grouped_mm(use_fast_accum=False).
    _, _, offs, a, sa, b, sb = _problem_2d3d(3001, 2048, 1024, 8, 3001, "skewed", device="cuda")
    precise = GemmConfig(128, 128, 128, 8, 4, 8, fast_accum=False)
    out = triton_grouped_mm_2d3d(a, sa, b, sb, offs, torch.float32, config=precise)
    ref = emulated_grouped_mm_2d3d(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), offs.cpu(), torch.float32)
    assert sqnr(ref, out) >= FAST_ACCUM_MIN_SQNR
    if hasattr(torch, "_scaled_grouped_mm") and torch.cuda.get_device_capability()[0] == 9:
        ours = triton_grouped_mm_2d3d(a, sa, b, sb, offs, config=precise)
        theirs = torch._scaled_grouped_mm(a, b.transpose(-2, -1), sa, sb, offs=offs, out_dtype=torch.bfloat16)
        assert sqnr(theirs.float(), ours.float()) >= 60


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(not hasattr(torch, "_scaled_grouped_mm"), reason="no torch._scaled_grouped_mm")
def test_gpu_2d3d_vs_scaled_grouped_mm():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("torch._scaled_grouped_mm rowwise needs sm90")
    _, _, offs, a, sa, b, sb = _problem_2d3d(8192, 2048, 4096, 8, 8192, "skewed", device="cuda")
    ours = triton_grouped_mm_2d3d(a, sa, b, sb, offs)
    theirs = torch._scaled_grouped_mm(a, b.transpose(-2, -1), sa, sb, offs=offs, out_dtype=torch.bfloat16)
    assert sqnr(theirs.float(), ours.float()) >= FAST_ACCUM_MIN_SQNR - 5  # both bf16-rounded


@pytest.mark.parametrize("layout", ["row", "col"])
@pytest.mark.gpu
@needs_cuda
def test_gpu_2d2d_large(layout):
    dy, x, offs, a, sa, b, sb = _problem_2d2d(6007, 1024, 2048, 8, 6000, "empty")
    if layout == "col":
        a, b = _col_major(a), _col_major(b)
    ref = emulated_grouped_mm_2d2d(a, sa, b, sb, offs, torch.float32)
    out = triton_grouped_mm_2d2d(*(t.cuda() for t in (a, sa, b, sb, offs)), torch.float32)
    assert sqnr(ref, out) >= FAST_ACCUM_MIN_SQNR
    empty = ref.flatten(1).abs().amax(1) == 0
    assert bool((out.cpu()[empty] == 0).all())


@pytest.mark.parametrize("layout", ["row", "col"])
@pytest.mark.gpu
@needs_cuda
def test_gpu_2d2d_bf16_accumulates(layout):
    """Unscaled bf16 operands added into a transposed ``(E, N, K)`` target on the GPU (the fused
    weight-gradient accumulation): each element within one bf16 rounding plus the fp32 summation's
    bound (rows x 2^-24 x sum |a||b|) of the fp64 ``old + a_g^T @ b_g``; empty groups keep their bits."""
    dy, x, offs, *_ = _problem_2d2d(6007, 1024, 2048, 8, 6000, "empty")
    a, b = dy.bfloat16(), x.bfloat16()
    if layout == "col":
        a, b = _col_major(a), _col_major(b)
    gen = torch.Generator(device="cuda").manual_seed(2)
    target = torch.randn(8, 2048, 1024, device="cuda", generator=gen).bfloat16().transpose(1, 2)
    before = target.clone()
    out = triton_grouped_mm_2d2d(a.cuda(), None, b.cuda(), None, offs.cuda(), accumulate_into=target)
    assert out is target
    sizes = torch.diff(offs, prepend=offs.new_zeros(1)).cuda()
    assert bool((sizes == 0).any()) and bool((sizes > 0).any())
    expected = before.double() + _reference_wgrad(a.float(), b.float(), offs).cuda()
    magnitude = _reference_wgrad(a.float().abs(), b.float().abs(), offs).cuda()
    bound = ulp(expected, torch.bfloat16).double() / 2 + sizes.double().amax() * 2.0**-24 * magnitude
    assert bool(((out.double() - expected).abs() <= bound).all())
    assert torch.equal(out[sizes == 0].view(torch.int16), before[sizes == 0].view(torch.int16))
