"""A BF16 expert weight gradient added to ``.grad``: autograd's path against the GEMM's epilogue.

Under gradient accumulation every micro-batch after the first adds its weight gradient to the
weight's ``.grad``. Autograd's path: the grouped GEMM writes ``(E, N, K)`` (``torch._grouped_mm``,
CUTLASS, then the zeroing of empty experts) and a separate kernel adds it to ``.grad``.
``fused_grad_accumulation``: our Triton 2D x 2D kernel adds its fp32 tile to ``.grad`` in its epilogue
(``accumulate_into``), and leaves experts without rows untouched. Also timed: the Triton kernel
writing a new output (its GEMM speed against CUTLASS's). Shapes: Qwen3-30B-A3B's two expert weight
gradients at 8 x 1024 tokens, top-8 (65536 routed rows), with every expert getting rows and with
16 of 128 experts getting them all (what the whole-model benchmark's routing drifts towards).
Medians of CUDA-event times; each run checks the fused sum against autograd's. Then, with every
expert routed (where the Triton GEMM has to keep up with CUTLASS), the fused kernel and the Triton
GEMM alone under each tile configuration of ``SWEEP`` (``*``: the one ``config_2d2d`` picks).

Usage: ``python benchmarks/bench_grad_accumulation.py [--steps 20] [--out benchmarks/results]``
(writes ``grad_accumulation.json`` and ``.md``); ``--quick``: tiny shapes on the CPU (a smoke run,
under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

from moe_fp8.bench.report import run_env, script_args, write_report
from moe_fp8.bench.timing import event_median_ms
from moe_fp8.grouped_gemm import select_backend
from moe_fp8.grouped_gemm.triton_configs import SCALE_NONE, GemmConfig, config_2d2d
from moe_fp8.grouped_gemm.triton_kernel import triton_grouped_mm_2d2d

ROWS, EXPERTS = 65536, 128
SHAPES = {"gate_up": (1536, 2048), "down": (2048, 768)}
# (block_m, block_n, block_k, group_m, num_stages, num_warps); block_k is the reduction over rows
# (the 3- and 2-stage 128 x 128 tiles take 96 / 64 KiB of shared memory: two programs per SM, one's
# epilogue under the other's main loop)
SWEEP = tuple(GemmConfig(*c) for c in ((128, 128, 64, 8, 4, 8), (128, 128, 64, 8, 3, 8), (128, 128, 64, 8, 2, 8),
                                       (128, 256, 64, 8, 3, 8), (128, 256, 64, 8, 4, 8), (128, 128, 128, 8, 3, 8),
                                       (128, 128, 64, 8, 3, 4), (256, 128, 64, 8, 3, 8), (64, 256, 64, 8, 4, 4),
                                       (128, 64, 64, 8, 4, 4)))
QUICK = dict(rows=96, experts=8, shapes={"gate_up": (32, 64), "down": (64, 16)})


def _offsets(rows: int, experts: int, active: int, device: str) -> torch.Tensor:
    """int32 end offsets: ``rows`` split evenly over ``active`` experts at random positions."""
    sizes = torch.zeros(experts, dtype=torch.long)
    sizes[torch.randperm(experts)[:active]] = rows // active
    return sizes.cumsum(0).to(torch.int32).to(device)


def _autograd_path(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, grad: torch.Tensor) -> None:
    grad.add_(select_backend(None, a.device).bf16_mm_2d2d(a, b, offs))


def _row(name: str, n: int, k: int, rows: int, experts: int, active: int, steps: int, device: str) -> dict:
    offs = _offsets(rows, experts, active, device)
    a = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    start = torch.randn(experts, n, k, device=device, dtype=torch.bfloat16)
    plain, fused = start.clone(), start.clone()
    _autograd_path(a, b, offs, plain)
    triton_grouped_mm_2d2d(a, None, b, None, offs, accumulate_into=fused)
    gap = float((plain.float() - fused.float()).abs().max() / plain.float().abs().max())
    if gap > 2**-6:
        raise AssertionError(f"{name}: the fused sum differs from autograd's by {gap:.3g} of its largest value")
    grad = start.clone()
    autograd_ms = event_median_ms(lambda: _autograd_path(a, b, offs, grad), steps)
    fused_ms = event_median_ms(lambda: triton_grouped_mm_2d2d(a, None, b, None, offs, accumulate_into=grad), steps)
    triton_ms = event_median_ms(lambda: triton_grouped_mm_2d2d(a, None, b, None, offs), steps)
    gemm_ms = event_median_ms(lambda: torch._grouped_mm(a.t(), b, offs=offs), steps) if a.is_cuda else None
    return dict(gradient=name, experts=experts, n=n, k=k, rows=rows, active=active, autograd_ms=autograd_ms,
                fused_ms=fused_ms, triton_gemm_ms=triton_ms, grouped_mm_ms=gemm_ms, speedup=autograd_ms / fused_ms,
                max_gap=gap)


def _sweep_rows(name: str, n: int, k: int, rows: int, experts: int, steps: int, device: str) -> list[dict]:
    offs = _offsets(rows, experts, experts, device)
    a = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    start = torch.randn(experts, n, k, device=device, dtype=torch.bfloat16)
    expected = start.float() + select_backend(None, a.device).bf16_mm_2d2d(a, b, offs).float()
    grad = start.clone()  # the timed target, whose values drift as the timing adds to it
    picks = {config_2d2d(n, k, experts, SCALE_NONE, a.device, acc) for acc in (False, True)}
    out = []
    for cfg in SWEEP:
        fused = triton_grouped_mm_2d2d(a, None, b, None, offs, config=cfg, accumulate_into=start.clone()).float()
        gap = float((fused - expected).abs().max() / expected.abs().max())
        if gap > 2**-6:
            raise AssertionError(f"{name} {cfg}: the fused sum differs from autograd's by {gap:.3g}")
        fused_ms = event_median_ms(lambda: triton_grouped_mm_2d2d(a, None, b, None, offs, config=cfg,
                                                                  accumulate_into=grad), steps)
        gemm_ms = event_median_ms(lambda: triton_grouped_mm_2d2d(a, None, b, None, offs, config=cfg), steps)
        tile = (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.num_stages} w{cfg.num_warps}"
                + (" *" if cfg in picks else ""))
        out.append(dict(gradient=name, experts=experts, n=n, k=k, config=tile, fused_ms=fused_ms,
                        triton_gemm_ms=gemm_ms, max_gap=gap))
    return out


def main() -> None:
    args, device = script_args(__doc__, 20)
    rows, experts, shapes = (QUICK["rows"], QUICK["experts"], QUICK["shapes"]) if args.quick else (
        ROWS, EXPERTS, SHAPES)
    torch.manual_seed(0)
    table = [_row(name, n, k, rows, experts, active, args.steps, device)
             for active in (experts, experts // 8) for name, (n, k) in shapes.items()]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    body = ["| gradient (E, N, K) | experts with rows | autograd: GEMM + add ms | fused ms | speedup | "
            "Triton GEMM alone ms | torch._grouped_mm alone ms |", "|---|---:|---:|---:|---:|---:|---:|"]
    body += [f"| {r['gradient']} ({r['experts']}, {r['n']}, {r['k']}) | {r['active']} | {fmt(r['autograd_ms'])} | "
             f"{fmt(r['fused_ms'])} | {r['speedup']:.2f}x | {fmt(r['triton_gemm_ms'])} | {fmt(r['grouped_mm_ms'])} |"
             for r in table]
    sweep = [r for name, (n, k) in shapes.items() for r in _sweep_rows(name, n, k, rows, experts, args.steps, device)]
    body += ["", "Tile configurations, every expert routed (block_m x block_n x block_k, stages, warps; `*`: picked):",
             "", "| gradient | configuration | fused ms | Triton GEMM alone ms |", "|---|---|---:|---:|"]
    body += [f"| {r['gradient']} | {r['config']} | {fmt(r['fused_ms'])} | {fmt(r['triton_gemm_ms'])} |" for r in sweep]
    print("\n".join(body))
    stem = "grad_accumulation" + ("_quick" if args.quick else "")
    write_report(args.out, stem, run_env(device), table + sweep,
                 "A BF16 expert weight gradient added to .grad: autograd's GEMM + add against the GEMM's epilogue",
                 f"`python benchmarks/bench_grad_accumulation.py --steps {args.steps}`, {rows} routed rows, "
                 "medians of CUDA-event times", body)


if __name__ == "__main__":
    main()
