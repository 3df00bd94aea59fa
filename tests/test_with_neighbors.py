"""The grouped GEMMs fused with the SwiGLU and the combine (``grouped_gemm.with_neighbors``): outputs and
every gradient bit for bit those of the separate ops (on the GPU the router weights' fp32 gradient to
within its summation order), whichever backward path runs (the gradients' FP8
rows from the SwiGLU / combine backward, or quantized in the GEMM where it wants their group amax),
on fresh random routing with empty experts, skewed loads, unit weights and input scales."""

from __future__ import annotations

import pytest
import torch

import moe_fp8.grouped_gemm.autograd as gemm_autograd
import moe_fp8.grouped_gemm.with_neighbors as with_neighbors
from moe_fp8 import FP8GroupedExperts, fp8_grouped_mm
from moe_fp8.grouped_gemm.with_neighbors import fp8_grouped_mm_combine, fp8_grouped_mm_swiglu
from moe_fp8.quant.formats import E4M3FN
from moe_fp8.quant.recipes import get_recipe
from moe_fp8.quant.reference import quantize_rowwise
from moe_fp8.quant.swiglu import SwiGLUQuantize
from moe_fp8.routing import combine, make_dispatch_plan

from test_routing_plan import random_topk_ids
from no_gradient import NoGradient

T, H, I, E, K = 40, 64, 32, 4, 2


def _step(experts: FP8GroupedExperts, x, ids, weights, scales, dy, fused: bool):
    """Output and gradients (x, weights, scales, parameters) of one forward + backward."""
    experts.fused_grad_quant = fused
    experts.zero_grad()
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, weights, scales)]
    out = experts(leaves[0], ids, leaves[1], input_scales=leaves[2])
    out.backward(dy)
    return [out] + [t.grad for t in leaves if t is not None] + [p.grad for p in experts.parameters()]


def _counting(monkeypatch) -> dict:
    """Counts of the fused backward kernels' calls (``swiglu``, ``combine``: with FP8 rows)."""
    calls = {"swiglu": 0, "combine": 0}
    swiglu, rows = with_neighbors.swiglu_backward_quantize, with_neighbors.combine_backward_rows

    def swiglu_counted(*a, **kw):
        calls["swiglu"] += 1
        return swiglu(*a, **kw)

    def rows_counted(*a, **kw):
        calls["combine"] += a[7] is not None
        return rows(*a, **kw)

    monkeypatch.setattr(with_neighbors, "swiglu_backward_quantize", swiglu_counted)
    monkeypatch.setattr(with_neighbors, "combine_backward_rows", rows_counted)
    return calls


@pytest.mark.slow(4)
@pytest.mark.interpreter
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp"])
@pytest.mark.parametrize("case", ["router_weights", "unit_weights", "input_scales", "fp8_saved_input", "cached",
                                  "group_amax"])
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty"])
def test_fused_backward_gives_the_bits_of_the_separate_ops(recipe, case, kind, monkeypatch):
    seed = sum(map(ord, recipe + case + kind))
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    experts = FP8GroupedExperts(E, H, I, recipe=recipe, backend="triton", cache_weights=case == "cached",
                                fp8_saved_input=case == "fp8_saved_input").to(torch.bfloat16)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = random_topk_ids(T, E, K, kind, seed=seed)
    weights = torch.rand(T, K, generator=g) if case not in ("unit_weights", "input_scales") else None
    scales = torch.rand(T, K, generator=g).bfloat16() + 0.5 if case == "input_scales" else None
    dy = (torch.randn(T, H, generator=g) * torch.pow(10.0, torch.randint(-3, 4, (T, 1), generator=g))).bfloat16()
    if case == "group_amax":  # the forward reduces x's group amax, so the dgrads reduce grad_out's themselves
        monkeypatch.setattr(gemm_autograd, "UPSTREAM_AMAX_MIN_ROWS_PER_GROUP", 1)
    calls = _counting(monkeypatch)
    steps = 2 if case == "cached" else 1  # the second step's GEMMs read the cached weights
    separate = [_step(experts, x, ids, weights, scales, dy, False) for _ in range(steps)][-1]
    assert calls == {"swiglu": 0, "combine": 0}
    fused = [_step(experts, x, ids, weights, scales, dy, True) for _ in range(steps)][-1]
    for i, (a, b) in enumerate(zip(separate, fused, strict=True)):
        assert torch.equal(a, b), i
    fused_rows = not (case == "group_amax" and recipe == "rowwise")
    assert calls == {"swiglu": steps * fused_rows, "combine": steps * fused_rows}


