"""A/B of the ``triton`` backend's wgrad operands: quantized into 16-row-padded groups (the default,
``TritonBackend.pads_wgrad_groups``) against unpadded, forward+backward of ``fp8_grouped_mm``.

Routing is ``random_offsets(..., "balanced")``: groups of any size, so unpadded groups start and end
inside the 2D x 2D kernel's K tiles (its masked edge slices run). Each round times both variants
once (``do_bench`` median); the table gives the median over the rounds, the range, and the largest
difference between the two weight gradients.

Usage (one GPU): ``python benchmarks/ab_triton_wgrad_padding.py [--rounds 7] [--out DIR]`` (writes
``ab_triton_wgrad_padding.json`` / ``.md``). ``--smoke`` runs tiny shapes on the CPU (interpreter,
wall clock) to check the script.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from ab_report import run_env, write_report
from timing import alternated_rounds, wall_median_ms
from triton.testing import do_bench

from moe_fp8 import fp8_grouped_mm
from moe_fp8.grouped_gemm.backends.triton_backend import TritonBackend
from moe_fp8.testing import random_offsets

SHAPES = [  # M, K, N, E
    (32768, 7168, 4096, 8),  # DeepSeek-V3 gate_up
    (32768, 2048, 7168, 8),  # DeepSeek-V3 down
    (32768, 7168, 4096, 32),  # DeepSeek-V3 gate_up, 32 experts
    (65536, 2048, 1536, 128),  # Qwen3-30B-A3B
]
SMOKE_SHAPES = [(256, 64, 32, 4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script")
    args = ap.parse_args()
    device, shapes = ("cpu", SMOKE_SHAPES) if args.smoke else ("cuda", SHAPES)
    timer = wall_median_ms if args.smoke else (lambda f: do_bench(f, warmup=5, rep=50, return_mode="median"))
    rounds = 1 if args.smoke else args.rounds
    default = TritonBackend.pads_wgrad_groups
    rows = []
    try:
        for M, K, N, E in shapes:
            gen = torch.Generator().manual_seed(0)
            offs = random_offsets(M, E, "balanced", generator=gen).to(device)
            x = torch.randn(M, K, generator=gen).to(device, torch.bfloat16).requires_grad_()
            w = (torch.randn(E, N, K, generator=gen) * 0.02).to(device, torch.bfloat16).requires_grad_()
            dy = torch.randn(M, N, generator=gen).to(device, torch.bfloat16)

            def step(pad: bool):
                TritonBackend.pads_wgrad_groups = pad
                x.grad = w.grad = None
                fp8_grouped_mm(x, w, offs, backend="triton").backward(dy)

            dw = {}
            for pad in (False, True):
                step(pad)
                dw[pad] = w.grad.float()
            times = alternated_rounds({False: lambda: step(False), True: lambda: step(True)}, rounds, timer)
            rows.append(dict(M=M, K=K, N=N, E=E, unpadded_ms=times[False], padded_ms=times[True],
                             max_dw_diff=(dw[True] - dw[False]).abs().max().item()))
            print(_line(rows[-1]), flush=True)
    finally:
        TritonBackend.pads_wgrad_groups = default
    env = run_env(device, rounds=rounds)
    write_report(args.out, "ab_triton_wgrad_padding", env, rows,
                 "Triton backend, wgrad operands padded vs unpadded (`benchmarks/ab_triton_wgrad_padding.py`)",
                 f"fp8_grouped_mm rowwise forward+backward, {rounds} alternated round(s), median [range]",
                 [f"* {_line(r)}" for r in rows])


def _line(r: dict) -> str:
    cells = [f"{statistics.median(t):.3f} ms [{min(t):.3f}-{max(t):.3f}]" for t in (r["unpadded_ms"], r["padded_ms"])]
    return (f"M={r['M']} K={r['K']} N={r['N']} E={r['E']}: unpadded {cells[0]}, padded {cells[1]}, "
            f"max |dw diff| {r['max_dw_diff']:.3g}")


if __name__ == "__main__":
    main()
