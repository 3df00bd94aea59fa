"""FP8MoE forward+backward eager, ``torch.compile`` (Inductor) and ``mode="reduce-overhead"`` (CUDA graphs).

Shapes (hidden H, experts E, expert hidden I, top-8, tokens T): H=1024, E=64, I=384, T=8192 and
H=2048, E=128, I=768, T=4096; recipes ``bf16`` and ``rowwise``. Each cell is the median of CUDA-event
timed steps (forward, backward of a fixed gradient) after warm-up; compiled modules are compiled
once per cell (``torch._dynamo.reset()`` in between). Compiled, our Triton kernels are launched
from Inductor's generated code (``torch.library.triton_op``), so the compiled columns show what the
host saves when no op goes back to Python.

Usage: ``python benchmarks/bench_compile.py [--out DIR] [--steps N]`` (about 2 minutes on one H200;
writes ``compile.json`` and ``compile.md``).
"""

from __future__ import annotations

import argparse

import torch

from moe_fp8 import FP8MoE
from moe_fp8.bench.report import run_env, write_report
from moe_fp8.bench.timing import event_median_ms

SHAPES = [(1024, 64, 384, 8, 8192), (2048, 128, 768, 8, 4096)]  # H, E, I, k, T
RECIPES = ("bf16", "rowwise")
MODES = ("eager", "compile", "reduce-overhead")


def step_ms(fn, x, dy, steps: int, graphs: bool) -> float:
    """Median ms of ``steps`` forward+backward steps of ``fn`` (after 5 warm-up steps)."""
    def step():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        xr = x.detach().requires_grad_()
        fn(xr).backward(dy)

    for _ in range(5):
        step()
    return event_median_ms(step, steps)


def bench(H, E, I, k, T, recipe, steps) -> dict:
    torch.manual_seed(0)
    moe = FP8MoE(H, I, E, k, recipe=recipe, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    row = dict(H=H, E=E, I=I, k=k, T=T, recipe=recipe)
    for mode in MODES:
        torch._dynamo.reset()
        fn = moe if mode == "eager" else torch.compile(
            moe, fullgraph=True, mode="reduce-overhead" if mode == "reduce-overhead" else None)
        row[f"{mode}_ms"] = step_ms(fn, x, dy, steps, mode == "reduce-overhead")
        moe.zero_grad(set_to_none=True)
    for mode in MODES[1:]:
        row[f"{mode}_speedup"] = row["eager_ms"] / row[f"{mode}_ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_compile.py needs a CUDA GPU")
    head = "| H | E | I | T | recipe | eager ms | compile ms | reduce-overhead ms | compile x | r-o x |"
    lines = [head, "|" + "---|" * 10]
    rows = []
    print(f"{'H':>5} {'E':>4} {'I':>4} {'T':>5} {'recipe':8} {'eager':>8} {'compile':>8} {'r-o':>8}")
    for H, E, I, k, T in SHAPES:
        for recipe in RECIPES:
            r = bench(H, E, I, k, T, recipe, args.steps)
            rows.append(r)
            print(f"{H:5d} {E:4d} {I:4d} {T:5d} {recipe:8} {r['eager_ms']:8.3f} {r['compile_ms']:8.3f} "
                  f"{r['reduce-overhead_ms']:8.3f}", flush=True)
            lines.append(f"| {H} | {E} | {I} | {T} | {recipe} | {r['eager_ms']:.3f} | {r['compile_ms']:.3f} | "
                         f"{r['reduce-overhead_ms']:.3f} | {r['compile_speedup']:.2f} | "
                         f"{r['reduce-overhead_speedup']:.2f} |")
    method = f"FP8MoE fwd+bwd, top-8, median of {args.steps} CUDA-event timed steps, fullgraph"
    write_report(args.out, "compile", run_env("cuda"), rows, "FP8MoE under torch.compile", method, lines)


if __name__ == "__main__":
    main()