def _gemm_inputs(seed: int, n: int, kind: str = "skewed"):
    g = torch.Generator().manual_seed(seed)
    ids = random_topk_ids(T, E, K, kind, seed=seed)
    plan = make_dispatch_plan(ids, E)
    x = torch.randn(plan.num_rows, H, generator=g).bfloat16()
    w = (torch.randn(E, n, H, generator=g) * 0.1).bfloat16()
    return plan, x, w, g


def _grads(out, leaves, dy):
    return torch.autograd.grad(out, leaves, dy)


@pytest.mark.interpreter
def test_swiglu_function_matches_gemm_then_swiglu():
    plan, x, w, g = _gemm_inputs(1, 2 * I)
    da = torch.randn(plan.num_rows, I, generator=g).bfloat16()
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    a, q, s = fp8_grouped_mm_swiglu(x1, w1, plan.offsets, recipe="rowwise_gw_hp", backend="triton")
    assert not q.requires_grad and not s.requires_grad and q.dtype == E4M3FN.torch_dtype
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    h = fp8_grouped_mm(x2, w2, plan.offsets, recipe="rowwise_gw_hp", backend="triton")
    a2, q2, s2 = SwiGLUQuantize.apply(h, E4M3FN, True)
    assert torch.equal(a, a2) and torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    for got, want in zip(_grads(a, (x1, w1), da), _grads(a2, (x2, w2), da)):
        assert torch.equal(got, want)


@pytest.mark.interpreter
def test_combine_function_matches_gemm_then_combine():
    plan, x, w, g = _gemm_inputs(2, H, "empty")
    weights = torch.rand(T, K, generator=g)
    dy = torch.randn(T, H, generator=g).bfloat16()
    leaves1 = [t.clone().requires_grad_() for t in (x, w, weights)]
    out = fp8_grouped_mm_combine(leaves1[0], leaves1[1], plan.offsets, plan, leaves1[2], recipe="rowwise_gw_hp",
                                 backend="triton")
    leaves2 = [t.clone().requires_grad_() for t in (x, w, weights)]
    y = fp8_grouped_mm(leaves2[0], leaves2[1], plan.offsets, recipe="rowwise_gw_hp", backend="triton")
    out2 = combine(y, plan, leaves2[2])
    assert out.shape == (T, H) and torch.equal(out, out2)
    for got, want in zip(_grads(out, leaves1, dy), _grads(out2, leaves2, dy)):
        assert torch.equal(got, want)


