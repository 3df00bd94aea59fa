"""Combine: forward and gradients against fp64 references, bit-exact against the fp32 slot-order reference,
determinism, unit weights, dropped pairs, padding rows, edge sizes, torch.compile tracing."""

from __future__ import annotations

import pytest
import torch

from moe_fp8.routing import combine, make_dispatch_plan, permute
from moe_fp8.kernel_backend import use_triton
from moe_fp8.routing.combine_kernels import combine_kernel
from moe_fp8.quant.formats import E4M3FN
from moe_fp8.quant.reference import quantize_rowwise
from moe_fp8.routing.combine_ops import combine_backward_rows
from moe_fp8.routing.reference import combine_reference, permute_reference

from quant_kernel_cases import FORMAT_IDS, FORMATS

from test_routing_plan import random_topk_ids

# Against the references: with CPU tensors the kernels run only in the interpreter (elsewhere the
# module would fall back to the reference itself and the comparison would prove nothing).
pytestmark = pytest.mark.interpreter


def test_kernels_run_in_this_session():
    if not use_triton(combine_kernel, torch.empty(0)):
        pytest.skip("CPU without TRITON_INTERPRET=1: the torch fallback runs instead of the kernels")


def setup(T, E, k, H, P, kind="balanced", seed=0, dtype=torch.bfloat16, w_dtype=torch.float32):
    ids = random_topk_ids(T, E, k, kind, seed=seed)
    plan = make_dispatch_plan(ids, E, pad_multiple=P)
    g = torch.Generator().manual_seed(seed + 100)
    y = torch.randn(plan.num_rows, H, generator=g).to(dtype)
    y[plan.pad_rows.long()] = float("nan")  # padding rows must never be read
    w = torch.rand(T, k, generator=g).to(w_dtype)
    return plan, y, w


def fp64_combine(y, plan, w):
    """``out[t] = sum_j w[t,j] y[row(t,j)]`` in fp64 (differentiable), dropped pairs add 0."""
    rows = plan.pair_to_row.long().view(-1, plan.top_k)
    g = y[rows.clamp_min(0)] * (rows >= 0)[..., None]
    return (g * w[..., None]).sum(1) if w is not None else g.sum(1)


@pytest.mark.parametrize("kind", ["balanced", "skewed", "one", "empty"])
@pytest.mark.parametrize("P", [1, 16])
def test_forward_and_gradients_vs_fp64(kind, P):
    T, E, k, H = 19, 8, 3, 72
    plan, y, w = setup(T, E, k, H, P, kind, seed=P)
    y.requires_grad_()
    w.requires_grad_()
    out = combine(y, plan, w)
    assert out.dtype == torch.bfloat16 and out.shape == (T, H)
    live = torch.ones(plan.num_rows, dtype=torch.bool)
    live[plan.pad_rows.long()] = False
    y64 = torch.where(live[:, None], y.detach().double(), 0.0).requires_grad_()
    w64 = w.detach().double().requires_grad_()
    ref = fp64_combine(y64, plan, w64)
    torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=1e-6)  # one bf16 rounding
    assert torch.equal(out, combine_reference(y, plan.pair_to_row, w, k))  # same fp32 slot-order sum
    go = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).bfloat16()
    gy, gw = torch.autograd.grad(out, (y, w), go)
    gy64, gw64 = torch.autograd.grad(ref, (y64, w64), go.double())
    torch.testing.assert_close(gy[live].double(), gy64[live], rtol=2**-8, atol=1e-6)
    assert (gy[~live] == 0).all(), "padding rows of grad_y must be zero"
    torch.testing.assert_close(gw.double(), gw64, rtol=1e-5, atol=1e-5)
    assert gw.dtype == torch.float32


def test_fp32_outputs_and_bf16_weights():
    T, E, k, H = 10, 4, 2, 33
    plan, y, w = setup(T, E, k, H, 4, dtype=torch.float32, w_dtype=torch.bfloat16, seed=3)
    y.requires_grad_()
    w.requires_grad_()
    out = combine(y, plan, w)
    torch.testing.assert_close(out.double(), fp64_combine(y.detach().double().nan_to_num(), plan, w.detach().double()),
                               rtol=1e-6, atol=1e-6)
    gy, gw = torch.autograd.grad(out.sum(), (y, w))
    assert gw.dtype == torch.bfloat16 and gy.dtype == torch.float32


