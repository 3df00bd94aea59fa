"""Whole-layer forward+backward of FP8MoE: FP8 recipes against the BF16 recipe of the same module,
with peak memory, on DeepSeek-V3 (H=7168, I=2048, 8 and 32 local experts, top-8), Llama 4 Scout
(H=5120, I=8192, 16 experts, top-1, shared expert) and Qwen3-30B-A3B (H=2048, I=768, 128 experts,
top-8) layers.

Times are ``triton.testing.do_bench`` medians of one forward + backward (eager), random bf16
inputs, router included. The same step captured in one CUDA graph gives the GPU time alone
(``graph_ms``; no host time, which dominates small layers such as Qwen3's); a capture bypasses the
weight cache, so only the uncached rowwise row is captured. Peak memory is
``max_memory_allocated`` over one forward+backward above what was allocated before it. The
``rowwise`` row runs with the module's weight cache hitting on every timed call (gradient
accumulation); ``rowwise, no weight cache`` quantizes the weights in every forward, as a step that
follows a weight update does. Beside the ``rowwise`` forward: the dispatch plan's share of it in
host time and in GPU time (``plan_share``).
"""

from __future__ import annotations

import statistics

import torch
from torch import nn
from triton.testing import do_bench, do_bench_cudagraph

from ..layers import FP8MoE
from ..layers import experts as experts_module
from ..routing import RouterConfig, make_dispatch_plan
from ..testing import sqnr
from .timing import host_ms, wall_median_ms

SMOKE_LAYERS = {
    "smoke_topk": (64, 32, 4, 2, 0, RouterConfig(4, 2, "softmax", renormalize=True)),
    "smoke_llama4": (64, 32, 4, 1, 32, RouterConfig.llama4(4, 1)),
}
LAYERS = {  # name: (H, I, E, k, shared I, router config)
    "deepseek_v3_e8": (7168, 2048, 8, 8, 0, RouterConfig(8, 8, "softmax", renormalize=True)),
    "deepseek_v3_e32": (7168, 2048, 32, 8, 0, RouterConfig(32, 8, "softmax", renormalize=True)),
    "llama4_scout": (5120, 8192, 16, 1, 8192, RouterConfig.llama4(16, 1)),
    "qwen3_30b_a3b": (2048, 768, 128, 8, 0, RouterConfig.qwen3_moe()),
}
#: (row label, recipe, weight cache): the rowwise layer with its FP8 weight cache (the default: a hit
#: on every timed call, the gradient-accumulation case) and without it (the weights quantized in
#: every forward: the cost of a step that follows a weight update).
VARIANTS = (("bf16", "bf16", True), ("rowwise", "rowwise", True), ("rowwise, no weight cache", "rowwise", False),
            ("rowwise_gw_hp", "rowwise_gw_hp", True))
DEVICE = "cuda"


