"""The dgrad of an uncached expert weight: its FP8 layout written and then read, against quantized
inside the GEMM.

Uncached, the backward of ``fp8_grouped_mm`` gets the BF16 weight ``w (E, N, K)`` and its amax
over N (both from the forward) and needs ``dx = grad_out @ w[g]``. Two ways: the dgrad layout
kernel writes ``w``'s FP8 ``(E, K, N)`` copy (one read of ``w``, one FP8 write) and the Triton
2D x 3D GEMM reads it; or the GEMM reads ``w``'s BF16 tiles and quantizes them in registers with
the same scales (``triton_grouped_mm_dgrad_quantize_w``): no FP8 copy, but each weight tile is
converted once per row tile of its expert. Shapes at 8 x 1024 tokens: Qwen3-30B-A3B's two expert
weights (128 experts) and DeepSeek-V3's (32 experts) at top-8 (65536 routed rows), Llama 4 Scout's
(16 experts, stored ``(E, K, N)`` as its checkpoints hold them) at top-1 (8192 rows), with every
expert routed and with an eighth of them getting all the rows. Medians of CUDA-event times. Each
row also gives the largest difference of the two fp32 outputs over the largest output (``max
gap``): fp32 summation order at most, if the FP8 tiles are equal. Then the in-GEMM dgrad under each tile
configuration of ``SWEEP`` (``*``: the one ``config_dgrad_quantize_w`` picks).

Usage: ``python benchmarks/bench_dgrad_quantize_w.py [--steps 20] [--out benchmarks/results]``
(writes ``dgrad_quantize_w.json`` and ``.md``); ``--quick``: tiny shapes on the CPU (a smoke run,
under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

from moe_fp8.bench.report import run_env, script_args, write_report
from moe_fp8.bench.timing import event_median_ms
from moe_fp8.grouped_gemm.triton_configs import GemmConfig, config_dgrad_quantize_w
from moe_fp8.grouped_gemm.triton_kernel import triton_grouped_mm_2d3d, triton_grouped_mm_dgrad_quantize_w
from moe_fp8.quant.ops import triton_quantize_expert_colwise_from_amax
from moe_fp8.quant.reference import quantize_rowwise

# model -> (experts, routed rows, weights stored (E, K, N), {weight: (N, K)}): w (E, N, K), the dgrad
# reduces over N; nn.Linear layout (K contiguous) unless stored (E, K, N) (N contiguous, Llama 4)
MODELS = {"qwen3_30b": (128, 65536, False, {"gate_up": (1536, 2048), "down": (2048, 768)}),
          "dsv3": (32, 65536, False, {"gate_up": (4096, 7168), "down": (7168, 2048)}),
          "llama4": (16, 8192, True, {"gate_up": (16384, 5120), "down": (5120, 8192)})}
# (block_m, block_n, block_k, group_m, num_stages, num_warps)
# (block_m rows: the MMA's N side; block_n output columns: its M side)
SWEEP = tuple(GemmConfig(*c) for c in ((128, 128, 64, 8, 4, 8), (128, 128, 64, 8, 3, 8), (256, 128, 64, 8, 3, 8),
                                       (128, 128, 128, 8, 3, 8), (128, 256, 64, 8, 3, 8), (128, 128, 64, 8, 4, 4),
                                       (64, 128, 64, 8, 4, 4), (256, 128, 64, 8, 4, 8)))
QUICK_MODELS = {"qwen3_30b": (8, 96, False, {"gate_up": (32, 64), "down": (64, 16)}),
                "llama4": (8, 96, True, {"gate_up": (32, 64)})}


def routed_offsets(rows: int, experts: int, active: int, device: str) -> torch.Tensor:
    """int32 end offsets: ``rows`` split evenly over ``active`` experts at random positions."""
    sizes = torch.zeros(experts, dtype=torch.long)
    sizes[torch.randperm(experts)[:active]] = rows // active
    return sizes.cumsum(0).to(torch.int32).to(device)


def expert_weight(n: int, k: int, experts: int, in_out: bool, device: str) -> torch.Tensor:
    """A bf16 weight ``(E, n, k)``: a transposed view of ``(E, k, n)`` storage when ``in_out``."""
    if in_out:
        return (torch.randn(experts, k, n, device=device, dtype=torch.bfloat16) * 0.02).transpose(1, 2)
    return torch.randn(experts, n, k, device=device, dtype=torch.bfloat16) * 0.02


def rowwise_fp8(rows: int, cols: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bf16 ``(rows, cols)`` quantized per row: ``(q, scale)``."""
    return quantize_rowwise(torch.randn(rows, cols, device=device, dtype=torch.bfloat16))


def compared(meta: dict, layout, gemm, fused, steps: int) -> dict:
    """``meta`` with the median ms of layout + GEMM, the layout alone, the GEMM alone and the GEMM that
    quantizes the weight itself, and ``max_gap``: the largest difference of the two fp32 outputs over
    the largest output. ``layout()`` -> ``(q, s)``; ``gemm(q, s, out_dtype)``; ``fused(out_dtype)``."""
    q, s = layout()
    return dict(meta, two_step_ms=event_median_ms(lambda: gemm(*layout(), torch.bfloat16), steps),
                layout_ms=event_median_ms(layout, steps),
                gemm_ms=event_median_ms(lambda: gemm(q, s, torch.bfloat16), steps),
                fused_ms=event_median_ms(lambda: fused(torch.bfloat16), steps),
                max_gap=max_gap(fused(torch.float32), gemm(q, s, torch.float32)))