def test_unit_weights_is_the_permute_adjoint():
    T, E, k, H = 14, 6, 2, 40
    plan, y, _ = setup(T, E, k, H, 8, seed=4, dtype=torch.float32)
    y.requires_grad_()
    out = combine(y, plan, None)
    torch.testing.assert_close(out.double(), fp64_combine(y.detach().double(), plan, None), rtol=1e-6, atol=1e-6)
    x = torch.randn(T, H)
    # <combine(y), x> == <y, permute(x)> over the live rows
    live = permute(x, plan)
    lhs = (out.double() * x.double()).sum()
    rhs = (y.detach().double().nan_to_num() * live.double()).sum()
    torch.testing.assert_close(lhs, rhs, rtol=1e-6, atol=1e-6)
    (gy,) = torch.autograd.grad(out, y, x)
    assert torch.equal(gy, permute_reference(x, plan.row_to_pair, k))  # the backward, against the reference


def test_deterministic_bits():
    T, E, k, H = 25, 16, 8, 64
    plan, y, w = setup(T, E, k, H, 16, "skewed", seed=5)
    y.requires_grad_()
    w.requires_grad_()
    runs = []
    for _ in range(2):
        out = combine(y, plan, w)
        gy, gw = torch.autograd.grad(out, (y, w), torch.ones_like(out))
        runs.append((out, gy, gw))
    for a, b in zip(*runs):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a, b.view(torch.uint8) if b.dtype == torch.bfloat16 else b)


def test_dropped_pairs_contribute_zero():
    T, E, k, H = 8, 4, 2, 16
    ids = random_topk_ids(T, E, k, "balanced", seed=6)
    ids[2, 1] = -1
    plan = make_dispatch_plan(ids, E)
    y = torch.randn(plan.num_rows, H, requires_grad=True)
    w = torch.rand(T, k, requires_grad=True)
    out = combine(y, plan, w)
    row = int(plan.pair_to_row[2 * k])
    torch.testing.assert_close(out[2], w[2, 0] * y[row])
    _, gw = torch.autograd.grad(out.sum(), (y, w))
    assert gw[2, 1] == 0


@pytest.mark.parametrize("T", [0, 1])
def test_zero_and_one_token(T):
    plan, y, w = setup(T, 4, 2, 24, 16, seed=T)
    y.requires_grad_()
    w.requires_grad_()
    out = combine(y, plan, w)
    assert out.shape == (T, 24)
    gy, gw = torch.autograd.grad(out.float().sum(), (y, w))
    assert (gy[plan.pad_rows.long()] == 0).all() and gw.shape == (T, 2)
    if T:
        assert torch.equal(out, combine_reference(y, plan.pair_to_row, w, 2))


def test_traces_under_torch_compile():
    T, E, k, H = 6, 4, 2, 16
    plan, y, w = setup(T, E, k, H, 4, seed=7, dtype=torch.float32)
    y = y.nan_to_num()
    x = torch.randn(T, H)

    def layer(x, y, w):
        return combine(permute(x, plan) * 0 + y, plan, w)

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, y, w), layer(x, y, w))


def test_bad_input():
    plan, y, w = setup(5, 4, 2, 8, 1)
    with pytest.raises(ValueError, match="y: expected 10 rows"):
        combine(y[:-1], plan, w)
    with pytest.raises(ValueError, match="weights"):
        combine(y, plan, w[:, :1])
    with pytest.raises(TypeError, match="weights"):
        combine(y, plan, w.long())
    with pytest.raises(TypeError, match="y"):
        combine(y.to(torch.int32), plan, w)
    with pytest.raises(TypeError, match="plan"):
        combine(y, None, w)


