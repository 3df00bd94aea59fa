"""An expert weight gradient added to ``.grad``: autograd's path against the GEMM's epilogue.

Under gradient accumulation every micro-batch after the first adds its weight gradient to the
weight's ``.grad``. Autograd's path: the platform backend's grouped GEMM writes ``(E, N, K)``
(CUTLASS: ``torch._grouped_mm`` for BF16 operands, ``torch._scaled_grouped_mm`` for FP8 ones, then
the zeroing of empty experts) and a separate kernel adds it to ``.grad``.
``fused_grad_accumulation``: our Triton 2D x 2D kernel adds its fp32 tile to ``.grad`` in its epilogue
(``accumulate_into``), and leaves experts without rows untouched. Also timed: each GEMM writing a
new output (the Triton kernel's speed against CUTLASS's). Shapes at 8 x 1024 tokens, top-8 (65536
routed rows): Qwen3-30B-A3B's two expert weight gradients with BF16 operands (its recipe at these
sizes), DeepSeek-V3's (32 experts) with rowwise FP8 operands (column-major, per-expert column
scales); with every expert getting rows and with an eighth of them getting all the rows (what the
whole-model benchmark's routing drifts towards).
Medians of CUDA-event times; each run checks the fused sum against autograd's. Then, with every
expert routed (where the Triton GEMM has to keep up with CUTLASS), the fused kernel and the Triton
GEMM alone under each tile configuration of ``SWEEP``, for both operand types (FP8: ``block_k``
doubled; ``*``: the ones ``config_2d2d`` picks).

Usage: ``python benchmarks/bench_grad_accumulation.py [--steps 20] [--out benchmarks/results]``
(writes ``grad_accumulation.json`` and ``.md``); ``--quick``: tiny shapes on the CPU (a smoke run,
under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from moe_fp8.bench.report import run_env, script_args, write_report
from moe_fp8.bench.timing import event_median_ms
from moe_fp8.grouped_gemm import select_backend
from moe_fp8.grouped_gemm.triton_configs import SCALE_NONE, SCALE_ROWWISE, GemmConfig, config_2d2d
from moe_fp8.grouped_gemm.triton_kernel import triton_grouped_mm_2d2d
from moe_fp8.quant.reference import quantize_group_colwise

ROWS = 65536
# model -> (experts, FP8 operands, {gradient: (N, K)})
MODELS = {"qwen3_30b": (128, False, {"gate_up": (1536, 2048), "down": (2048, 768)}),
          "dsv3": (32, True, {"gate_up": (4096, 7168), "down": (7168, 2048)})}
# BF16 (block_m, block_n, block_k, group_m, num_stages, num_warps); block_k is the reduction over rows,
# doubled for FP8 operands (same shared memory per stage). The 3- and 2-stage 128 x 128 tiles take 96 / 64
# KiB: two programs per SM, one's epilogue under the other's main loop.
SWEEP = tuple(GemmConfig(*c) for c in ((128, 128, 64, 8, 4, 8), (128, 128, 64, 8, 3, 8), (128, 128, 64, 8, 2, 8),
                                       (128, 256, 64, 8, 3, 8), (128, 256, 64, 8, 4, 8), (128, 128, 128, 8, 3, 8),
                                       (128, 128, 64, 8, 3, 4), (128, 128, 64, 8, 2, 4), (256, 128, 64, 8, 3, 8),
                                       (64, 256, 64, 8, 4, 4), (128, 64, 64, 8, 4, 4)))
QUICK_ROWS = 128
QUICK_MODELS = {"qwen3_30b": (8, False, {"gate_up": (32, 64), "down": (64, 16)}),
                "dsv3": (8, True, {"gate_up": (32, 48), "down": (48, 16)})}


def _offsets(rows: int, experts: int, active: int, device: str) -> torch.Tensor:
    """int32 end offsets: ``rows`` split evenly over ``active`` experts at random positions."""
    sizes = torch.zeros(experts, dtype=torch.long)
    sizes[torch.randperm(experts)[:active]] = rows // active
    return sizes.cumsum(0).to(torch.int32).to(device)


def _operands(n: int, k: int, rows: int, offs: torch.Tensor, fp8: bool, device: str) -> tuple:
    """``(a, scale_a, b, scale_b)``: bf16 row-major ``(rows, n)`` / ``(rows, k)`` with ``None`` scales, or
    their rowwise FP8 wgrad form (column-major, scales ``(E, n)`` / ``(E, k)``)."""
    a = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    if not fp8:
        return a, None, b, None
    (qa, sa), (qb, sb) = quantize_group_colwise(a, offs), quantize_group_colwise(b, offs)
    return qa.t().contiguous().t(), sa, qb.t().contiguous().t(), sb


def _library_gemm(ops: tuple, offs: torch.Tensor) -> torch.Tensor:
    """The platform backend's weight gradient (CUTLASS on Hopper), empty experts zeroed."""
    a, sa, b, sb = ops
    backend = select_backend(None, a.device)
    return backend.bf16_mm_2d2d(a, b, offs) if sa is None else backend.mm_2d2d(a, sa, b, sb, offs, torch.bfloat16)


def _fused(ops: tuple, offs: torch.Tensor, grad: torch.Tensor, config: GemmConfig | None = None) -> torch.Tensor:
    return triton_grouped_mm_2d2d(*ops, offs, config=config, accumulate_into=grad)


