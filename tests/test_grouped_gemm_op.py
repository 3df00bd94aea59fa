"""fp8_grouped_mm on the CPU: numerics per recipe, gradients, edge cases, weight cache, bad input.

The emulated backend is the exact reference; the triton backend runs its kernel in the Triton
interpreter (TRITON_INTERPRET=1), so its shapes stay small.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import moe_fp8
from moe_fp8 import Fp8WeightCache, fp8_grouped_mm
from moe_fp8.grouped_gemm import autograd, compiled_cache, emulated_grouped_mm_2d2d, emulated_grouped_mm_2d3d, quant_seam
from moe_fp8.quant import E4M3FN, quantize_expert_colwise, quantize_group_colwise, quantize_rowwise
from moe_fp8.quant.recipes import get_recipe
from moe_fp8.testing import OFFSET_KINDS, random_offsets, sqnr

FP8_RECIPES = ("rowwise", "rowwise_gw_hp", "tensorwise", "blockwise")
needs_interpreter = pytest.mark.interpreter  # skipped by tests/conftest.py unless TRITON_INTERPRET=1


def ref_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Differentiable ``x[rows of g] @ w[g].T`` (zero past ``offs[-1]``) in the inputs' dtype."""
    parts, start = [], 0
    for g, end in enumerate(offs.tolist()):
        parts.append(x[start:end] @ w[g].T)
        start = end
    parts.append(x[start:] @ w[0].T * 0)
    return torch.cat(parts)


def make_inputs(M, K, N, E, used, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(E, N, K, generator=gen) * 0.05).to(torch.bfloat16).requires_grad_()
    g = torch.randn(M, N, generator=gen).to(torch.bfloat16)
    offs = random_offsets(used, E, kind, generator=gen)
    return x, w, g, offs


def run(x, w, g, offs, **kw):
    y = fp8_grouped_mm(x, w, offs, **kw)
    dx, dw = torch.autograd.grad(y, (x, w), g)
    return y, dx, dw


def fp64_reference(x, w, g, offs):
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y = ref_grouped_mm(x64, w64, offs)
    dx, dw = torch.autograd.grad(y, (x64, w64), g.double())
    return y, dx, dw


# SQNR floors (dB) of (out, dgrad, wgrad) on Gaussian data; e4m3 rowwise gives ~28.5 dB.
SQNR_FLOORS = {
    "rowwise": (28, 28, 25),
    "rowwise_gw_hp": (28, 28, 45),
    "tensorwise": (25, 25, 25),
    "blockwise": (27, 27, 45),
    "bf16": (45, 45, 45),
}


@pytest.mark.parametrize("kind", OFFSET_KINDS)
@pytest.mark.parametrize("recipe", [*FP8_RECIPES, "bf16"])
def test_sqnr_against_fp64(recipe, kind):
    # 250 of 272 rows used (tail rows), group sizes not multiples of 16; K > 128 so blockwise has 2 blocks.
    seed = zlib.crc32(f"{recipe}-{kind}".encode()) % 1000  # the same seed in every process
    x, w, g, offs = make_inputs(272, 192, 64, 5, 250, kind, seed=seed)
    y, dx, dw = run(x, w, g, offs, recipe=recipe, backend="emulated")
    ry, rdx, rdw = fp64_reference(x, w, g, offs)
    floors = SQNR_FLOORS[recipe]
    got = (sqnr(ry, y), sqnr(rdx, dx), sqnr(rdw, dw))
    assert all(s >= f for s, f in zip(got, floors)), f"SQNR (out, dgrad, wgrad) {got} below {floors}"
    assert y.dtype == torch.bfloat16 and dx.dtype == x.dtype and dw.dtype == w.dtype
    assert torch.all(y[250:] == 0) and torch.all(dx[250:] == 0)