@pytest.mark.interpreter
@pytest.mark.parametrize("recipe, x_grad, grad_mode, min_rows, fused", [
    ("rowwise_gw_hp", True, True, 1024, ["_SwiGLUGivingRows", "_CombineGivingRows"]),  # the dgrads take the rows
    ("rowwise", True, True, 1024, ["_SwiGLUGivingRows", "_CombineGivingRows"]),  # too few rows per group to
    # read x again for its group amax
    ("rowwise", True, True, 1, []),  # x's group amax from the forward: the dgrads quantize themselves
    ("rowwise_gw_hp", False, True, 1024, ["_CombineGivingRows"]),  # no dgrad for the first GEMM
    ("rowwise_gw_hp", True, False, 1024, []),  # no backward
])
def test_rows_handed_to_the_gemm_only_where_its_backward_takes_them(recipe, x_grad, grad_mode, min_rows, fused,
                                                                     monkeypatch):
    """The Functions that hand the gradient's FP8 rows to the GEMM run only where its backward
    takes them (x's rows quantized upstream, as the layer's permute makes them); elsewhere the
    separate ops run, with the same outputs and gradients."""
    monkeypatch.setattr(gemm_autograd, "UPSTREAM_AMAX_MIN_ROWS_PER_GROUP", min_rows)
    applied = []
    for cls in (with_neighbors._SwiGLUGivingRows, with_neighbors._CombineGivingRows):
        monkeypatch.setattr(cls, "apply", lambda *a, _apply=cls.apply, _name=cls.__name__: (
            applied.append(_name), _apply(*a))[1])
    plan, x, w1, g = _gemm_inputs(4, 2 * I, "empty")
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).bfloat16()
    weights = torch.rand(T, K, generator=g)
    dy = torch.randn(T, H, generator=g).bfloat16()
    kw = dict(recipe=recipe, backend="triton")
    x_fp8 = quantize_rowwise(x, E4M3FN, pow2=get_recipe(recipe).pow2_scales)
    results = []
    for use_neighbors in (True, False):
        leaves = [x.clone().requires_grad_(x_grad), w1.clone().requires_grad_(), w2.clone().requires_grad_()]
        with torch.set_grad_enabled(grad_mode):
            if use_neighbors:
                a, q, s = fp8_grouped_mm_swiglu(leaves[0], leaves[1], plan.offsets, x_fp8=x_fp8, **kw)
                out = fp8_grouped_mm_combine(a, leaves[2], plan.offsets, plan, weights, x_fp8=(q, s), **kw)
            else:
                h = fp8_grouped_mm(leaves[0], leaves[1], plan.offsets, x_fp8=x_fp8, **kw)
                a, q, s = SwiGLUQuantize.apply(h, E4M3FN, get_recipe(recipe).pow2_scales)
                out = combine(fp8_grouped_mm(a, leaves[2], plan.offsets, x_fp8=(q, s), **kw), plan, weights)
        grads = torch.autograd.grad(out, [t for t in leaves if t.requires_grad], dy) if grad_mode else []
        results.append([out, *grads])
    assert applied == fused
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


@pytest.mark.interpreter
@pytest.mark.parametrize("fused", [True, False])
def test_undefined_gradient_of_the_swiglu_output(fused):
    """Neither SwiGLU Function has zero gradients made for its FP8 outputs; where ``a``'s own gradient
    is undefined too, its backward gives none to its inputs (no zeros, no crash)."""
    plan, x, w, _ = _gemm_inputs(5, 2 * I)
    x, w = x.requires_grad_(), w.requires_grad_()
    x_fp8 = quantize_rowwise(x.detach(), E4M3FN, pow2=True)
    if fused:  # upstream rows, too few per group for x's group amax: the rows handed to the GEMM
        a, _, _ = fp8_grouped_mm_swiglu(x, w, plan.offsets, recipe="rowwise_gw_hp", backend="triton", x_fp8=x_fp8)
        assert type(a.grad_fn).__name__ == "_SwiGLUGivingRowsBackward"
    else:  # its input a leaf
        x = fp8_grouped_mm(x, w, plan.offsets, recipe="rowwise_gw_hp", backend="triton", x_fp8=x_fp8).detach()
        a, _, _ = SwiGLUQuantize.apply(x.requires_grad_(), E4M3FN, True)
    NoGradient.apply(a).sum().backward()
    assert x.grad is None and w.grad is None


