"""Scenarios of the multi-GPU tests: one rank per GPU (NCCL), or per process on CPU (gloo).

``layer``: every rank builds the same ``FP8MoE`` (same seed) and the same global batch, keeps its own tokens,
and compares the expert-parallel layer (``expert_parallel_from``) against the full layer on one
device on every token, the single-GPU result: output and input gradient of its tokens, its
experts' weight gradients, and the router's and shared expert's gradients summed over the ranks.
The grouped GEMMs of a rank see fewer groups than the full layer's, so their kernel choice (and
the order of fp32 sums) may differ: values are compared by SQNR, not bit for bit.

Scenarios: BF16 and FP8 dispatch; tokens spread evenly, unevenly, and none on rank 0; routing
uniform and skewed (most tokens to the last rank's experts); the sync-free dispatch where every
rank has the same token count; and (GPU) the sync-free layer's forward replayed from a CUDA graph.

``models``: ``parallelize`` (FSDP2 + expert parallelism) on ``(dp_shard, ep)`` meshes of the world
size, each rank training on its slice of the global batch, against one process on the whole
batch: ``fsdp_workers.run_case`` (its bounds and checks) with the models on the GPU and the
default grouped GEMM backend.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

import fsdp_workers
from ep_workers import layer_grads, replay_on_new_input
from moe_fp8 import FP8MoE
from moe_fp8.parallel import expert_parallel_from
from moe_fp8.testing import sqnr

H, I, K, EXPERTS_PER_RANK, T = 256, 128, 4, 4, 96
TIMEOUT = datetime.timedelta(seconds=120)
MIN_SQNR = {"out": 40.0, "grad x": 35.0, "grad": 35.0}


def token_counts(world: int) -> dict[str, list[int]]:
    """``name -> tokens per rank``."""
    return {"even": [T] * world, "uneven": [T // 2 + 16 * r for r in range(world)],
            "rank 0 empty": [0] + [T] * (world - 1)}


def _layer(world: int, device: torch.device, skewed: bool) -> tuple[FP8MoE, torch.Tensor | None]:
    """The full layer (same on every rank) and, for skewed routing, the direction that the last
    rank's experts' router rows point along (tokens are then drawn around it)."""
    torch.manual_seed(0)
    E = EXPERTS_PER_RANK * world
    full = FP8MoE(H, I, E, K, shared_expert_hidden_size=128, device=device, dtype=torch.bfloat16)
    if not skewed:
        return full, None
    gen = torch.Generator().manual_seed(1)
    v = torch.randn(H, generator=gen).to(device)
    with torch.no_grad():
        full.router.weight[-EXPERTS_PER_RANK:] += (v / v.norm()).to(full.router.weight.dtype)
    return full, v


def _tokens(n: int, device: torch.device, v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(n, H, generator=gen)
    if v is not None:
        x = x + 4 * v.cpu()
    return x.to(device, torch.bfloat16), torch.randn(n, H, generator=gen).to(device, torch.bfloat16)


def _close(tag: str, got: torch.Tensor, want: torch.Tensor, min_db: float) -> None:
    assert got is not None, f"{tag}: no gradient"
    assert got.shape == want.shape, f"{tag}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{tag}: not finite"
    if want.numel() == 0 or not want.any():
        assert not got.any(), f"{tag}: expected zeros"
        return
    db = sqnr(want.float(), got.float())
    assert db >= min_db, f"{tag}: {db:.1f} dB < {min_db}"


def check_layer(group, world: int, rank: int, device: torch.device, dispatch: str, sync_free: bool, skewed: bool,
                name: str, ts: list[int]) -> None:
    full, v = _layer(world, device, skewed)
    ep = expert_parallel_from(full, group, dispatch, sync_free=sync_free)
    full.experts.fp8_saved_input = dispatch == "fp8"  # what FP8 dispatch implies
    x, dy = _tokens(sum(ts), device, v)
    a, b = sum(ts[:rank]), sum(ts[: rank + 1])
    out_all, gx_all, g_all = layer_grads(full, x, dy)
    out, gx, g = layer_grads(ep, x[a:b], dy[a:b])
    tag = f"world={world} rank={rank} {dispatch}{' sync-free' if sync_free else ''} {name}" + (" skewed" if skewed else "")
    _close(f"{tag}: out", out, out_all[a:b], MIN_SQNR["out"])
    _close(f"{tag}: grad x", gx, gx_all[a:b], MIN_SQNR["grad x"])
    lo, hi = rank * EXPERTS_PER_RANK, (rank + 1) * EXPERTS_PER_RANK
    for n, grad in g.items():
        if n.startswith("experts."):
            _close(f"{tag}: grad {n}", grad, g_all[n][lo:hi], MIN_SQNR["grad"])
        else:  # replicated: each rank's gradient is of its own tokens; their sum is the full layer's
            summed = grad.float().clone()
            dist.all_reduce(summed, group=group)
            _close(f"{tag}: grad {n} summed over ranks", summed, g_all[n].float(), MIN_SQNR["grad"])


def check_graph_replay(group, world: int, device: torch.device, dispatch: str) -> None:
    """The sync-free layer's forward captured in a CUDA graph replays new inputs as eager runs them."""
    full, _ = _layer(world, device, skewed=False)
    ep = expert_parallel_from(full, group, dispatch, sync_free=True)
    static_x, _ = _tokens(T, device, None)
    static_out = replay_on_new_input(ep, static_x)
    with torch.no_grad():
        eager = ep(static_x)
    assert torch.equal(static_out, eager), f"world={world} {dispatch}: graph replay != eager"