def _backward_rows(grad_out, y, plan, weights, fmt, pow2=False):
    """The combine's backward with grad_y's FP8 rows, on ``plan``'s tensors."""
    return combine_backward_rows(grad_out, y, plan.pair_to_row, plan.row_to_pair, plan.pad_rows, weights, plan.top_k,
                                 fmt, pow2)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("kind, P, weighted, pow2", [
    ("balanced", 1, True, False), ("skewed", 16, True, True), ("empty", 16, True, False),
    ("balanced", 16, False, False), ("one", 1, False, True),
])
def test_backward_quantize_is_the_backward_then_quantize_rowwise(kind, P, weighted, pow2, fmt):
    """grad_y and grad_w are the plain backward's bits; q and scale are quantize_rowwise(grad_y) exactly
    (padding rows included: zero codes, the zero row's scale). Gradient rows span 1e-6..1e6."""
    T, E, k, H = 21, 8, 3, 72
    plan, y, w = setup(T, E, k, H, P, kind, seed=7 + P)
    w = w if weighted else None
    g = torch.Generator().manual_seed(8)
    go = (torch.randn(T, H, generator=g) * torch.pow(10.0, torch.randint(-6, 7, (T, 1), generator=g))).bfloat16()
    go[0] = 0
    torch.full((plan.num_rows + 3, H), float("nan"))  # dirty the allocator
    grad_y, grad_w, q, scale = _backward_rows(go, y if weighted else None, plan, w, fmt, pow2)
    yr = y.clone().requires_grad_()
    wr = w.clone().requires_grad_() if weighted else None
    ref_gy, ref_gw = torch.autograd.grad(combine(yr, plan, wr), (yr, wr) if weighted else (yr,), go) + (None,) * (
        not weighted)
    assert torch.equal(grad_y.view(torch.int16), ref_gy.view(torch.int16))
    assert (grad_w is None) == (not weighted) and (grad_w is None or torch.equal(grad_w, ref_gw))
    ref_q, ref_s = quantize_rowwise(ref_gy, fmt, pow2=pow2)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_s)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_backward_quantize_amax_of_signed_weights(dtype, fmt):
    """The row amax comes from ``|w| * max|g|`` rounded once; it must equal the amax of the rounded
    rows for weights of either sign (zero included) and every row dtype."""
    T, E, k, H = 17, 6, 4, 136
    plan, y, w = setup(T, E, k, H, 16, "skewed", seed=11, dtype=dtype)
    g = torch.Generator().manual_seed(12)
    w = (w - 0.5) * torch.pow(10.0, torch.randint(-3, 3, (T, k), generator=g))
    w[0, 1] = 0.0
    go = (torch.randn(T, H, generator=g) * torch.pow(10.0, torch.randint(-4, 3, (T, 1), generator=g))).to(dtype)
    assert (w[..., None] * go[:, None].float()).abs().max() < torch.finfo(dtype).max  # finite rows
    torch.full((plan.num_rows + 5, H), float("nan"))  # dirty the allocator
    grad_y, _, q, scale = _backward_rows(go, y, plan, w, fmt, pow2=False)
    yr = y.clone().requires_grad_()
    assert torch.equal(grad_y, torch.autograd.grad(combine(yr, plan, w), yr, go)[0])
    ref_q, ref_s = quantize_rowwise(grad_y, fmt)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_s)


def test_backward_quantize_loops_over_wide_rows(monkeypatch):
    """Rows wider than one block (tile shrunk): the amax pass and the main pass loop over H."""
    import moe_fp8.routing.combine_ops as ops

    monkeypatch.setattr(ops, "_BWD_QUANTIZE_TILE", 64)
    T, E, k, H = 9, 4, 2, 300
    plan, y, w = setup(T, E, k, H, 16, "skewed", seed=3)
    go = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).bfloat16() * 1e3
    grad_y, _, q, scale = _backward_rows(go, y, plan, w, E4M3FN)
    ref_q, ref_s = quantize_rowwise(grad_y, E4M3FN)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_s)
    yr = y.clone().requires_grad_()
    assert torch.equal(grad_y, torch.autograd.grad(combine(yr, plan, w), yr, go)[0])
