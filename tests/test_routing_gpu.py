"""GPU: the routing pipeline on model-sized shapes, no host syncs, CUDA-graph capture (``pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch

import moe_fp8.routing.permute_ops as permute_ops
from moe_fp8.quant.formats import E4M3FN
from moe_fp8.quant.reference import quantize_rowwise
from moe_fp8.routing import RouterConfig, combine, make_dispatch_plan, permute, permute_quantize, route
from moe_fp8.routing.combine_ops import combine_backward_rows
from moe_fp8.routing.reference import (
    combine_backward_reference,
    combine_reference,
    dispatch_plan_reference,
    permute_reference,
)

from test_routing_plan import check_plan_invariants

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPES = {  # name: (T, k, E, H, router config)
    "deepseek_v3": (4096, 8, 256, 7168, RouterConfig.deepseek_v3()),
    "qwen3_30b_a3b": (4096, 8, 128, 2048, RouterConfig.qwen3_moe()),
    "llama4_scout": (2048, 1, 16, 5120, RouterConfig.llama4()),
}


def _inputs(name, seed=0):
    T, k, E, H, cfg = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(T, E, device="cuda", generator=g)
    bias = torch.randn(E, device="cuda", generator=g) * 0.01 if cfg.use_correction_bias else None
    x = torch.randn(T, H, device="cuda", generator=g, dtype=torch.bfloat16)
    return cfg, logits, bias, x


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("P", [1, 16])
def test_pipeline_matches_references(name, P):
    cfg, logits, bias, x = _inputs(name, seed=P)
    r = route(logits, cfg, bias)
    T, k = r.topk_ids.shape
    E, H = cfg.num_experts, x.shape[1]
    plan = make_dispatch_plan(r.topk_ids, E, pad_multiple=P)
    for got, want in zip(plan, dispatch_plan_reference(r.topk_ids, E, P)):
        assert torch.equal(got, want)
    assert plan.wgrad_offsets is plan.offsets  # without empty_group_rows: one tensor, checked once
    counts, offsets, *rest = (t.cpu() for t in plan[:5])
    check_plan_invariants(type(plan)(counts, offsets, *rest, offsets, k, P), r.topk_ids.cpu(), E, P)

    q, s = permute_quantize(x, plan, E4M3FN)
    q_ref, s_ref = quantize_rowwise(permute_reference(x, plan.row_to_pair, k), E4M3FN)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert torch.equal(permute(x, plan), permute_reference(x, plan.row_to_pair, k))

    w = r.topk_weights if r.topk_weights is not None else torch.ones_like(r.input_scales)
    y = torch.randn(plan.num_rows, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = w.detach().requires_grad_()
    out = combine(y, plan, w)
    ref = combine_reference(y, plan.pair_to_row, w, k)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-5)  # FMA contraction: <= 1 bf16 ulp
    go = torch.randn_like(out)
    gy, gw = torch.autograd.grad(out, (y, w), go)
    gy_ref, gw_ref = combine_backward_reference(go, y, plan.pair_to_row, w, k)
    torch.testing.assert_close(gy.float(), gy_ref.float(), rtol=2**-7, atol=1e-5)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-4, atol=1e-3)
    out2 = combine(y, plan, w)
    assert torch.equal(out.view(torch.int16), out2.view(torch.int16)), "combine must be deterministic"
    gy2, gw2 = torch.autograd.grad(out2, (y, w), go)
    assert torch.equal(gy2.view(torch.int16), gy.view(torch.int16)) and torch.equal(gw2, gw)
    # the quantizing backward: the same grad_y bits, and quantize_rowwise of them exactly; grad_w is
    # the same fp32 dot, summed in the order the compiler picks for each kernel
    gy_q, gw_q, q, s = combine_backward_rows(go, y.detach(), plan.pair_to_row, plan.row_to_pair, plan.pad_rows,
                                             w.detach(), k, E4M3FN)
    assert torch.equal(gy_q.view(torch.int16), gy.view(torch.int16))
    torch.testing.assert_close(gw_q, gw, rtol=1e-5, atol=1e-5 * gw.abs().max().item())
    q_ref, s_ref = quantize_rowwise(gy, E4M3FN)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


@pytest.mark.parametrize("E,Z", [(8, False), (128, False), (256, False), (128, True)])
@pytest.mark.parametrize("skew", [0.0, 4.0])
def test_plan_large_many_chunks_repeatable(E, Z, skew):
    """T = 16384, k = 8: one chunk of pairs per SM, claimed and placed concurrently; same bits as
    the reference on every one of several runs (skew: a few hot experts, some nearly empty; ``Z``:
    ``empty_group_rows``, with a quarter of the experts given no pair)."""
    T, k = 16384, 8
    g = torch.Generator(device="cuda").manual_seed(E)
    scores = torch.rand(T, E, device="cuda", generator=g) + skew * torch.rand(E, device="cuda", generator=g) ** 8
    if Z:
        scores[:, torch.randperm(E, device="cuda", generator=g)[: E // 4]] = -1.0
    ids = scores.topk(k, dim=1).indices.int()
    want = dispatch_plan_reference(ids, E, 16, Z)
    for _ in range(5):
        plan = make_dispatch_plan(ids, E, pad_multiple=16, empty_group_rows=Z)
        for name, got, ref in zip(plan._fields, plan, want):
            assert torch.equal(got, ref), name


def test_two_pass_rows_on_gpu():
    T, E, k, H = 256, 8, 2, 12000  # next_power_of_2(H) > 8192: amax pass + quantize pass
    ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
    plan = make_dispatch_plan(ids, E, pad_multiple=16)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16) * 7
    assert permute_ops._row_blocking(H)[1] > 1
    q, s = permute_quantize(x, plan, E4M3FN)
    q_ref, s_ref = quantize_rowwise(permute_reference(x, plan.row_to_pair, k), E4M3FN)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def _pipeline(router_logits, bias, x, y, cfg, P):
    r = route(router_logits, cfg, bias)
    plan = make_dispatch_plan(r.topk_ids, cfg.num_experts, pad_multiple=P)
    q, s = permute_quantize(x, plan, E4M3FN)
    out = combine(y, plan, r.topk_weights)
    return plan, q, s, out


def test_no_host_sync_forward_and_backward():
    cfg, logits, bias, x = _inputs("deepseek_v3")
    T, k, E, H, _ = SHAPES["deepseek_v3"]
    M = T * k + 15 * E
    y = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    logits.requires_grad_()
    x.requires_grad_()

    def step():
        plan, q, s, out = _pipeline(logits, bias, x, y, cfg, 16)
        (out.float().sum() + permute(x, plan).float().sum()).backward()

    step()  # warm up: compile every kernel, forward and backward, before watching for syncs
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert y.grad is not None and logits.grad is not None and x.grad is not None


def test_cuda_graph_capture_and_replay():
    cfg, logits, bias, x = _inputs("qwen3_30b_a3b")
    T, k, E, H, _ = SHAPES["qwen3_30b_a3b"]
    y = torch.randn(T * k + 15 * E, H, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _pipeline(logits, bias, x, y, cfg, 16)  # warm up on a side stream, as capture requires
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan, q, s, out = _pipeline(logits, bias, x, y, cfg, 16)
    logits.copy_(torch.randn_like(logits))  # new routing, same static buffers
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    eager = _pipeline(logits, bias, x, y, cfg, 16)
    for got, want in zip(plan[:5], eager[0][:5]):
        assert torch.equal(got, want)
    assert torch.equal(q.view(torch.uint8), eager[1].view(torch.uint8)) and torch.equal(s, eager[2])
    assert torch.equal(out.view(torch.int16), eager[3].view(torch.int16))