@pytest.mark.parametrize("pow2", [True, False], ids=["pow2_scales", "exact_scales"])
def test_rowwise_gradients_equal_reference_pipeline(pow2):
    """The autograd op runs exactly: quantize (reference) -> emulated GEMM, in all three GEMMs."""
    x, w, g, offs = make_inputs(80, 64, 32, 4, 75, "skewed", seed=3)
    y, dx, dw = run(x, w, g, offs, recipe=get_recipe("rowwise", pow2_scales=pow2), backend="emulated")
    xq, xs = quantize_rowwise(x.detach(), E4M3FN, pow2=pow2)
    wq, ws = quantize_expert_colwise(w.detach(), E4M3FN, pow2=pow2)
    wtq, wts = quantize_expert_colwise(w.detach(), E4M3FN, pow2=pow2, transposed=True)
    gq, gs = quantize_rowwise(g, E4M3FN, pow2=pow2)
    gcq, gcs = quantize_group_colwise(g, offs, E4M3FN, pow2=pow2)
    xcq, xcs = quantize_group_colwise(x.detach(), offs, E4M3FN, pow2=pow2)
    assert torch.equal(y, emulated_grouped_mm_2d3d(xq, xs, wq, ws, offs))
    assert torch.equal(dx, emulated_grouped_mm_2d3d(gq, gs, wtq, wts, offs))
    assert torch.equal(dw, emulated_grouped_mm_2d2d(gcq, gcs, xcq, xcs, offs))


def test_bf16_recipe_equals_torch_grouped_mm():
    x, w, g, offs = make_inputs(100, 32, 16, 3, 90, "balanced", seed=4)
    g[90:] = 0  # torch leaves the tail rows undefined; ours are constant zeros
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    dx, dw = torch.autograd.grad(y, (x, w), g)
    y2, dx2, dw2 = run(x, w, g, offs, recipe="bf16", backend="emulated")
    assert torch.equal(y[:90], y2[:90]) and torch.equal(dx[:90], dx2[:90]) and torch.equal(dw, dw2)


@needs_interpreter
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_triton_backend_matches_emulated(recipe):
    # One 128-wide block and a partial one (K = 160) for blockwise; ragged, skewed groups.
    x, w, g, offs = make_inputs(70, 160, 32, 3, 66, "skewed", seed=5)
    want = run(x, w, g, offs, recipe=recipe, backend="emulated")
    got = run(x, w, g, offs, recipe=recipe, backend="triton")
    for name, a, b in zip(("out", "dgrad", "wgrad"), got, want):
        # Same FP8 operands and scales; only the fp32 summation order may differ (1 bf16 ulp).
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-5, msg=name)