def max_gap(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference of two fp32 outputs over the largest output: fp32 accumulation order
    (about 1e-6) if the in-GEMM FP8 tiles equal the layout kernel's; one differing FP8 value shows."""
    return float((out - ref).abs().max() / ref.abs().max())


def _problem(n: int, k: int, rows: int, experts: int, active: int, in_out: bool, device: str) -> tuple:
    """``(g, gs, w, amax, offs)``: grad_out's rowwise FP8 ``(rows, n)``, the weight ``(E, n, k)`` (a
    transposed view of ``(E, k, n)`` storage when ``in_out``), its amax over N."""
    g, gs = rowwise_fp8(rows, n, device)
    w = expert_weight(n, k, experts, in_out, device)
    return g, gs, w, w.float().abs().amax(dim=1), routed_offsets(rows, experts, active, device)


def _two_step(g, gs, w, amax, offs, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    q, s = triton_quantize_expert_colwise_from_amax(w, amax)
    return triton_grouped_mm_2d3d(g, gs, q, s, offs, out_dtype)


def _fused(g, gs, w, amax, offs, config: GemmConfig | None = None,
           out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return triton_grouped_mm_dgrad_quantize_w(g, gs, w, amax, offs, out_dtype, config=config)


def _gap(p: tuple, config: GemmConfig | None = None) -> float:
    return max_gap(_fused(*p, config, torch.float32), _two_step(*p, out_dtype=torch.float32))


def _row(model: str, name: str, n: int, k: int, rows: int, experts: int, active: int, in_out: bool, steps: int,
         device: str) -> dict:
    p = _problem(n, k, rows, experts, active, in_out, device)
    g, gs, w, amax, offs = p
    meta = dict(model=model, weight=name, experts=experts, n=n, k=k, rows=rows, active=active)
    return compared(meta, lambda: triton_quantize_expert_colwise_from_amax(w, amax),
                    lambda q, s, dtype: triton_grouped_mm_2d3d(g, gs, q, s, offs, dtype),
                    lambda dtype: _fused(*p, out_dtype=dtype), steps)


def _sweep_rows(model: str, name: str, n: int, k: int, rows: int, experts: int, active: int, in_out: bool,
                steps: int, device: str) -> list[dict]:
    p = _problem(n, k, rows, experts, active, in_out, device)
    pick = config_dgrad_quantize_w(p[-1].device)
    out = []
    for cfg in SWEEP if device == "cuda" else (pick,):
        tile = (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.num_stages} w{cfg.num_warps}"
                + (" *" if cfg == pick else ""))
        out.append(dict(model=model, weight=name, experts=experts, active=active, config=tile,
                        fused_ms=event_median_ms(lambda: _fused(*p, cfg), steps), max_gap=_gap(p, cfg)))
    return out


def weight_cases(models: dict) -> list[tuple]:
    """``(model, weight, n, k, routed rows, experts, experts with rows, in_out)`` of every weight of
    ``models`` (``MODELS``' layout), with every expert routed and with an eighth of them."""
    return [(model, name, n, k, rows, experts, active, in_out)
            for model, (experts, rows, in_out, shapes) in models.items() for active in (experts, experts // 8)
            for name, (n, k) in shapes.items()]


def table_lines(table: list[dict]) -> list[str]:
    """The markdown table of ``_row`` results: layout + GEMM against quantized in the GEMM, per weight."""
    body = ["| model | weight (E, N, K) | routed rows | experts with rows | layout + GEMM ms | layout ms | GEMM ms | "
            "quantized in the GEMM ms | speedup | max gap |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    return body + [f"| {r['model']} | {r['weight']} ({r['experts']}, {r['n']}, {r['k']}) | {r['rows']} | "
                   f"{r['active']} | {r['two_step_ms']:.3f} | {r['layout_ms']:.3f} | {r['gemm_ms']:.3f} | "
                   f"{r['fused_ms']:.3f} | {r['two_step_ms'] / r['fused_ms']:.2f}x | {r['max_gap']:.1e} |"
                   for r in table]


def main() -> None:
    args, device = script_args(__doc__, 20)
    models = QUICK_MODELS if args.quick else MODELS
    torch.manual_seed(0)
    table = [_row(*case, args.steps, device) for case in weight_cases(models)]
    body = table_lines(table)
    sweep = [r for case in weight_cases(models) for r in _sweep_rows(*case, args.steps, device)]
    body += ["", "Quantized in the GEMM, per tile configuration (block_m x block_n x block_k, stages, warps; `*`: "
             "picked):", "", "| model | weight | experts with rows | configuration | ms | max gap |",
             "|---|---|---:|---|---:|---|"]
    body += [f"| {r['model']} | {r['weight']} | {r['active']} | {r['config']} | {r['fused_ms']:.3f} | "
             f"{r['max_gap']:.1e} |" for r in sweep]
    print("\n".join(body))
    stem = "dgrad_quantize_w" + ("_quick" if args.quick else "")
    write_report(args.out, stem, run_env(device), table + sweep,
                 "The dgrad of an uncached expert weight: FP8 layout + GEMM against quantized inside the GEMM",
                 f"`python benchmarks/bench_dgrad_quantize_w.py --steps {args.steps}`, routed rows as the "
                 "table says, medians of CUDA-event times", body)


if __name__ == "__main__":
    main()