def _checked(name: str, got: torch.Tensor, expected: torch.Tensor) -> float:
    gap = float((got.float() - expected).abs().max() / expected.abs().max())
    if gap > 2**-6:
        raise AssertionError(f"{name}: the fused sum differs from autograd's by {gap:.3g} of its largest value")
    return gap


def _problem(n: int, k: int, rows: int, experts: int, active: int, fp8: bool, device: str) -> tuple:
    """``(offs, ops, start, expected)``: the routing, the operands, a ``.grad`` to add to and autograd's
    sum (fp32) of it and the platform backend's gradient."""
    offs = _offsets(rows, experts, active, device)
    ops = _operands(n, k, rows, offs, fp8, device)
    start = torch.randn(experts, n, k, device=device, dtype=torch.bfloat16)
    return offs, ops, start, start.float() + _library_gemm(ops, offs).float()


def _row(model: str, name: str, n: int, k: int, rows: int, experts: int, active: int, fp8: bool, steps: int,
         device: str) -> dict:
    offs, ops, start, expected = _problem(n, k, rows, experts, active, fp8, device)
    gap = _checked(name, _fused(ops, offs, start.clone()), expected)
    grad = start.clone()
    autograd_ms = event_median_ms(lambda: grad.add_(_library_gemm(ops, offs)), steps)
    fused_ms = event_median_ms(lambda: _fused(ops, offs, grad), steps)
    triton_ms = event_median_ms(lambda: triton_grouped_mm_2d2d(*ops, offs), steps)
    library_ms = event_median_ms(lambda: _library_gemm(ops, offs), steps)
    return dict(model=model, gradient=name, operands="fp8" if fp8 else "bf16", experts=experts, n=n, k=k, rows=rows,
                active=active, autograd_ms=autograd_ms, fused_ms=fused_ms, triton_gemm_ms=triton_ms,
                library_gemm_ms=library_ms, speedup=autograd_ms / fused_ms, max_gap=gap)


def _sweep_rows(model: str, name: str, n: int, k: int, rows: int, experts: int, fp8: bool, steps: int,
                device: str) -> list[dict]:
    """The weight gradient under each tile configuration of ``SWEEP``, every expert routed."""
    offs, ops, start, expected = _problem(n, k, rows, experts, experts, fp8, device)
    grad = start.clone()  # the timed target, whose values drift as the timing adds to it
    mode = SCALE_ROWWISE if fp8 else SCALE_NONE
    picks = {config_2d2d(n, k, experts, mode, offs.device, acc) for acc in (False, True)}
    out = []
    for cfg in (replace(c, block_k=2 * c.block_k) if fp8 else c for c in SWEEP):
        gap = _checked(f"{name} {cfg}", _fused(ops, offs, start.clone(), cfg), expected)
        fused_ms = event_median_ms(lambda: _fused(ops, offs, grad, cfg), steps)
        gemm_ms = event_median_ms(lambda: triton_grouped_mm_2d2d(*ops, offs, config=cfg), steps)
        tile = (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.num_stages} w{cfg.num_warps}"
                + (" *" if cfg in picks else ""))
        out.append(dict(model=model, gradient=name, operands="fp8" if fp8 else "bf16", experts=experts, n=n, k=k,
                        config=tile, fused_ms=fused_ms, triton_gemm_ms=gemm_ms, max_gap=gap))
    return out


def main() -> None:
    args, device = script_args(__doc__, 20)
    rows, models = (QUICK_ROWS, QUICK_MODELS) if args.quick else (ROWS, MODELS)
    torch.manual_seed(0)
    table = [_row(model, name, n, k, rows, experts, active, fp8, args.steps, device)
             for model, (experts, fp8, shapes) in models.items() for active in (experts, experts // 8)
             for name, (n, k) in shapes.items()]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    body = ["| model | gradient (E, N, K) | operands | experts with rows | autograd: GEMM + add ms | fused ms | "
            "speedup | Triton GEMM alone ms | library GEMM alone ms |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    body += [f"| {r['model']} | {r['gradient']} ({r['experts']}, {r['n']}, {r['k']}) | {r['operands']} | {r['active']} | "
             f"{fmt(r['autograd_ms'])} | {fmt(r['fused_ms'])} | {r['speedup']:.2f}x | {fmt(r['triton_gemm_ms'])} | "
             f"{fmt(r['library_gemm_ms'])} |" for r in table]
    sweep = [r for model, (experts, fp8, shapes) in models.items() for name, (n, k) in shapes.items()
             for r in _sweep_rows(model, name, n, k, rows, experts, fp8, args.steps, device)]
    body += ["", "Tile configurations, every expert routed (block_m x block_n x block_k, stages, warps; `*`: "
             "picked):", "", "| model | gradient | operands | configuration | fused ms | Triton GEMM alone ms |",
             "|---|---|---|---|---:|---:|"]
    body += [f"| {r['model']} | {r['gradient']} | {r['operands']} | {r['config']} | {fmt(r['fused_ms'])} | "
             f"{fmt(r['triton_gemm_ms'])} |" for r in sweep]
    print("\n".join(body))
    stem = "grad_accumulation" + ("_quick" if args.quick else "")
    write_report(args.out, stem, run_env(device), table + sweep,
                 "An expert weight gradient added to .grad: autograd's GEMM + add against the GEMM's epilogue",
                 f"`python benchmarks/bench_grad_accumulation.py --steps {args.steps}`, {rows} routed rows, "
                 "medians of CUDA-event times", body)


if __name__ == "__main__":
    main()
