"""Expert-parallel FP8MoE (``moe_fp8.parallel``) against the plain FP8MoE on one GPU (a NCCL group of
one rank: the same code path as W ranks, every exchange a self-copy), and the bytes on the wire.

Shapes: DeepSeek-V3 routed experts (H=7168, I=2048), 16 experts, top-8, T=8192 tokens, rowwise
recipe, weight cache on. Rows timed (``triton.testing.do_bench`` medians, alternated rounds, median
of the rounds): forward+backward, and the forward alone without grad, of the plain layer (also
with ``fp8_saved_input``, the baseline of FP8 dispatch) and of the EP layer with BF16 and FP8
dispatch, with and without the sync-free dispatch. Overhead = EP / its plain baseline - 1. Also:
host waits per forward (synchronizing calls under ``torch.cuda.set_sync_debug_mode("warn")`` and
event waits), peak memory of a step, and the bytes per token row each dispatch puts on the wire
(``dispatch_bytes_per_row``).

Usage: ``python -m moe_fp8.bench.expert_parallel [--out DIR] [--tokens 8192] [--rounds 5] [--quick]``
(writes ``expert_parallel.json`` / ``.md``). ``--quick`` (alias ``--smoke``): tiny shapes and few
repetitions, runs on the CPU too (gloo, wall clock), to check the script itself.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from moe_fp8 import FP8MoE
from moe_fp8.bench.report import run_env, write_report
from moe_fp8.bench.ranks import init_ranks
from moe_fp8.bench.timing import alternated_rounds, fwd_bwd_step, layer_timer
from moe_fp8.parallel import dispatch_bytes_per_row, expert_parallel_from

OUT = Path("benchmarks") / "results"


def _forward(layer, x):
    def run():
        with torch.no_grad():
            layer(x)
    return run


def _syncs_per_forward(layer, x) -> int | None:
    """Host waits in one forward: synchronizing calls (``set_sync_debug_mode``) and event waits."""
    if not x.is_cuda:
        return None
    torch.cuda.synchronize()
    waits = []
    event_wait = torch.cuda.Event.synchronize
    torch.cuda.Event.synchronize = lambda ev: (waits.append(ev), event_wait(ev))[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            layer(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.Event.synchronize = event_wait
    return len(waits) + sum("called a synchronizing" in str(w.message) for w in caught)


def _peak_gib(run, device: str) -> float | None:
    if device != "cuda":
        return None
    run()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", "--smoke", action="store_true", help="tiny shapes, few repetitions (CPU too)")
    args = ap.parse_args()
    rank, world, dev, close = init_ranks()
    device = dev.type
    if world != 1:
        close()
        raise SystemExit("moe_fp8.bench.expert_parallel runs on one process (for W GPUs: moe_fp8.bench.ep_scaling)")
    H, I, E, K, T = (7168, 2048, 16, 8, args.tokens) if not (args.quick and device == "cpu") else (64, 32, 4, 2, 32)
    rounds = 2 if args.quick else args.rounds
    try:
        rows, body = _bench(device, H, I, E, K, T, rounds, args.quick)
    finally:
        close()
    env = run_env(device, hidden=H, expert_hidden=I, experts=E, top_k=K, tokens=T, world_size=1)
    method = (f"H={H}, I={I}, E={E}, top-{K}, T={T}, rowwise, NCCL world size 1, eager, "
              f"do_bench medians, median of {rounds} alternated rounds")
    write_report(args.out, "expert_parallel", env, rows, "Expert-parallel FP8MoE vs FP8MoE (one GPU)", method, body)
    print("\n".join(body))


def _bench(device: str, H: int, I: int, E: int, K: int, T: int, rounds: int, quick: bool):
    torch.manual_seed(0)
    backend = None if device == "cuda" else "emulated"
    plain = FP8MoE(H, I, E, K, backend=backend, device=device, dtype=torch.bfloat16)
    # FP8 dispatch saves the FP8 rows for the weight gradient: its baseline is the plain layer doing the same
    plain_fp8_in = copy.deepcopy(plain)
    plain_fp8_in.experts.fp8_saved_input = True
    layers = {"FP8MoE": plain, "FP8MoE, fp8_saved_input": plain_fp8_in}
    baseline = {"FP8MoE": "FP8MoE", "FP8MoE, fp8_saved_input": "FP8MoE, fp8_saved_input"}
    for sync_free in (False, True):
        for d in ("bf16", "fp8"):
            name = f"EP, {d} dispatch" + (", sync-free" if sync_free else "")
            layers[name] = expert_parallel_from(plain, dist.group.WORLD, d, sync_free=sync_free)
            baseline[name] = "FP8MoE" if d == "bf16" else "FP8MoE, fp8_saved_input"
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    outs = {name: layer(x).detach() for name, layer in layers.items()}
    equal = {name: bool(torch.equal(out, outs["FP8MoE"])) for name, out in outs.items()}
    del outs
    timer = layer_timer(device == "cuda", quick)
    step_ms = alternated_rounds({n: fwd_bwd_step(m, x, dy) for n, m in layers.items()}, rounds, timer)
    fwd_ms = alternated_rounds({n: _forward(m, x.detach()) for n, m in layers.items()}, rounds, timer)
    step = {n: statistics.median(v) for n, v in step_ms.items()}
    fwd = {n: statistics.median(v) for n, v in fwd_ms.items()}
    rows = []
    for name, layer in layers.items():
        dispatch = getattr(layer.experts, "dispatch", None)
        base = baseline[name]
        rows.append(dict(
            layer=name, baseline=base, step_ms=step[name], step_overhead=step[name] / step[base] - 1,
            forward_ms=fwd[name], forward_overhead=fwd[name] / fwd[base] - 1,
            step_rounds_ms=step_ms[name], forward_rounds_ms=fwd_ms[name], equal_to_plain=equal[name],
            syncs_per_forward=_syncs_per_forward(layer, x.detach()),
            peak_gib=_peak_gib(fwd_bwd_step(layer, x, dy), device),
            wire_bytes_per_row=dispatch_bytes_per_row(H, dispatch, top_k=K) if dispatch else None,
        ))
    bf16, fp8 = dispatch_bytes_per_row(H, "bf16"), dispatch_bytes_per_row(H, "fp8")
    bf16_k, fp8_k = dispatch_bytes_per_row(H, "bf16", top_k=K), dispatch_bytes_per_row(H, "fp8", top_k=K)

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    body = ["| layer | fwd+bwd ms | overhead | forward (no grad) ms | overhead | output == FP8MoE | host waits / fwd "
            "| peak GiB | dispatch bytes / row |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        body.append(f"| {r['layer']} | {r['step_ms']:.3f} | {r['step_overhead']:+.1%} | {r['forward_ms']:.3f} | "
                    f"{r['forward_overhead']:+.1%} | {r['equal_to_plain']} | {fmt(r['syncs_per_forward'], 'd')} | "
                    f"{fmt(r['peak_gib'], '.2f')} | {fmt(r['wire_bytes_per_row'], 'd')} |")
    body += ["", "Overhead: against FP8MoE for BF16 dispatch, against FP8MoE with fp8_saved_input for FP8 dispatch "
             "(whose first GEMM saves the FP8 rows the same way). With one rank every token is one row on the wire "
             "(it has experts on one rank only); every exchange is a self-copy through NCCL.",
             f"Dispatch bytes per token row, FP8 over BF16: the rows (H + 4) / 2H = {fp8}/{bf16} = {fp8 / bf16:.4f}; "
             f"with the routing (k int32 ids + k fp32 weights) {fp8_k}/{bf16_k} = {fp8_k / bf16_k:.4f}, in training "
             f"as in inference. Each row returns as 2H = {bf16} bytes; the backward sends 2H per row each way."]
    return rows, body


if __name__ == "__main__":
    main()