@pytest.mark.interpreter
def test_saved_tensors_freed_before_the_gemm_backward():
    """With the gradient's rows handed to the GEMM, the SwiGLU's and the combine's nodes have
    released what they saved (``h``, ``y``) when their GEMM's backward starts, and that backward
    receives the rows and scales ``quantize_rowwise`` makes of its output gradient."""
    plan, x, w1, g = _gemm_inputs(6, 2 * I)
    w1, w2 = w1.requires_grad_(), (torch.randn(E, H, I, generator=g) * 0.1).bfloat16().requires_grad_()
    pow2 = get_recipe("rowwise_gw_hp").pow2_scales
    x_fp8 = quantize_rowwise(x, E4M3FN, pow2=pow2)
    kw = dict(recipe="rowwise_gw_hp", backend="triton")
    a, q, s = fp8_grouped_mm_swiglu(x.requires_grad_(), w1, plan.offsets, x_fp8=x_fp8, **kw)
    out = fp8_grouped_mm_combine(a, w2, plan.offsets, plan, torch.rand(T, K, generator=g), x_fp8=(q, s), **kw)
    seen = []
    for op in (a.grad_fn, out.grad_fn):
        gemm = op.next_functions[0][0]
        assert type(gemm).__name__ == "_GroupedMMTakingRowsBackward" and op.next_functions[1][0] is gemm

        def check(grads, op=op):
            with pytest.raises(RuntimeError, match="freed"):
                op.saved_tensors
            grad_out, rows, scale = grads
            want = quantize_rowwise(grad_out, E4M3FN, pow2=pow2)
            seen.append(torch.equal(rows.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(scale, want[1]))

        gemm.register_prehook(check)
    out.backward(torch.randn(T, H, generator=g).bfloat16())
    assert seen == [True, True]


def test_bad_input():
    plan, x, w, _ = _gemm_inputs(3, 2 * I)
    with pytest.raises(ValueError, match="recipe: expected a recipe with row scales"):
        fp8_grouped_mm_swiglu(x, w, plan.offsets, recipe="tensorwise", backend="triton")
    with pytest.raises(ValueError, match="recipe: expected a recipe with row scales"):
        fp8_grouped_mm_combine(x, w, plan.offsets, plan, None, recipe="bf16", backend="triton")
    with pytest.raises(TypeError, match="plan: expected DispatchPlan"):
        fp8_grouped_mm_combine(x, w, plan.offsets, tuple(plan), None, backend="triton")
    with pytest.raises(ValueError, match="x: expected"):
        fp8_grouped_mm_combine(x[1:], w, plan.offsets, plan, None, backend="triton")
    with pytest.raises(ValueError, match="weights: expected shape"):
        fp8_grouped_mm_combine(x, w, plan.offsets, plan, torch.rand(T, K + 1), backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe, tokens, hidden, inter, experts, top_k", [
    ("rowwise_gw_hp", 4096, 2048, 768, 128, 8),  # Qwen3-30B-A3B experts: the fused backward
    ("rowwise", 4096, 7168, 2048, 8, 8),  # DeepSeek-V3 experts, E = 8: the dgrads reduce the group amax
])
def test_fused_backward_bits_on_gpu(recipe, tokens, hidden, inter, experts, top_k, monkeypatch):
    torch.manual_seed(0)
    layer = FP8GroupedExperts(experts, hidden, inter, recipe=recipe, cache_weights=False).to("cuda", torch.bfloat16)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=1).indices
    weights = torch.rand(tokens, top_k, device="cuda")
    dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    calls = _counting(monkeypatch)
    separate = _step(layer, x, ids, weights, None, dy, False)
    fused = _step(layer, x, ids, weights, None, dy, True)
    # the router weights' gradient: an fp32 dot product summed in the order each kernel's compiler picks
    w_sep, w_fused = separate.pop(2), fused.pop(2)
    torch.testing.assert_close(w_fused, w_sep, rtol=1e-5, atol=1e-5 * w_sep.abs().max().item())
    for i, (a, b) in enumerate(zip(separate, fused, strict=True)):
        assert torch.equal(a, b), i
    expected = int(recipe == "rowwise_gw_hp")
    assert calls == {"swiglu": expected, "combine": expected}
