"""The forward GEMM of an uncached expert weight: its FP8 layout written and then read, against quantized
inside the GEMM from the weight's row amax.

Uncached, the forward of ``fp8_grouped_mm`` quantizes ``w (E, N, K)`` per output row (the forward
layout kernel, which also reduces the dgrad's column amax from the same read) and the Triton 2D x 3D
GEMM reads the FP8 copy. The in-GEMM dgrad kernel (``triton_grouped_mm_dgrad_quantize_w``) computes
the same product from the BF16 weight when it is handed ``w.transpose(1, 2)`` and ``w``'s row amax
``(E, N)``: per output column scales, the FP8 tiles equal the forward layout's. The amax must be
known before the GEMM: the experts' amax-only weight cache (``Fp8WeightCache(copies=False)``, one
read of the weight per weight state) supplies it; it is taken as given here. Same shapes as ``bench_dgrad_quantize_w.py`` (8 x 1024 tokens; Qwen3-30B-A3B and
DeepSeek-V3 top-8, Llama 4 Scout top-1 with its weights stored ``(E, K, N)``), every expert routed
and an eighth of them. Medians of CUDA-event times; ``max gap``: the largest difference of the two
fp32 outputs over the largest output.

Usage: ``python benchmarks/bench_forward_quantize_w.py [--steps 20] [--out benchmarks/results]``
(writes ``forward_quantize_w.json`` and ``.md``); ``--quick``: tiny shapes on the CPU (a smoke run,
under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
from bench_dgrad_quantize_w import (MODELS, QUICK_MODELS, compared, expert_weight, routed_offsets, rowwise_fp8,
                                    table_lines, weight_cases)

from moe_fp8.bench.report import run_env, script_args, write_report
from moe_fp8.grouped_gemm.triton_kernel import triton_grouped_mm_2d3d, triton_grouped_mm_dgrad_quantize_w
from moe_fp8.quant.ops import triton_quantize_expert_rowwise_with_amax


def _row(model: str, name: str, n: int, k: int, rows: int, experts: int, active: int, in_out: bool, steps: int,
         device: str) -> dict:
    """Token rows' rowwise FP8 ``(rows, k)`` through the weight ``(E, n, k)`` both ways."""
    x, xs = rowwise_fp8(rows, k, device)
    w = expert_weight(n, k, experts, in_out, device)
    row_amax, offs = w.float().abs().amax(dim=2), routed_offsets(rows, experts, active, device)
    meta = dict(model=model, weight=name, experts=experts, n=n, k=k, rows=rows, active=active)
    return compared(meta, lambda: triton_quantize_expert_rowwise_with_amax(w)[:2],
                    lambda q, s, dtype: triton_grouped_mm_2d3d(x, xs, q, s, offs, dtype),
                    lambda dtype: triton_grouped_mm_dgrad_quantize_w(x, xs, w.transpose(1, 2), row_amax, offs, dtype),
                    steps)


def main() -> None:
    args, device = script_args(__doc__, 20)
    models = QUICK_MODELS if args.quick else MODELS
    torch.manual_seed(0)
    table = [_row(*case, args.steps, device) for case in weight_cases(models)]
    body = table_lines(table)
    print("\n".join(body))
    stem = "forward_quantize_w" + ("_quick" if args.quick else "")
    write_report(args.out, stem, run_env(device), table,
                 "The forward of an uncached expert weight: FP8 layout + GEMM against quantized inside the GEMM",
                 f"`python benchmarks/bench_forward_quantize_w.py --steps {args.steps}`, routed rows as the "
                 "table says, the weight's row amax given, medians of CUDA-event times", body)


if __name__ == "__main__":
    main()