@pytest.mark.parametrize("backend", ["emulated", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("recipe", FP8_RECIPES)
@pytest.mark.parametrize("junk", [float("nan"), 1e30])
def test_rows_past_the_groups_never_reach_a_result(recipe, backend, junk):
    """Rows at or past ``offs[-1]`` (of x and of grad_out) may hold anything: the used rows of the
    output and of dx, and dw, equal those of a run with zeros there (tensorwise: one scale)."""
    x, w, g, offs = make_inputs(32, 32, 16, 2, 24, "balanced", seed=9)
    clean = run(x, w, g, offs, recipe=recipe, backend=backend)
    with torch.no_grad():
        x[24:] = junk
    dirty_g = g.clone()
    dirty_g[24:] = junk
    dirty = run(x, w, dirty_g, offs, recipe=recipe, backend=backend)
    for name, a, b, n in zip(("out", "dgrad", "wgrad"), dirty, clean, (24, 24, None)):
        assert torch.equal(a[:n], b[:n]), name


def test_single_expert_matches_dense():
    x, w, g, _ = make_inputs(48, 32, 16, 1, 48, "balanced", seed=7)
    offs = torch.tensor([48], dtype=torch.int32)
    y, _, _ = run(x, w, g, offs, recipe="bf16", backend="emulated")
    assert torch.equal(y, x @ w[0].T)


def test_non_contiguous_inputs():
    x, w, g, offs = make_inputs(64, 32, 16, 2, 60, "balanced", seed=9)
    xt = x.detach().t().contiguous().t().requires_grad_()  # column-major copy
    y1 = fp8_grouped_mm(x, w, offs, backend="emulated")
    y2 = fp8_grouped_mm(xt, w, offs, backend="emulated")
    assert torch.equal(y1, y2)


@pytest.mark.parametrize("backend", ["emulated", pytest.param("triton", marks=needs_interpreter)])
def test_x_only_or_w_only_gradients(backend, monkeypatch):
    """Either gradient alone equals the pair's. With both, on the fused kernels (triton), the
    forward's row quantization of x and the dgrad's of grad_out hand the wgrad their per-group
    column amaxes (two calls); with x quantized upstream, a read of x alone gives x's (one call of
    each) where its groups average ``UPSTREAM_AMAX_MIN_ROWS_PER_GROUP`` rows or more; with either
    gradient alone, or on the reference quantizers (emulated), nothing does
    (the wgrad reduces both)."""
    calls, alone = [], []
    real = quant_seam.quantize_activation_group_amax
    monkeypatch.setattr(quant_seam, "quantize_activation_group_amax", lambda *a: calls.append(1) or real(*a))
    real_alone = quant_seam.group_amax
    monkeypatch.setattr(quant_seam, "group_amax", lambda *a: alone.append(1) or real_alone(*a))
    x, w, g, offs = make_inputs(48, 32, 16, 2, 40, "skewed", seed=10)
    (dx,) = torch.autograd.grad(fp8_grouped_mm(x, w.detach(), offs, backend=backend), (x,), g)
    (dw,) = torch.autograd.grad(fp8_grouped_mm(x.detach(), w, offs, backend=backend), (w,), g)
    assert not calls
    _, dx2, dw2 = run(x, w, g, offs, backend=backend)
    fused = backend == "triton"
    assert len(calls) == (2 if fused else 0) and not alone
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2)
    x_fp8 = moe_fp8.quant.quantize_rowwise(x.detach(), E4M3FN)  # x's rows quantized upstream (FP8MoE)
    for min_rows, asked in ((24, fused), (25, False)):  # 48 rows in 2 groups: 24 per group
        calls.clear()
        alone.clear()
        monkeypatch.setattr(autograd, "UPSTREAM_AMAX_MIN_ROWS_PER_GROUP", min_rows)
        _, dx3, dw3 = run(x, w, g, offs, backend=backend, x_fp8=x_fp8)
        assert len(calls) == len(alone) == int(asked), min_rows
        assert torch.equal(dx, dx3) and torch.equal(dw, dw3)


@pytest.mark.parametrize("backend", ["emulated", pytest.param("triton", marks=needs_interpreter)])
def test_tensorwise_gradients_alone_equal_the_pair(backend):
    """tensorwise: the wgrad takes the forward's FP8 x and, with dx wanted, the dgrad's FP8 grad_out;
    without dx it quantizes grad_out itself: the same dw either way (and dx alone the same dx)."""
    x, w, g, offs = make_inputs(48, 32, 16, 2, 40, "skewed", seed=11)
    (dx,) = torch.autograd.grad(fp8_grouped_mm(x, w.detach(), offs, recipe="tensorwise", backend=backend), (x,), g)
    (dw,) = torch.autograd.grad(fp8_grouped_mm(x.detach(), w, offs, recipe="tensorwise", backend=backend), (w,), g)
    _, dx2, dw2 = run(x, w, g, offs, recipe="tensorwise", backend=backend)
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2)
    assert bool((dx[40:] == 0).all())


@needs_interpreter
def test_long_rows_take_no_group_amax(monkeypatch, long_rows):
    """Rows longer than the one-read kernels hold, both gradients wanted: the forward asks no
    per-group amax of x's row quantization (its fallback would be another pass, and a host sync on
    the GPU), so the wgrad's dual reduces both."""
    calls = []
    real = quant_seam.quantize_activation_group_amax
    monkeypatch.setattr(quant_seam, "quantize_activation_group_amax", lambda *a: calls.append(1) or real(*a))
    x, w, g, offs = make_inputs(16, long_rows, 16, 2, 14, "skewed", seed=13)
    got = run(x, w, g, offs, backend="triton")
    assert not calls
    want = run(x, w, g, offs, backend="emulated")
    for a, b, what in zip(got, want, ("y", "dx", "dw")):
        assert sqnr(a, b) > 40, what


