"""A/B of the padded wgrad buffer's row count: ``padded_rows`` (rounded to 128 rows) against the
same bound rounded to 16 rows only, for the padded group dual quantization of the wgrad operands.

The row count is the column stride of the column-major FP8 operands (``grouped_gemm/padding.py``).
Each of the two launches the FP8MoE backward can make is timed: ``own amax`` (members reduce the
amaxes, workers write) and ``both from amax`` (the amaxes come from the row quantizations that run
first; workers only). Routing is ``random_offsets(..., "balanced")`` (groups of any size). Each
round times both row counts once (``do_bench_cudagraph`` median); the table gives the median over
the rounds and the range. Both must write the same bytes in every row they share.

Usage (one GPU): ``python benchmarks/ab_padded_rows.py [--rounds 3] [--out DIR]`` (writes
``ab_padded_rows.json`` / ``.md``). ``--smoke`` runs tiny shapes on the CPU (interpreter, wall clock)
to check the script.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from ab_report import run_env, write_report
from timing import alternated_rounds, wall_median_ms
from triton.testing import do_bench_cudagraph

from moe_fp8.grouped_gemm.padding import ALIGN, padded_offsets, padded_rows
from moe_fp8.quant import ops
from moe_fp8.quant.formats import E4M3FN
from moe_fp8.testing import random_offsets

SHAPES = [  # model, M, G, N (grad_out columns), K (activation columns)
    ("Llama 4", 16384, 16, 8192, 5120),
    ("DeepSeek-V3", 32768, 8, 4096, 7168),
    ("DeepSeek-V3", 32768, 32, 4096, 7168),
    ("Qwen3-30B-A3B", 65536, 128, 1536, 2048),
]
SMOKE_SHAPES = [("smoke", 100, 3, 32, 48)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script")
    args = ap.parse_args()
    device, shapes = ("cpu", SMOKE_SHAPES) if args.smoke else ("cuda", SHAPES)
    timer = wall_median_ms if args.smoke else (lambda f: do_bench_cudagraph(f, rep=100))
    rounds = 1 if args.smoke else args.rounds
    rows = []
    for model, M, G, N, K in shapes:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(M, N, generator=gen).to(device, torch.bfloat16)
        b = torch.randn(M, K, generator=gen).to(device, torch.bfloat16)
        offs = random_offsets(M, G, "balanced", generator=gen).to(device)
        p_offs = padded_offsets(offs)
        counts = {"16": padded_rows(M, G, rows_align=ALIGN), "128": padded_rows(M, G)}
        _, _, a_amax = ops.triton_quantize_rowwise_with_group_amax(a, offs, E4M3FN, True)
        _, _, b_amax = ops.triton_quantize_rowwise_with_group_amax(b, offs, E4M3FN, True)
        for variant, kw in (("own amax", {}), ("both from amax", dict(a_amax=a_amax, b_amax=b_amax))):
            steps = {name: (lambda r=r, kw=kw, a=a, b=b: ops.triton_quantize_group_colwise_dual(
                a, b, offs, E4M3FN, True, padded_offs=p_offs, padded_rows=r, **kw)) for name, r in counts.items()}
            outs = {name: step() for name, step in steps.items()}
            shared = min(counts.values())
            same = all(torch.equal(x[:shared].view(torch.uint8), y[:shared].view(torch.uint8))
                       for x, y in zip(outs["16"][::2], outs["128"][::2]))
            times = alternated_rounds(steps, rounds, timer)
            rows.append(dict(model=model, M=M, G=G, N=N, K=K, variant=variant, rows=counts,
                             us={n: [t * 1e3 for t in ts] for n, ts in times.items()}, same_bytes=same))
            print(_line(rows[-1]), flush=True)
        del a, b
    env = run_env(device, rounds=rounds)
    write_report(args.out, "ab_padded_rows", env, rows,
                 "Padded wgrad buffer rows: rounded to 128 vs 16 (`benchmarks/ab_padded_rows.py`)",
                 f"padded group dual quantization, {rounds} alternated round(s), median µs [range]",
                 [f"* {_line(r)}" for r in rows])


def _line(r: dict) -> str:
    cells = {n: f"{statistics.median(t):.1f} µs [{min(t):.1f}-{max(t):.1f}]" for n, t in r["us"].items()}
    speedup = statistics.median(r["us"]["16"]) / statistics.median(r["us"]["128"])
    return (f"{r['model']} {r['M']}x({r['N']}+{r['K']}) E={r['G']}, {r['variant']}: {r['rows']['16']} rows "
            f"{cells['16']}, {r['rows']['128']} rows {cells['128']}: {speedup:.3f}x; "
            f"same bytes in shared rows: {r['same_bytes']}")


if __name__ == "__main__":
    main()
