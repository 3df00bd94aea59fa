"""Peak memory of one eager ``FP8MoE`` forward + backward, per recipe, with what is alive at the peak.

Without the weight cache (``cache_weights=False``: the weights' FP8 layouts are made in the step),
random bf16 tokens, the module's own router, one warm-up step first. Two shapes: ``amax`` (H 4096,
I 1024, 16 experts, top-4, 8192 tokens: 2049 rows per expert, so the rowwise backward reduces its
gradients' group amaxes itself and the GEMMs run apart from the SwiGLU and the combine; the shape of
``test_fp8_moe_gpu_peak_memory_above_bf16_by_the_fp8_operands_only``) and ``rows`` (Qwen3-30B-A3B's
experts, H 2048, I 768, 128 experts, top-8, 8192 tokens: 512 rows per expert, so the SwiGLU and
combine backwards write the FP8 rows the dgrads take, in the fused Functions of
``grouped_gemm.with_neighbors``). Peak: MiB allocated above what was held before the step; sites:
the lines that made the allocations alive at the peak (``moe_fp8.bench.step_profile``).

Usage: ``python benchmarks/bench_layer_peak.py [--out benchmarks/results]`` (CUDA only; writes
``layer_peak.json`` and ``.md``).
"""

from __future__ import annotations

import argparse

import torch

from moe_fp8 import FP8MoE
from moe_fp8.bench.layer import fwd_bwd
from moe_fp8.bench.report import run_env, write_report
from moe_fp8.bench.step_profile import peak_allocations

SHAPES = {"amax": (4096, 1024, 16, 4, 8192), "rows": (2048, 768, 128, 8, 8192)}  # H, I, E, top-k, tokens
RECIPES = ("bf16", "rowwise", "rowwise_gw_hp")
TOP_SITES = 8


def _row(shape: str, recipe: str) -> dict:
    H, I, E, k, T = SHAPES[shape]
    torch.manual_seed(0)
    moe = FP8MoE(H, I, E, k, recipe=recipe, device="cuda", dtype=torch.bfloat16, cache_weights=False)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    step = fwd_bwd(moe, x, dy)
    step()  # warm-up: kernels compiled, allocator settled
    moe.zero_grad(set_to_none=True)  # the step's own gradients count in its peak, as in the test
    x.grad = None
    peak = peak_allocations(step)
    mib = 2**30 / 2**20
    return dict(shape=shape, H=H, I=I, E=E, top_k=k, tokens=T, recipe=recipe,
                peak_mib=(peak["max_allocated_gib"] - peak["before_gib"]) * mib,
                sites=[[site, count, gib * mib] for site, count, gib in peak["all_sites"][:TOP_SITES]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_layer_peak.py: needs a CUDA GPU (the allocator's history)")
    rows = [_row(shape, recipe) for shape in SHAPES for recipe in RECIPES]
    body = ["| shape | H, I, E, top-k, tokens | recipe | peak MiB | vs bf16 MiB |", "|---|---|---|---:|---:|"]
    bf16 = {r["shape"]: r["peak_mib"] for r in rows if r["recipe"] == "bf16"}
    for r in rows:
        body.append(f"| {r['shape']} | {r['H']}, {r['I']}, {r['E']}, {r['top_k']}, {r['tokens']} | {r['recipe']} | "
                    f"{r['peak_mib']:.1f} | {r['peak_mib'] - bf16[r['shape']]:+.1f} |")
    for r in rows:
        body += ["", f"Alive at the peak, {r['shape']} {r['recipe']} (MiB, allocations, line):", ""]
        body += [f"- {mib:.1f} MiB, {count}: `{site}`" for site, count, mib in r["sites"]]
    print("\n".join(body))
    write_report(args.out, "layer_peak", run_env("cuda"), rows, "Eager FP8MoE layer: peak memory by recipe",
                 "`python benchmarks/bench_layer_peak.py`, one forward + backward after a warm-up, no weight cache",
                 body)


if __name__ == "__main__":
    main()