# ----------------------------------------------------------------------------- weight cache
def test_weight_cache_hits_and_matches_uncached():
    """Micro-batches of one weight state: the first keeps nothing (without a second its copies would
    never be read again), the second keeps both layouts, the third hits; bit-equal to uncached."""
    x, w, g, offs = make_inputs(48, 32, 16, 2, 48, "skewed", seed=11)
    E, N, K = w.shape  # rowwise: two fp8 layouts + (E, N), (E, K) scales; tensorwise: two + (E,) twice
    rowwise, tensorwise = 2 * E * N * K + 4 * E * (N + K), 2 * E * N * K + 4 * 2 * E
    cache = Fp8WeightCache()
    want = run(x, w, g, offs, backend="emulated")
    for i in range(3):  # three micro-batches
        got = run(x, w, g, offs, backend="emulated", weight_cache=cache)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert cache.nbytes == (0 if i == 0 else rowwise)
    assert (cache.misses, cache.hits) == (2, 1)
    for _ in range(2):
        run(x, w, g, offs, recipe="tensorwise", backend="emulated", weight_cache=cache)
    assert cache.misses == 4 and len(cache) == 2  # separate entry per quantization settings
    assert cache.nbytes == rowwise + tensorwise


@pytest.mark.parametrize("recipe", [pytest.param("rowwise", marks=needs_interpreter), "tensorwise", "blockwise"])
@pytest.mark.parametrize("transposed", [False, True])
def test_cached_weight_gemm_off_the_default_stream(monkeypatch, recipe, transposed):
    """The compiled graph's cached GEMM op off a CUDA device's default stream (where CUDA graphs
    run): each GEMM quantizes only the layout it reads, stores nothing, and gives the bytes of the
    GEMM on the cached layouts."""
    backend = "triton" if recipe == "rowwise" else "emulated"
    x, w, g, offs = make_inputs(48, 32, 48, 3, 45, "skewed", seed=14)
    param = w.detach().transpose(1, 2).contiguous() if transposed else w.detach()
    rec = moe_fp8.quant.get_recipe(recipe)
    quantized = dict(fwd=quant_seam.quantize_activation(x, rec.scaling, E4M3FN, False, True),
                     dgrad=quant_seam.quantize_activation(g, rec.scaling, E4M3FN, False, True))
    args = lambda dgrad: (backend, *quantized["dgrad" if dgrad else "fwd"], param, transposed, offs,  # noqa: E731
                          torch.bfloat16, dgrad, rec.scaling, "e4m3fn", False, True, True)
    cache = compiled_cache.compiled_weight_cache()
    want = [compiled_cache.mm_2d3d_cached_weight(*args(dgrad)) for dgrad in (False, True)]
    entries = len(cache)
    calls = []
    real_layout, real_both = quant_seam.quantize_weight_layout, quant_seam.quantize_weight
    monkeypatch.setattr(quant_seam, "quantize_weight_layout",
                        lambda *a: calls.append(("layout", "dgrad" if a[-1] else "fwd")) or real_layout(*a))
    monkeypatch.setattr(quant_seam, "quantize_weight", lambda *a: calls.append("both") or real_both(*a))
    monkeypatch.setattr(compiled_cache, "off_default_stream", lambda w: True)
    cache.invalidate()
    got = [compiled_cache.mm_2d3d_cached_weight(*args(dgrad)) for dgrad in (False, True)]
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and entries > 0 and len(cache) == 0
    assert calls == [("layout", "fwd"), ("layout", "dgrad")]  # never both layouts for one GEMM


@pytest.mark.parametrize("recipe", [pytest.param("rowwise", marks=needs_interpreter), "tensorwise"])
def test_cached_weight_gemm_keeps_layouts_where_read_again(monkeypatch, recipe):
    """The compiled graph's cached GEMM op on the default stream, three forward + dgrad pairs on one
    weight state: the first keeps no layout (its forward quantizes the forward layout and, rowwise,
    leaves the dgrad layout's amax, from which its dgrad quantizes), the second keeps both, the
    third quantizes nothing; every GEMM gives the bytes of the GEMM on quantize_weight's layouts."""
    backend = "triton" if recipe == "rowwise" else "emulated"
    x, w, g, offs = make_inputs(48, 32, 48, 3, 45, "skewed", seed=15)
    param, rec = w.detach().clone(), get_recipe(recipe)
    act = [quant_seam.quantize_activation(t, rec.scaling, E4M3FN, False, True) for t in (x, g)]
    layouts = quant_seam.quantize_weight(param, rec.scaling, E4M3FN, False, True)
    want = [compiled_cache.lib.mm_2d3d(backend, *act[0], *layouts[:2], offs, torch.bfloat16),
            compiled_cache.lib.mm_2d3d(backend, *act[1], *layouts[2:], offs, torch.bfloat16)]
    calls = []
    for name in ("quantize_weight", "quantize_weight_layout", "quantize_weight_forward_layout",
                 "quantize_weight_dgrad_layout"):
        real = getattr(quant_seam, name)
        monkeypatch.setattr(quant_seam, name, lambda *a, _n=name, _f=real, **k: calls.append(_n) or _f(*a, **k))
    cache = compiled_cache.compiled_weight_cache()
    made, held = [], []
    for _ in range(3):
        calls.clear()
        got = [compiled_cache.mm_2d3d_cached_weight(backend, *act[dgrad], param, False, offs, torch.bfloat16, bool(dgrad),
                                                    rec.scaling, "e4m3fn", False, True, True) for dgrad in (0, 1)]
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        made.append(list(calls))
        held.append(cache.nbytes_of([param]))
    E, N, K = param.shape
    if recipe == "rowwise":
        assert made[0] == ["quantize_weight_forward_layout", "quantize_weight_dgrad_layout"]
    else:
        assert made[0] == ["quantize_weight_layout", "quantize_weight_layout"]
    assert made[1:] == [["quantize_weight"], []]
    assert held[0] == (4 * E * K if recipe == "rowwise" else 0) and held[1] == held[2] >= 2 * E * N * K