def layer(world: int, rank: int, device: torch.device) -> None:
    group = dist.group.WORLD
    for dispatch in ("bf16", "fp8"):
        for name, ts in token_counts(world).items():
            for skewed in (False, True):
                check_layer(group, world, rank, device, dispatch, False, skewed, name, ts)
            if len(set(ts)) == 1:  # the sync-free dispatch takes the same T on every rank
                check_layer(group, world, rank, device, dispatch, True, True, name, ts)
        if device.type == "cuda":
            check_graph_replay(group, world, device, dispatch)


def models(world: int, rank: int, device: torch.device) -> None:
    """Pure FSDP, pure expert parallelism (FP8 and BF16 dispatch, sync-free) and both, where the
    world size splits; the scenarios and bounds of the CPU test, which its tiny models meet."""
    fsdp_workers.DEVICE, fsdp_workers.BACKEND = device.type, None
    names, tiny, dsv3 = ("dp_shard", "ep"), fsdp_workers.tiny_lm, fsdp_workers.hf_model
    run = fsdp_workers.run_case
    run(f"tiny rowwise {world}x1 accumulate=2", lambda: tiny("rowwise"), "rowwise", (world, 1), names, steps=3,
        accumulate=2)
    run(f"tiny rowwise 1x{world} fp8-dispatch", lambda: tiny("rowwise"), "rowwise", (1, world), names, dispatch="fp8",
        steps=3)
    run(f"tiny bf16 1x{world} sync-free", lambda: tiny("bf16"), "bf16", (1, world), names, steps=2, sync_free=True)
    shape = (2, world // 2) if world % 2 == 0 and world >= 4 else (1, world)
    run(f"deepseek_v3 rowwise {shape[0]}x{shape[1]} bf16-dispatch", lambda: dsv3("deepseek_v3"), "rowwise", shape,
        names, steps=2)


SCENARIOS = {"layer": layer, "models": models}


def worker(rank: int, world: int, init_file: str, scenario: str) -> None:
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=TIMEOUT, **({"device_id": device} if gpu else {}))
    SCENARIOS[scenario](world, rank, device)
    dist.barrier()
    dist.destroy_process_group()
