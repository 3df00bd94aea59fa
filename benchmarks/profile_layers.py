"""Where the time of one layer forward+backward goes: GPU kernels grouped by name (torch.profiler).

For each layer (the dense Llama3-8B MLP through ``convert_to_fp8`` and the MoE layers of
``bench_moe_layer.py``) and recipe, prints the kernel time per forward+backward split into GEMMs
and everything else, the top kernels, and the GPU-busy share of the wall time (kernel time over the
``do_bench`` median: well below 100% means the host cannot keep the GPU fed).

Usage: ``python benchmarks/profile_layers.py [--tokens 8192] [--layers dense qwen3_30b_a3b ...]
[--recipes bf16 rowwise] [--top 12] [--out DIR]`` (writes ``profile_layers.md``). Needs a GPU.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from bench_moe_layer import LAYERS, _MLP, fwd_bwd, make_moe, timed
from moe_fp8 import convert_to_fp8

GEMM_MARKERS = ("gemm", "cutlass", "xmma", "nvjet", "_mm_", "grouped_mm", "matmul")
ITERS = 5


def is_gemm(name: str) -> bool:
    low = name.lower()
    return any(m in low for m in GEMM_MARKERS)


def build(layer: str, recipe: str, tokens: int):
    """(module, x, dy) for ``layer`` ('dense' or a key of ``LAYERS``) in ``recipe``."""
    torch.manual_seed(0)
    if layer == "dense":
        dim, hidden = 4096, 14336
        module = _MLP(dim, hidden).to("cuda", torch.bfloat16)
        if recipe != "bf16":
            convert_to_fp8(module, recipe=recipe)
    else:
        module = make_moe(LAYERS[layer], recipe)
        dim = LAYERS[layer][0]
    x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
    return module, x, dy


def kernel_table(step) -> tuple[list[tuple[str, float, int]], float]:
    """Kernels of one ``step`` as (name, ms, calls) sorted by time, and the wall median ms."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    wall = timed(step)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERS):
            step()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        entry = totals.setdefault(ev.name, [0.0, 0])
        entry[0] += ev.device_time_total / 1e3 / ITERS
        entry[1] += 1
    rows = sorted(((n, ms, calls // ITERS) for n, (ms, calls) in totals.items()), key=lambda r: -r[1])
    return rows, wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", nargs="+", default=["dense", "qwen3_30b_a3b", "deepseek_v3_e8"])
    ap.add_argument("--recipes", nargs="+", default=["bf16", "rowwise"])
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    lines = ["# Kernel time per forward+backward (`benchmarks/profile_layers.py`)", "",
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC · {props.name} · "
             f"torch {torch.__version__} · triton {triton.__version__} · T = {args.tokens} tokens, eager", ""]
    for layer in args.layers:
        for recipe in args.recipes:
            module, x, dy = build(layer, recipe, args.tokens)
            rows, wall = kernel_table(fwd_bwd(module, x, dy))
            gemm = sum(ms for n, ms, _ in rows if is_gemm(n))
            total = sum(ms for _, ms, _ in rows)
            lines += [f"## {layer} / {recipe}", "",
                      f"wall {wall:.3f} ms · kernels {total:.3f} ms ({100 * total / wall:.0f}% busy) · "
                      f"GEMMs {gemm:.3f} ms · other {total - gemm:.3f} ms · "
                      f"{sum(c for *_, c in rows)} launches", "",
                      "| kernel | ms | calls | gemm |", "|---|---:|---:|---|"]
            lines += [f"| `{n[:110]}` | {ms:.3f} | {c} | {'y' if is_gemm(n) else ''} |" for n, ms, c in rows[:args.top]]
            lines.append("")
            print("\n".join(lines[-(args.top + 6):]), flush=True)
            del module, x, dy
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_layers.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