def _saved_for_backward(fn) -> list[tuple[tuple, torch.dtype]]:
    """(shape, dtype) of every tensor autograd saves while ``fn()`` runs."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


@pytest.mark.parametrize("backend", ["emulated", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed view"])
def test_uncached_rowwise_saves_no_fp8_weight_copy(layout, backend):
    """Without a cache, a parameter's dgrad layout is quantized in backward, not saved from the
    forward: nothing fp8 of the weight's size is saved, and the results are the bits of the dual
    quantization (a computed weight, ``w * 1``, and the cache both take that path)."""
    x, w, g, offs = make_inputs(48, 32, 48, 3, 45, "skewed", seed=12)
    if layout == "transposed view":
        storage = w.detach().transpose(1, 2).contiguous().requires_grad_()
        w = storage.transpose(1, 2)
    saved = _saved_for_backward(lambda: fp8_grouped_mm(x, w, offs, backend=backend))
    assert not [s for s in saved if s[1] == torch.float8_e4m3fn]
    dual_saved = _saved_for_backward(lambda: fp8_grouped_mm(x, w * 1, offs, backend=backend))
    assert ((3, 32, 48), torch.float8_e4m3fn) in dual_saved  # the dgrad layout, kept from forward
    split = run(x, w, g, offs, backend=backend)
    for want in (run(x, w * 1, g, offs, backend=backend),
                 run(x, w, g, offs, backend=backend, weight_cache=Fp8WeightCache())):
        assert all(torch.equal(a, b) for a, b in zip(split, want))
    (dx,) = torch.autograd.grad(fp8_grouped_mm(x, w.detach(), offs, backend=backend), (x,), g)
    assert torch.equal(dx, split[1])  # a frozen (leaf) weight takes the same path


@pytest.mark.parametrize("backend", ["emulated", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("recipe", ["bf16", "rowwise"])
def test_transposed_view_weights_match_contiguous(recipe, backend):
    """w given as the transposed view of (E, K, N) storage (Llama 4's layout): same bits as the
    contiguous copy, the gradient in the storage's own layout (contiguous: autograd keeps it and
    adds to it without a strided copy), and the weight cache hits across views."""
    x, w, g, offs = make_inputs(48, 32, 48, 3, 45, "balanced", seed=11)
    storage = w.detach().transpose(1, 2).contiguous().requires_grad_()  # (E, K, N)
    want = run(x, w, g, offs, recipe=recipe, backend=backend)
    y = fp8_grouped_mm(x, storage.transpose(1, 2), offs, recipe=recipe, backend=backend)
    y.backward(g)
    assert torch.equal(y, want[0])
    assert torch.equal(storage.grad.transpose(1, 2), want[2])
    (dw,) = torch.autograd.grad(fp8_grouped_mm(x, storage.transpose(1, 2), offs, recipe=recipe, backend=backend),
                                (storage,), g)  # as the GEMMs made it, before autograd accumulates it
    assert torch.equal(dw, storage.grad) and dw.is_contiguous()
    if recipe != "bf16":
        cache = Fp8WeightCache()
        for _ in range(3):  # a new view object every call, as a module makes it
            fp8_grouped_mm(x, storage.transpose(1, 2), offs, recipe=recipe, backend=backend, weight_cache=cache)
        assert (cache.misses, cache.hits) == (2, 1)  # the first call keeps nothing


def test_weight_cache_invalidated_by_in_place_update():
    x, w, g, offs = make_inputs(48, 32, 16, 2, 48, "balanced", seed=12)
    cache = Fp8WeightCache()
    before = fp8_grouped_mm(x, w, offs, backend="emulated", weight_cache=cache)
    with torch.no_grad():
        w.mul_(-2)  # what an optimizer step does: bumps w._version
    after = fp8_grouped_mm(x, w, offs, backend="emulated", weight_cache=cache)
    assert cache.misses == 2 and cache.hits == 0
    assert torch.equal(after, fp8_grouped_mm(x, w, offs, backend="emulated"))
    assert not torch.equal(after, before)


def test_weight_cache_data_writes_need_invalidate():
    x, w, g, offs = make_inputs(48, 32, 16, 2, 48, "balanced", seed=13)
    cache = Fp8WeightCache()
    fp8_grouped_mm(x, w, offs, backend="emulated", weight_cache=cache)
    w.data.mul_(-2)  # bypasses the version counter (documented): the caller must invalidate
    cache.invalidate()
    after = fp8_grouped_mm(x, w, offs, backend="emulated", weight_cache=cache)
    assert cache.misses == 2 and torch.equal(after, fp8_grouped_mm(x, w, offs, backend="emulated"))


@pytest.mark.parametrize("recipe, with_cache", [("rowwise", False), ("bf16", True)])
def test_weight_cache_stand_in_needs_its_cache_and_an_fp8_recipe(recipe, with_cache):
    x, w, _, offs = make_inputs(32, 32, 16, 2, 32, "balanced", seed=12)
    cache = Fp8WeightCache()
    stand_in = cache.stand_in(w.detach().float(), torch.bfloat16)
    with pytest.raises(ValueError, match="stand_in"):
        fp8_grouped_mm(x, stand_in, offs, recipe=recipe, backend="emulated", weight_cache=cache if with_cache else None)


def test_weight_cache_never_serves_another_tensor():
    x, w, g, offs = make_inputs(48, 32, 16, 2, 48, "balanced", seed=14)
    cache = Fp8WeightCache()
    fp8_grouped_mm(x, w, offs, backend="emulated", weight_cache=cache)
    w2 = (w.detach() * 3).requires_grad_()
    y2 = fp8_grouped_mm(x, w2, offs, backend="emulated", weight_cache=cache)
    assert cache.hits == 0 and torch.equal(y2, fp8_grouped_mm(x, w2, offs, backend="emulated"))
    del w2, y2  # (the graph of y2 holds w2 too)
    fp8_grouped_mm(x, w, offs, backend="emulated", weight_cache=cache)
    assert len(cache) == 1  # the dead tensor's entry was dropped


def test_weight_cache_bypassed_while_a_cuda_graph_is_captured(monkeypatch):
    """During a capture (faked here; the H200 test replays a real graph) the cache is neither read
    nor filled, for a plain weight and a stand-in: a hit would freeze the FP8 copy into the graph."""
    x, w, g, offs = make_inputs(48, 32, 16, 2, 48, "skewed", seed=16)
    cache = Fp8WeightCache()
    fp8_grouped_mm(x, w, offs, backend="emulated", weight_cache=cache)  # an entry a capture must not use
    with torch.no_grad():
        w.mul_(-2)
    want = run(x, w, g, offs, backend="emulated")
    stand_in_src = w.detach().float().requires_grad_()
    monkeypatch.setattr(Fp8WeightCache, "bypassed", staticmethod(lambda t: True))
    got = run(x, w, g, offs, backend="emulated", weight_cache=cache)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    saved = _saved_for_backward(lambda: fp8_grouped_mm(x, w, offs, backend="emulated", weight_cache=cache))
    assert not [s for s in saved if s[1] == torch.float8_e4m3fn]  # the uncached path: no FP8 weight copy saved
    key = ("rowwise", "e4m3fn", False, False)
    assert cache.get(w, key, lambda t: (t * 1,))[0].equal(w)  # get() itself: quantized afresh, nothing stored
    y = fp8_grouped_mm(x, cache.stand_in(stand_in_src, torch.bfloat16), offs, backend="emulated", weight_cache=cache)
    y.backward(g)
    assert torch.equal(y, want[0]) and torch.equal(stand_in_src.grad, want[2].float())
    assert (cache.misses, cache.hits, len(cache)) == (1, 0, 1)
    monkeypatch.undo()
    fp8_grouped_mm(x, w, offs, backend="emulated", weight_cache=cache)
    assert (cache.misses, cache.hits) == (2, 0)  # the stale entry was replaced, not served


# ----------------------------------------------------------------------------- torch.compile
@needs_interpreter
@pytest.mark.parametrize("recipe", [*FP8_RECIPES, "bf16"])
def test_compile_fullgraph_matches_eager(recipe):
    x, w, g, offs = make_inputs(40, 32, 16, 3, 36, "skewed", seed=15)
    torch._dynamo.reset()
    compiled = torch.compile(fp8_grouped_mm, fullgraph=True, backend="aot_eager")
    y = compiled(x, w, offs, recipe=recipe, backend="triton")
    got = (y, *torch.autograd.grad(y, (x, w), g))
    want = run(x, w, g, offs, recipe=recipe, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@needs_interpreter
@pytest.mark.parametrize("recipe", [*FP8_RECIPES, "bf16"])
def test_compile_transposed_view_weights_match_eager(recipe):
    """(E, K, N) storage read through its transposed view, compiled: the same bits as eagerly, and
    the weight gradient in the storage's own layout."""
    x, w, g, offs = make_inputs(40, 32, 16, 3, 36, "skewed", seed=16)
    storage = w.detach().transpose(1, 2).contiguous().requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(fp8_grouped_mm, fullgraph=True, backend="aot_eager")
    got = []
    for gemm in (compiled, fp8_grouped_mm):
        y = gemm(x, storage.transpose(1, 2), offs, recipe=recipe, backend="triton")
        got.append((y, *torch.autograd.grad(y, (x, storage), g)))
    assert all(torch.equal(a, b) for a, b in zip(*got))
    assert got[0][2].is_contiguous()


