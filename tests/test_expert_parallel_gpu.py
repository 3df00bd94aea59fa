"""Expert parallelism on NCCL with a group of one rank (one GPU): the same code path (count
exchange, the one host copy, row all-to-alls, combine) equals the layer without a group, bitwise;
one host wait in the forward, none in the backward."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from ep_workers import layer_grads, replay_on_new_input
from moe_fp8 import FP8MoE
from moe_fp8.parallel import expert_parallel_from

pytestmark = pytest.mark.gpu

H, I, E, K, T = 256, 128, 8, 2, 300


@pytest.fixture(scope="module")
def group():
    if dist.is_initialized():
        pytest.skip("a default process group exists already")
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
        yield dist.group.WORLD
        dist.destroy_process_group()


def _count_event_waits(monkeypatch) -> list:
    """The events waited on from now on (``torch.cuda.Event.synchronize`` calls), in a list."""
    waits = []
    event_wait = torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda ev: (waits.append(ev), event_wait(ev))[1])
    return waits


def _assert_equal(got, want) -> None:
    """``layer_grads`` results equal bit for bit: output, input gradient, every parameter's gradient."""
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for n, g in got[2].items():
        assert g is not None and torch.equal(g, want[2][n]), n


@pytest.mark.parametrize("dispatch", ["bf16", "fp8"])
@pytest.mark.parametrize("tokens", [T, 0])
def test_nccl_world_of_one_equals_the_layer(group, dispatch, tokens):
    torch.manual_seed(0)
    # the shared expert (a dense FP8Linear, no part of the exchange) only where there are tokens
    shared = 128 if tokens else 0
    full = FP8MoE(H, I, E, K, shared_expert_hidden_size=shared, device="cuda", dtype=torch.bfloat16)
    ep = expert_parallel_from(full, group, dispatch)
    full.experts.fp8_saved_input = dispatch == "fp8"  # what FP8 dispatch implies (its first GEMM saves FP8 rows)
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    want, got = layer_grads(full, x, dy), layer_grads(ep, x, dy)
    _assert_equal(got, want)


@pytest.mark.parametrize("dispatch, checkpoint", [("bf16", False), ("fp8", False), ("fp8", True)])
def test_one_host_wait_in_forward_none_in_backward(group, dispatch, checkpoint, monkeypatch):
    """The forward waits on the host once, for the event of the split sizes' copy; nothing else in
    forward or backward synchronizes (``set_sync_debug_mode``)."""
    torch.manual_seed(0)
    ep = expert_parallel_from(FP8MoE(H, I, E, K, device="cuda", dtype=torch.bfloat16), group, dispatch, checkpoint)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ep(x).sum().backward()  # warm-up: compiles the kernels
    torch.cuda.synchronize()
    waits = _count_event_waits(monkeypatch)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = ep(x)
        assert len(waits) == 1
        out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert len(waits) == 1
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("dispatch", ["bf16", "fp8"])
def test_sync_free_equals_the_layer_waits_never_and_captures(group, dispatch, monkeypatch):
    """The sync-free dispatch equals the layer without a group (bitwise), never waits on the host,
    and its forward replays from a CUDA graph with the same bits as eager on new inputs."""
    torch.manual_seed(0)
    full = FP8MoE(H, I, E, K, device="cuda", dtype=torch.bfloat16)
    ep = expert_parallel_from(full, group, dispatch, sync_free=True)
    full.experts.fp8_saved_input = dispatch == "fp8"
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    want, got = layer_grads(full, x, dy), layer_grads(ep, x, dy)
    _assert_equal(got, want)
    waits = _count_event_waits(monkeypatch)
    xg = x.clone().requires_grad_()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ep(xg).backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not waits
    monkeypatch.undo()
    static_x = x.clone()
    static_out = replay_on_new_input(ep, static_x)
    with torch.no_grad():
        assert torch.equal(static_out, full(static_x))
