"""A/B of grouped-GEMM backends inside the FP8MoE layer: forward+backward of the ``rowwise`` recipe
with each backend, and the ``bf16`` recipe, timed in alternation in one process.

Each round times every variant once (``do_bench`` median); the table gives the median over
``--rounds`` rounds and the range, so a difference smaller than the spread shows as one.

Usage (H100/H200): ``python benchmarks/ab_layer_backends.py [--tokens 4096] [--backends cuda hybrid]
[--layers deepseek_v3_e32 ...] [--rounds 5] [--uncached] [--out DIR]`` (writes ``ab_layer_backends.json``
/ ``.md``). ``--uncached`` adds, per backend, the module without its FP8 weight cache (the weights
quantized in every step, as after each optimizer step without gradient accumulation).
``--smoke`` runs a tiny layer on the CPU (``emulated`` and interpreted ``triton`` backends, wall
clock) to check the script itself.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from ab_report import run_env, write_report
from timing import alternated_rounds, wall_median_ms

from bench_moe_layer import LAYERS, SMOKE_LAYERS, fwd_bwd, make_moe, timed
from moe_fp8 import FP8MoE


def variants(spec: tuple, backends: list[str], device: str, uncached: bool = False) -> dict[str, FP8MoE]:
    """``{"bf16": module, backend: module, ...}`` (and ``"<backend>, no weight cache"`` with
    ``uncached``): same seed, so the same weights and router."""
    torch.manual_seed(0)
    out = {"bf16": make_moe(spec, "bf16", device=device)}
    for name in backends:
        for cache in (True, False) if uncached else (True,):
            torch.manual_seed(0)
            label = name if cache else f"{name}, no weight cache"
            out[label] = make_moe(spec, "rowwise", backend=name, device=device, cache_weights=cache)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--backends", nargs="+", default=["cuda", "cuda_auto", "hybrid"])
    ap.add_argument("--layers", nargs="+", choices=list(LAYERS), default=["deepseek_v3_e32", "deepseek_v3_e8"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--uncached", action="store_true", help="also each backend without the FP8 weight cache")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="a tiny layer on the CPU: checks the script")
    args = ap.parse_args()
    layers, device, timer = LAYERS, "cuda", timed
    if args.smoke:
        layers, device, timer = SMOKE_LAYERS, "cpu", wall_median_ms
        args.tokens, args.layers, args.backends, args.rounds = 32, ["smoke_topk"], ["emulated", "triton"], 2
    rows = []
    for layer in args.layers:
        H = layers[layer][0]
        torch.manual_seed(0)
        x = torch.randn(args.tokens, H, device=device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(args.tokens, H, device=device, dtype=torch.bfloat16)
        modules = variants(layers[layer], args.backends, device, args.uncached)
        steps = {name: fwd_bwd(m, x, dy) for name, m in modules.items()}
        for step in steps.values():
            step()  # compile, fill the weight caches
        times = alternated_rounds(steps, args.rounds, timer)
        bf16 = statistics.median(times["bf16"])
        for name, t in times.items():
            med = statistics.median(t)
            rows.append(dict(layer=layer, tokens=args.tokens, variant=name, ms=med, min_ms=min(t), max_ms=max(t),
                             speedup_vs_bf16=bf16 / med))
            print(f"{layer:16s} {name:28s} {med:8.3f} ms [{min(t):.3f}-{max(t):.3f}] {bf16 / med:.3f}x", flush=True)
        del steps
        if device == "cuda":
            torch.cuda.empty_cache()
    lines = ["| layer | tokens | variant | median ms | range ms | vs bf16 recipe |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['layer']} | {r['tokens']} | {r['variant']} | {r['ms']:.3f} | {r['min_ms']:.3f}-{r['max_ms']:.3f} "
              f"| {r['speedup_vs_bf16']:.3f}x |" for r in rows]
    write_report(args.out, "ab_layer_backends", run_env(device), rows,
                 "FP8MoE rowwise forward+backward per grouped-GEMM backend (`benchmarks/ab_layer_backends.py`)",
                 f"{args.rounds} alternated rounds of {'`do_bench`' if device == 'cuda' else 'wall-clock'} medians",
                 lines)


if __name__ == "__main__":
    main()
