"""GEMM-only throughput of the Triton FP8 grouped GEMM against torch's grouped GEMMs (one GPU run).

For each MoE shape (balanced random routing, ``offs[-1] == M``), side by side in one process:

* ``bf16``: ``torch._grouped_mm`` on bf16 operands (the baseline);
* ``cuda_fast`` / ``cuda``: ``torch._scaled_grouped_mm`` rowwise FP8 with ``use_fast_accum`` True /
  False (the ``cuda`` backend);
* ``triton[<config>]``: :func:`triton_grouped_mm_2d3d` for the default config and a few variants.

plus the 2D x 2D wgrad form on one shape (column-major operands as the wgrad quantizer returns
them; groups padded to 16 rows, which the cuda op needs, and unpadded for Triton alone; and, as
a diagnostic, with a row stride of M + 64 instead of the power-of-two M).

Times are ``triton.testing.do_bench`` medians on random data; TFLOP/s = 2 M N K / time. SQNR of
each FP8 output is against the ``cuda`` output (same FP8 inputs) and against bf16. Results go to
``<out>/grouped_gemm_triton.json`` and ``.md``. Run: ``python benchmarks/bench_grouped_gemm_triton.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform

import torch
import triton
from triton.testing import do_bench

from moe_fp8.bench.grouped_gemm import SHAPES
from moe_fp8.grouped_gemm.triton_configs import GemmConfig, config_2d2d, config_2d3d
from moe_fp8.grouped_gemm.triton_kernel import triton_grouped_mm_2d2d, triton_grouped_mm_2d3d
from moe_fp8.quant.reference import quantize_expert_colwise, quantize_group_colwise, quantize_rowwise
from moe_fp8.testing import random_offsets

# name, M (routed rows), K, N, E
SHAPES_2D3D = [
    ("dsv3_gate_up", 32768, 7168, 4096, 8),
    ("dsv3_down", 32768, 2048, 7168, 8),
    ("llama4_gate_up", 16384, 5120, 16384, 16),
    ("qwen3_gate_up", 65536, 2048, 1536, 128),
]
# wgrad dW (E, N, K) = dy (M, N).T @ x (M, K): DeepSeek-V3 gate_up E=8 by default; ``--wgrad-shapes``
# adds every other shape of bench_grouped_gemm (short groups: 32 experts, Llama 4; Qwen3's 128).
SHAPE_2D2D = (f"{SHAPES[0][0]} wgrad", *SHAPES[0][1:])
MORE_2D2D = [(f"{name} wgrad", *dims) for name, *dims in SHAPES[1:]]

VARIANTS_2D3D = {
    "128x256x128_s3": GemmConfig(128, 256, 128, 8, 3, 8),
    "128x256x128_s4": GemmConfig(128, 256, 128, 8, 4, 8),
    "128x128x128_s4": GemmConfig(128, 128, 128, 8, 4, 8),
    "256x128x128_s3": GemmConfig(256, 128, 128, 8, 3, 8),
    "128x256x64_s4": GemmConfig(128, 256, 64, 8, 4, 8),
    "128x128x128_s4_precise": GemmConfig(128, 128, 128, 8, 4, 8, fast_accum=False),
}
VARIANTS_2D2D = {
    "128x256x128_s3": GemmConfig(128, 256, 128, 8, 3, 8),
    "256x128x128_s3": GemmConfig(256, 128, 128, 8, 3, 8),
    "128x256x64_s4": GemmConfig(128, 256, 64, 8, 4, 8),
    "128x256x128_s3_g16": GemmConfig(128, 256, 128, 16, 3, 8),
    "128x128x128_s4_precise": GemmConfig(128, 128, 128, 8, 4, 8, fast_accum=False),
    # Two programs per multiprocessor (<= ~110 KB of shared memory each), so that one program's
    # epilogue can overlap another's main loop: short groups run few reduction steps per tile.
    "128x128x128_s3_w8": GemmConfig(128, 128, 128, 8, 3, 8),
    "128x128x128_s3_w4": GemmConfig(128, 128, 128, 8, 3, 4),
    "128x128x64_s4_w4": GemmConfig(128, 128, 64, 8, 4, 4),
    "64x256x128_s3_w4": GemmConfig(64, 256, 128, 8, 3, 4),
}


def _cfg_name(cfg: GemmConfig) -> str:
    acc = "" if cfg.fast_accum else "_precise"
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}_s{cfg.num_stages}_w{cfg.num_warps}_g{cfg.group_m}{acc}"


def _time(fn) -> float | str:
    try:
        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    except Exception as exc:  # a config that does not fit (shared memory) is reported, not fatal
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def _sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    """:func:`moe_fp8.testing.sqnr` computed on the GPU (the outputs are too big to copy)."""
    ref, x = ref.double(), x.double()
    return float(20 * torch.log10(torch.linalg.vector_norm(ref) / torch.linalg.vector_norm(ref - x)))


def _try(fn):
    try:
        return fn()
    except Exception as exc:
        print(f"reference failed: {type(exc).__name__}: {exc}", flush=True)
        return None


def _randn(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def bench_2d3d(name, M, K, N, E, variants, gen, rows):
    flops = 2 * M * N * K
    x = _randn(M, K, gen=gen)
    w = _randn(E, N, K, gen=gen, scale=K**-0.5)
    offs = random_offsets(M, E, "balanced", generator=torch.Generator().manual_seed(M + E)).cuda()
    a, sa = quantize_rowwise(x)
    b, sb = quantize_expert_colwise(w)
    ref_bf16 = _try(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))
    impls = {"bf16": (lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), None)}
    has_cuda_op = hasattr(torch, "_scaled_grouped_mm") and torch.cuda.get_device_capability()[0] == 9
    if has_cuda_op:
        for label, fast in (("cuda_fast", True), ("cuda", False)):
            impls[label] = (
                lambda fast=fast: torch._scaled_grouped_mm(
                    a, b.transpose(-2, -1), sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=fast
                ),
                None,
            )
    default = config_2d3d(N, K, E, 1, x.device)
    configs = {"default": default, **{k: v for k, v in variants.items() if v != default}}
    for label, cfg in configs.items():
        impls[f"triton[{label}]"] = (lambda cfg=cfg: triton_grouped_mm_2d3d(a, sa, b, sb, offs, config=cfg), cfg)
    cuda_out = _try(impls["cuda"][0]) if has_cuda_op else None
    for label, (fn, cfg) in impls.items():
        ms = _time(fn)
        rec = dict(form="2d3d", shape=name, M=M, K=K, N=N, E=E, impl=label, config=cfg and _cfg_name(cfg))
        if isinstance(ms, str):
            rec["error"] = ms
        else:
            out = fn()
            rec.update(ms=ms, tflops=flops / ms / 1e9)
            if ref_bf16 is not None:
                rec["sqnr_vs_bf16"] = _sqnr(ref_bf16, out)
            if cuda_out is not None and label != "bf16":
                rec["sqnr_vs_cuda"] = _sqnr(cuda_out, out)
        rows.append(rec)
        print(_fmt(rec), flush=True)
    del x, w, a, b, ref_bf16, cuda_out
    torch.cuda.empty_cache()


def bench_2d2d(name, M, K, N, E, variants, gen, rows):
    flops = 2 * M * N * K
    dy = _col_major(_randn(M, N, gen=gen))
    x = _col_major(_randn(M, K, gen=gen))
    cpu_gen = torch.Generator().manual_seed(M + E)
    offs16 = random_offsets(M, E, "balanced", multiple_of=16, generator=cpu_gen).cuda()
    offs1 = random_offsets(M, E, "balanced", generator=cpu_gen).cuda()
    quant = {}
    for tag, offs in (("aligned16", offs16), ("unaligned", offs1)):
        (a, sa), (b, sb) = quantize_group_colwise(dy, offs), quantize_group_colwise(x, offs)
        quant[tag] = (_col_major(a), sa, _col_major(b), sb, offs)
    ref_bf16 = _try(lambda: torch._grouped_mm(dy.t(), x, offs=offs16))
    impls = {"bf16": (lambda: torch._grouped_mm(dy.t(), x, offs=offs16), None, "aligned16")}
    a16, sa16, b16, sb16, _ = quant["aligned16"]
    has_cuda_op = hasattr(torch, "_scaled_grouped_mm") and torch.cuda.get_device_capability()[0] == 9
    if has_cuda_op:
        for label, fast in (("cuda_fast", True), ("cuda", False)):
            impls[label] = (
                lambda fast=fast: torch._scaled_grouped_mm(
                    a16.t(), b16, sa16.flatten(), sb16.flatten(), offs=offs16, out_dtype=torch.bfloat16,
                    use_fast_accum=fast,
                ),
                None,
                "aligned16",
            )
    default = config_2d2d(N, K, E, 1, dy.device)
    configs = {"default": default, **{k: v for k, v in variants.items() if v != default}}
    for label, cfg in configs.items():
        impls[f"triton[{label}]"] = (lambda cfg=cfg: triton_grouped_mm_2d2d(*quant["aligned16"], config=cfg), cfg,
                                     "aligned16")  # fmt: skip
    impls["triton[default]/unaligned"] = (lambda: triton_grouped_mm_2d2d(*quant["unaligned"]), default, "unaligned")
    # Diagnostic: the same operands with a row stride of M + 64 instead of M (a power of two here).
    padded = [torch.empty(t.shape[1], M + 64, dtype=t.dtype, device=t.device)[:, :M].t() for t in (a16, b16)]
    for p, t in zip(padded, (a16, b16)):
        p.copy_(t)
    impls["triton[default]/stride_M+64"] = (
        lambda: triton_grouped_mm_2d2d(padded[0], sa16, padded[1], sb16, offs16), default, "aligned16")

    cuda_out = _try(impls["cuda"][0]) if has_cuda_op else None
    for label, (fn, cfg, tag) in impls.items():
        ms = _time(fn)
        rec = dict(form="2d2d", shape=name, M=M, K=K, N=N, E=E, impl=label, groups=tag, config=cfg and _cfg_name(cfg))
        if isinstance(ms, str):
            rec["error"] = ms
        else:
            out = fn()
            rec.update(ms=ms, tflops=flops / ms / 1e9)
            if tag == "aligned16" and ref_bf16 is not None:
                rec["sqnr_vs_bf16"] = _sqnr(ref_bf16, out)
                if cuda_out is not None and label != "bf16":
                    rec["sqnr_vs_cuda"] = _sqnr(cuda_out, out)
        rows.append(rec)
        print(_fmt(rec), flush=True)


def _fmt(rec) -> str:
    if "error" in rec:
        return f"{rec['shape']:<20} {rec['impl']:<32} ERROR {rec['error']}"
    s = f"{rec['shape']:<20} {rec['impl']:<32} {rec['ms']:8.3f} ms {rec['tflops']:7.0f} TFLOP/s"
    for key in ("sqnr_vs_cuda", "sqnr_vs_bf16"):
        if key in rec:
            s += f"  {key}={rec[key]:.1f}"
    return s


def _markdown(meta, rows) -> str:
    lines = [
        "# Triton FP8 grouped GEMM: GEMM-only throughput",
        "",
        f"{meta['date']}, {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}. "
        "`do_bench` medians, balanced random routing, random data. TFLOP/s = 2MNK / time. "
        "`cuda` = `torch._scaled_grouped_mm` rowwise (`use_fast_accum` False; `cuda_fast`: True). "
        "`triton[...]`: tile BMxBNxBK, stages, warps, group-M; `precise` promotes the FP8 accumulator "
        "every BK (else fast accumulation). SQNR in dB.",
        "",
        "| form | shape | impl | config | ms | TFLOP/s | vs cuda | vs cuda_fast | SQNR vs cuda | SQNR vs bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ref = {(r["shape"], r["impl"]): r.get("tflops") for r in rows}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['form']} | {r['shape']} | {r['impl']} | {r['config']} | error: {r['error']} |||||")
            continue
        rel = [ref.get((r["shape"], k)) for k in ("cuda", "cuda_fast")]
        rel = [f"{r['tflops'] / v:.2f}" if v else "" for v in rel]
        sq = [f"{r[k]:.1f}" if k in r else "" for k in ("sqnr_vs_cuda", "sqnr_vs_bf16")]
        lines.append(
            f"| {r['form']} | {r['shape']} | {r['impl']} | {r['config'] or ''} | {r['ms']:.3f} | {r['tflops']:.0f} "
            f"| {rel[0]} | {rel[1]} | {sq[0]} | {sq[1]} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    parser.add_argument("--no-variants", action="store_true", help="only the default Triton configs")
    parser.add_argument("--wgrad-only", action="store_true", help="skip the 2D x 3D (forward / dgrad) shapes")
    parser.add_argument("--wgrad-shapes", action="store_true", help="the 2D x 2D form on every wgrad shape")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict] = []
    v3, v2 = ({}, {}) if args.no_variants else (VARIANTS_2D3D, VARIANTS_2D2D)
    for shape in [] if args.wgrad_only else SHAPES_2D3D:
        bench_2d3d(*shape, v3, gen, rows)
    for shape in [SHAPE_2D2D, *MORE_2D2D] if args.wgrad_shapes else [SHAPE_2D2D]:
        bench_2d2d(*shape, v2, gen, rows)
        torch.cuda.empty_cache()
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
    )
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grouped_gemm_triton.json").write_text(json.dumps(dict(meta=meta, results=rows), indent=1))
    (out / "grouped_gemm_triton.md").write_text(_markdown(meta, rows))
    print(_markdown(meta, rows))


if __name__ == "__main__":
    main()
