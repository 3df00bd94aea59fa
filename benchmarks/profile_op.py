"""Kernel-level profile of one ``fp8_grouped_mm`` forward+backward per recipe (one CUDA GPU).

For each ``recipe / backend`` pair: the ``do_bench`` median of forward + ``torch.autograd.grad``
(no gradient accumulation), then ``torch.profiler`` over 5 steps and the GPU kernels sorted by
their time per step. Which kernels a recipe runs, and what each costs, is what this answers (the
benchmark scripts give the totals). Usage: ``python benchmarks/profile_op.py [--shape M K N E]
[--pairs rowwise/cuda tensorwise/cuda blockwise/triton] [--top 12]``; prints only.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from moe_fp8 import fp8_grouped_mm
from moe_fp8.testing import random_offsets


def kernel_table(prof, steps: int, top: int) -> list[tuple[float, int, str]]:
    """``(ms per step, launches per step, kernel name)`` of the profiled GPU kernels, slowest first."""
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append((t / steps / 1000, e.count // steps, e.key[:100]))
    return sorted(rows, reverse=True)[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=4, default=[32768, 7168, 4096, 8], metavar=("M", "K", "N", "E"))
    ap.add_argument("--pairs", nargs="+", default=["rowwise/cuda", "tensorwise/cuda", "blockwise/triton"])
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    M, K, N, E = args.shape
    dev, steps = "cuda", 5
    offs = random_offsets(M, E, "balanced", multiple_of=16, generator=torch.Generator().manual_seed(0)).to(dev)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(E, N, K, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    print(f"fp8_grouped_mm M={M} K={K} N={N} E={E}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for pair in args.pairs:
        recipe, backend = pair.split("/")

        def step(recipe=recipe, backend=backend):
            torch.autograd.grad(fp8_grouped_mm(x, w, offs, recipe=recipe, backend=backend), (x, w), dy)

        for _ in range(3):
            step()
        ms = do_bench(step, rep=200)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        rows = kernel_table(prof, steps, 10**6)
        total = sum(r[0] for r in rows)
        print(f"\n{recipe} / {backend}: forward+backward {ms:.3f} ms (do_bench); kernels {total:.3f} ms per step")
        for t, n, name in rows[: args.top]:
            print(f"  {t:7.3f} ms  x{n:<3d} {name}")


if __name__ == "__main__":
    main()