# ----------------------------------------------------------------------------- bad input
def _good():
    return (
        torch.randn(32, 32, dtype=torch.bfloat16),
        torch.randn(2, 16, 32, dtype=torch.bfloat16),
        torch.tensor([10, 32], dtype=torch.int32),
    )


@pytest.mark.parametrize("backend", ["emulated", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("recipe", [*FP8_RECIPES, "bf16"])
def test_wgrad_offsets_group_the_weight_gradient(recipe, backend, monkeypatch):
    """``wgrad_offs``: experts 1 and 3 have no forward rows but one zero row each in the weight
    gradient's groups (row 10, which the forward gives expert 2, and row 31, past the forward's
    last group): the wgrad GEMM gets no empty group, the output and dx are those of the plain
    call, the other experts' dw too (up to the fp32 summation order), and experts 1 and 3 get exact
    zeros from their one-row reductions."""
    if backend == "triton" and recipe == "bf16":
        pytest.skip("the bf16 recipe runs torch._grouped_mm on every backend")
    from moe_fp8.grouped_gemm import library as lib

    x, w, g, _ = make_inputs(40, 32, 16, 4, 32, "balanced", seed=12)
    with torch.no_grad():
        x[10] = x[31] = 0
    g[10] = g[31] = 0
    offs = torch.tensor([10, 10, 31, 31], dtype=torch.int32)
    wgrad_offs = torch.tensor([10, 11, 31, 32], dtype=torch.int32)
    want = run(x, w, g, offs, recipe=recipe, backend=backend)
    seen = []
    for name, at in (("mm_2d2d", 5), ("bf16_mm_2d2d", 3)):
        op = getattr(lib, name)
        monkeypatch.setattr(lib, name, lambda *args, op=op, at=at: seen.append(args[at]) or op(*args))
    got = run(x, w, g, offs, recipe=recipe, backend=backend, wgrad_offs=wgrad_offs)
    assert len(seen) == 1 and (torch.diff(seen[0], prepend=seen[0].new_zeros(1)) > 0).all(), seen
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not got[2][[1, 3]].any() and got[2][[0, 2]].abs().sum() > 0
    torch.testing.assert_close(got[2].float(), want[2].float(), rtol=2**-7, atol=1e-5)


def test_wgrad_offsets_equal_to_offs_are_checked_once(monkeypatch):
    """``wgrad_offs=offs`` (a plan without ``empty_group_rows`` hands the same tensor twice) is the
    plain call: the offsets are checked (a host sync on the CPU) once, not twice."""
    from moe_fp8.grouped_gemm import op

    checked = []
    real = op._safe_offsets
    monkeypatch.setattr(op, "_safe_offsets", lambda offs, rows, name: checked.append(name) or real(offs, rows, name))
    x, w, offs = _good()
    assert torch.equal(fp8_grouped_mm(x, w, offs, backend="emulated", wgrad_offs=offs),
                       fp8_grouped_mm(x, w, offs, backend="emulated"))
    assert checked == ["offs", "offs"]


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda x, w, o: (x[:, :24], w[:, :, :24], o), ValueError, "K"),
        (lambda x, w, o: (x, w[:, :8], o), ValueError, "N"),
        (lambda x, w, o: (x.to(torch.float8_e4m3fn), w, o), TypeError, "x"),
        (lambda x, w, o: (x.long(), w, o), TypeError, "x"),
        (lambda x, w, o: (x, w.half(), o), TypeError, "w"),
        (lambda x, w, o: (x[0], w, o), ValueError, "x"),
        (lambda x, w, o: (x, w[0], o), ValueError, "w"),
        (lambda x, w, o: (x, w[:, :, :16], o), ValueError, "w"),
        (lambda x, w, o: (x, w, o.long()), TypeError, "offs"),
        (lambda x, w, o: (x, w, o.float()), TypeError, "offs"),
        (lambda x, w, o: (x, w, o[None]), ValueError, "offs"),
        (lambda x, w, o: (x, w, o[:1]), ValueError, "offs"),
        (lambda x, w, o: (x, w, torch.stack([o, o], 1)[:, 0]), ValueError, "contiguous"),
        (lambda x, w, o: (x, w, [10, 32]), TypeError, "offs"),
        (lambda x, w, o: (x, w, torch.tensor([20, 10], dtype=torch.int32)), ValueError, "offs"),
        (lambda x, w, o: (x, w, torch.tensor([10, 33], dtype=torch.int32)), ValueError, "offs"),
        (lambda x, w, o: (x, w, torch.tensor([-1, 10], dtype=torch.int32)), ValueError, "offs"),
        (lambda x, w, o: (x, w[:0], o[:0]), ValueError, "w"),
        (lambda x, w, o: ("x", w, o), TypeError, "x"),
    ],
)
def test_bad_input(change, error, match):
    x, w, offs = change(*_good())
    with pytest.raises(error, match=match):
        fp8_grouped_mm(x, w, offs, backend="emulated")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"recipe": "fp4"}, ValueError, "recipe"),
        ({"recipe": 3}, TypeError, "recipe"),
        ({"recipe": moe_fp8.get_recipe("rowwise").replace(grad_format="e5m2")}, ValueError, "grad_format"),
        ({"out_dtype": torch.int32}, TypeError, "out_dtype"),
        ({"weight_cache": {}}, TypeError, "weight_cache"),
        ({"backend": "cutlass"}, ValueError, "cutlass"),
        ({"backend": "cuda"}, ValueError, "cuda"),
        ({"backend": "rocm"}, ValueError, "rocm"),
        ({"wgrad_offs": torch.tensor([10, 32])}, TypeError, "wgrad_offs"),
        ({"wgrad_offs": torch.tensor([32], dtype=torch.int32)}, ValueError, "wgrad_offs: expected length 2"),
        ({"wgrad_offs": torch.tensor([20, 10], dtype=torch.int32)}, ValueError, "wgrad_offs: expected non-decreasing"),
        ({"wgrad_offs": torch.tensor([10, 33], dtype=torch.int32)}, ValueError, r"wgrad_offs\[-1\] <= 32"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    x, w, offs = _good()
    kwargs.setdefault("backend", "emulated")
    with pytest.raises(error, match=match):
        fp8_grouped_mm(x, w, offs, **kwargs)