def fwd_bwd(module: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    def step():
        x.grad = None
        for p in module.parameters():
            p.grad = None
        out = module(x)
        out.backward(dy)
        return out

    return step


def timed(fn) -> float:
    """Median ms: ``do_bench`` on the GPU over ~0.5 s of calls (at least 8 calls of a 60 ms step;
    ``rep=40`` gave one or two at T = 16384), a wall-clock median of 3 calls on the CPU (smoke runs)."""
    if DEVICE == "cuda":
        return do_bench(fn, warmup=25, rep=500, return_mode="median")
    return wall_median_ms(fn)


def graph_ms(fn) -> float | None:
    """Median GPU ms of CUDA-graph replays of ``fn``: no host time. None on the CPU or if ``fn``
    cannot be captured (the reason is printed)."""
    if DEVICE != "cuda":
        return None
    try:
        return do_bench_cudagraph(fn, rep=40, return_mode="median")
    except Exception as e:  # noqa: BLE001 - a capture failure is a result to report, not a crash
        print(f"CUDA-graph capture failed: {e!r}", flush=True)
        return None


def measure(step) -> tuple[float, float]:
    """(median ms, peak extra GiB; 0 on the CPU) of one call of ``step``."""
    step()
    if DEVICE != "cuda":
        return timed(step), 0.0
    torch.cuda.synchronize()
    ms = timed(step)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return ms, peak


HOST_ROUNDS = 7  # alternated rounds of the plan's host-time share


def plan_share(moe: FP8MoE, x: torch.Tensor) -> dict:
    """The dispatch plan's cost against the layer forward (no grad, ms), on the host and on the GPU.

    ``host_*``: CPU time to call ``make_dispatch_plan`` (on the layer's top-k ids) and the whole
    forward, each from an idle device (``timing.host_ms``): what the plan adds where the layer is
    host-bound. Medians over ``HOST_ROUNDS`` alternated rounds (forward, then plan, 20 calls each),
    the share the median of the rounds' ratios, so that a drift of the host's speed hits both alike.
    ``graph_*``: CUDA-graph replays, GPU time only: the plan alone, the forward, and the forward minus
    the forward with the plan precomputed (the layer's own call replaced by a cached result), which
    is what the plan's kernels add to the layer. None where capture is not possible.
    """
    with torch.no_grad():
        fwd = lambda: moe(x)  # noqa: E731
        ids = moe.router(x).topk_ids
        E = moe.experts.num_experts
        plan = lambda: make_dispatch_plan(ids, E, empty_group_rows=True)  # noqa: E731  (as the layer makes it)
        cached = plan()
        rounds = [(host_ms(fwd, 20), host_ms(plan, 20)) for _ in range(HOST_ROUNDS)]
        host_fwd_ms, host_plan_ms = (statistics.median(r[i] for r in rounds) for i in (0, 1))
        host_share = statistics.median(p / f for f, p in rounds)
        graph_fwd_ms, graph_plan_ms = graph_ms(fwd), graph_ms(plan)
        real = experts_module.make_dispatch_plan
        experts_module.make_dispatch_plan = lambda *a, **k: cached
        try:
            graph_no_plan_ms = graph_ms(fwd)
        finally:
            experts_module.make_dispatch_plan = real
    row = dict(host_fwd_ms=host_fwd_ms, host_plan_ms=host_plan_ms, host_plan_share=host_share,
               graph_fwd_ms=graph_fwd_ms, graph_plan_ms=graph_plan_ms, graph_plan_in_fwd_ms=None,
               graph_plan_in_fwd_share=None)
    if None not in (graph_fwd_ms, graph_plan_ms, graph_no_plan_ms):
        row.update(graph_plan_in_fwd_ms=graph_fwd_ms - graph_no_plan_ms,
                   graph_plan_in_fwd_share=(graph_fwd_ms - graph_no_plan_ms) / graph_fwd_ms)
    return row


def _plan_cells(r: dict) -> list[str]:
    """Table cells of a ``plan_share`` row: host forward, plan, share; GPU forward, plan alone, plan
    in the forward, share ('-' without a graph)."""
    cells = [f"{r['host_fwd_ms']:.3f}", f"{r['host_plan_ms']:.3f}", f"{100 * r['host_plan_share']:.1f}%"]
    if r["graph_plan_in_fwd_ms"] is None:
        return cells + ["-"] * 4
    return cells + [f"{r['graph_fwd_ms']:.3f}", f"{r['graph_plan_ms']:.3f}", f"{r['graph_plan_in_fwd_ms']:.3f}",
                    f"{100 * r['graph_plan_in_fwd_share']:.1f}%"]


def make_moe(spec: tuple, recipe: str, backend: str | None = None, device: str | None = None,
             cache_weights: bool = True) -> FP8MoE:
    """The bf16 ``FP8MoE`` of a ``LAYERS`` entry ``(H, I, E, k, shared I, router config)`` on ``device``
    (default ``DEVICE``), its grouped GEMMs on ``backend`` (default: the platform's)."""
    H, I, E, k, shared, cfg = spec
    return FP8MoE(H, I, E, k, router_config=cfg, shared_expert_hidden_size=shared, recipe=recipe, backend=backend,
                  cache_weights=cache_weights, device=device or DEVICE, dtype=torch.bfloat16)


def moe_rows(tokens: int, layers: dict) -> list[dict]:
    rows = []
    for name, (H, I, E, k, shared, cfg) in layers.items():
        torch.manual_seed(0)
        x = torch.randn(tokens, H, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(tokens, H, device=DEVICE, dtype=torch.bfloat16)
        ref_out = None
        base_ms = None
        for label, recipe, cache in VARIANTS:
            torch.manual_seed(0)
            moe = make_moe((H, I, E, k, shared, cfg), recipe, cache_weights=cache)
            step = fwd_bwd(moe, x, dy)
            out = step().detach()
            ms, peak = measure(step)
            # A capture bypasses the weight cache: the cached rowwise step's graph is the uncached one's.
            gms = None if (recipe, cache) == ("rowwise", True) else graph_ms(step)
            if recipe == "bf16":
                ref_out, base_ms, base_gms = out, ms, gms
            flops = 6 * tokens * k * H * 3 * I + (6 * tokens * H * 3 * shared if shared else 0)
            rows.append(dict(layer=name, tokens=tokens, recipe=label, ms=ms, tflops=flops / ms / 1e9,
                             speedup=base_ms / ms, peak_gib=peak, cache_gib=moe.experts.weight_cache_nbytes / 2**30,
                             sqnr_vs_bf16=sqnr(ref_out, out), graph_ms=gms,
                             graph_speedup=base_gms / gms if None not in (gms, base_gms) else None))
            if label == "rowwise" and DEVICE == "cuda":
                rows[-1].update(plan_share(moe, x))
                r = rows[-1]
                print(f"{name:16s} rowwise forward, dispatch plan: " + " | ".join(_plan_cells(r)), flush=True)
            print(f"{name:16s} {label:24s} {ms:8.2f} ms {rows[-1]['speedup']:5.2f}x  peak {peak:6.2f} GiB  "
                  f"SQNR {rows[-1]['sqnr_vs_bf16']:5.1f} dB", flush=True)
            del moe, step
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    return rows


def collect(layers: list[str], tokens: list[int], device: str) -> list[dict]:
    """Rows of every variant of the ``LAYERS`` named (on the CPU: the first of ``SMOKE_LAYERS`` at 32
    tokens, no dispatch-plan share)."""
    global DEVICE
    DEVICE = device
    if device != "cuda":
        return moe_rows(32, dict(list(SMOKE_LAYERS.items())[:1]))
    return [r for t in tokens for r in moe_rows(t, {n: LAYERS[n] for n in layers})]
