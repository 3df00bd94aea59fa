"""The weight gradients' empty-group zeroing against a memset of the same bytes.

A grouped weight-gradient GEMM's output ``(E, N, K)`` must be zero for every expert that got no
rows; ``moe_fp8.grouped_gemm.tail.zero_empty_groups`` writes those zeros after a library GEMM (no
library GEMM is trusted for an empty reduction). Its cost is the bytes of the empty groups, so it
is set against ``Tensor.zero_()`` of a buffer of exactly those bytes. Shapes: Qwen3-30B-A3B's two
expert weight gradients (``gate_up (128, 1536, 2048)``, ``down (128, 2048, 768)``, bf16) with 13,
45 and 100 of the 128 experts empty, at random positions. Medians of CUDA-event times; each run
checks that the empty groups are zero and the others untouched.

Usage: ``python benchmarks/bench_zero_empty_groups.py [--steps 100] [--out benchmarks/results]``
(writes ``zero_empty_groups.json`` and ``.md``); ``--quick``: tiny shapes on the CPU (a smoke run).
"""

from __future__ import annotations

import torch

from moe_fp8.bench.report import run_env, script_args, write_report
from moe_fp8.bench.timing import event_median_ms
from moe_fp8.grouped_gemm.tail import zero_empty_groups

SHAPES = {"gate_up": (128, 1536, 2048), "down": (128, 2048, 768)}
EMPTY = (13, 45, 100)
QUICK_SHAPES = {"gate_up": (8, 32, 64), "down": (8, 64, 16)}
QUICK_EMPTY = (1, 5)


def _offsets(experts: int, empty: int, device: str) -> torch.Tensor:
    """int32 end offsets of ``experts`` groups, ``empty`` of them (random ones) with no rows."""
    sizes = torch.randint(1, 900, (experts,))
    sizes[torch.randperm(experts)[:empty]] = 0
    return sizes.cumsum(0).to(torch.int32).to(device)


def _row(name: str, shape: tuple[int, int, int], empty: int, steps: int, device: str) -> dict:
    E, N, K = shape
    offs = _offsets(E, empty, device)
    out = torch.ones(shape, dtype=torch.bfloat16, device=device)
    zero_empty_groups(out, offs)
    is_empty = torch.diff(offs, prepend=offs.new_zeros(1)) == 0
    if not ((out[is_empty] == 0).all() and (out[~is_empty] == 1).all()):
        raise AssertionError(f"{name}: zero_empty_groups wrote outside the empty groups or missed one")
    nbytes = empty * N * K * out.element_size()
    memset = torch.empty(nbytes, dtype=torch.uint8, device=device)
    zeroing_ms = event_median_ms(lambda: zero_empty_groups(out, offs), steps)
    memset_ms = event_median_ms(memset.zero_, steps)
    return dict(gradient=name, shape=list(shape), empty=empty, bytes=nbytes, zeroing_ms=zeroing_ms,
                memset_ms=memset_ms, zeroing_gbps=nbytes / zeroing_ms / 1e6, memset_gbps=nbytes / memset_ms / 1e6,
                of_memset=memset_ms / zeroing_ms)


def main() -> None:
    args, device = script_args(__doc__, 100)
    shapes, empties = (QUICK_SHAPES, QUICK_EMPTY) if args.quick else (SHAPES, EMPTY)
    torch.manual_seed(0)
    rows = [_row(name, shape, empty, args.steps, device) for name, shape in shapes.items() for empty in empties]
    header = ["| gradient (E, N, K) | empty experts | MB zeroed | zeroing ms | memset ms | zeroing GB/s | "
              "memset GB/s | of memset |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    body = header + [f"| {r['gradient']} {tuple(r['shape'])} | {r['empty']} | {r['bytes'] / 1e6:.0f} | "
                     f"{r['zeroing_ms']:.4f} | {r['memset_ms']:.4f} | {r['zeroing_gbps']:.0f} | {r['memset_gbps']:.0f} | "
                     f"{r['of_memset']:.0%} |" for r in rows]
    print("\n".join(body))
    stem = "zero_empty_groups" + ("_quick" if args.quick else "")
    write_report(args.out, stem, run_env(device), rows, "Empty-group zeroing of the weight gradients against a memset",
                 f"`python benchmarks/bench_zero_empty_groups.py --steps {args.steps}`, medians of CUDA-event times",
                 body)


if __name__ == "__main__":
    main()
