"""Forward and forward+backward time of ``fp8_grouped_mm`` per recipe and backend, against BF16
``torch._grouped_mm`` and TorchAO's FP8-rowwise grouped GEMM, on MoE expert shapes.

For each shape: x ``(M, K)`` ~ N(0, 1), w ``(E, N, K)`` ~ N(0, 1) * 0.02, grad_out ~ N(0, 1), all
bf16; balanced random routing with every group a multiple of 16 rows (TorchAO's unpadded path
needs that; ours takes any sizes). Times are ``triton.testing.do_bench`` medians (ms) in one run,
side by side (``rounds`` alternated rounds: the median over rounds). TFLOP/s counts ``2 M K N`` per
GEMM (three for forward+backward). SQNR (dB) of output, dgrad and wgrad against the BF16 result.
``rowwise / cuda, weight cache`` serves the quantized weights from an ``Fp8WeightCache`` (weights
unchanged between calls: gradient accumulation). The FP8 GEMMs alone (operands quantized
beforehand) are timed too, per backend.
"""

from __future__ import annotations

import statistics
import sys

import torch

from ..grouped_gemm import Fp8WeightCache, available_backends, fp8_grouped_mm, library
from ..grouped_gemm.backends import get_backend
from ..grouped_gemm.padding import padded_offsets, padded_rows
from ..testing import random_offsets
from .timing import wall_median_ms

SHAPES = [  # name, M, K, N, E
    ("DeepSeek-V3 gate_up E=8", 32768, 7168, 4096, 8),
    ("DeepSeek-V3 gate_up E=32", 32768, 7168, 4096, 32),
    ("DeepSeek-V3 down E=8", 32768, 2048, 7168, 8),
    ("DeepSeek-V3 down E=32", 32768, 2048, 7168, 32),
    ("Llama 4 gate_up E=16", 16384, 5120, 16384, 16),
    ("Llama 4 down E=16", 16384, 8192, 5120, 16),
    ("Qwen3-30B-A3B E=128", 65536, 2048, 1536, 128),
]
SMOKE_SHAPES = [("smoke E=4", 256, 128, 64, 4), ("smoke E=8", 128, 64, 32, 8)]
RECIPE_BACKENDS = [  # blockwise runs its GEMMs on the Triton kernel on every backend
    ("rowwise", "cuda"),
    ("rowwise", "cuda_auto"),
    ("rowwise", "hybrid"),
    ("rowwise", "triton"),
    ("rowwise_gw_hp", "cuda"),
    ("rowwise_gw_hp", "hybrid"),
    ("rowwise_gw_hp", "triton"),
    ("tensorwise", "cuda"),
    ("tensorwise", "triton"),
    ("blockwise", "triton"),
    ("bf16", "cuda"),
]


def timer(fn, rep_ms: int) -> float:
    """Median ms: do_bench on the GPU, a wall-clock median on the CPU (smoke runs)."""
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, warmup=max(rep_ms // 4, 5), rep=rep_ms)
    return wall_median_ms(fn)


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    """``20 log10(||ref|| / ||ref - x||)`` in dB, in fp32 on the tensors' device (GB-sized grads)."""
    ref, x = ref.detach().float(), x.detach().float()
    noise = torch.linalg.vector_norm(ref - x)
    return float("inf") if noise == 0 else float(20 * torch.log10(torch.linalg.vector_norm(ref) / noise))


def torchao_fn():
    try:
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm
    except Exception as e:  # not installed, or not importable with this torch
        print(f"TorchAO not available: {type(e).__name__}: {e}", file=sys.stderr)
        return None

    def run(x, w, offs):
        return _to_fp8_rowwise_then_scaled_grouped_mm(
            x, w.transpose(-2, -1), offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False
        )

    return run


def bench_shape(name, M, K, N, E, methods, device, rep_ms, rounds=1):
    """One shape: every method checked once against BF16 (SQNR), then timed in ``rounds``
    alternated rounds (each round times every method once, forward and forward+backward), so a
    drift of the GPU over the run hits all methods alike; the row keeps the median and the range."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=gen).to(device, torch.bfloat16).requires_grad_()
    w = (torch.randn(E, N, K, generator=gen) * 0.02).to(device, torch.bfloat16).requires_grad_()
    g = torch.randn(M, N, generator=gen).to(device, torch.bfloat16)
    offs = random_offsets(M, E, "balanced", multiple_of=16, generator=gen, device=device)
    flop = 2 * M * K * N

    def fwd_bwd(fn):
        y = fn(x, w, offs)
        return (y, *torch.autograd.grad(y, (x, w), g))

    def failed(label, e):  # report, keep going with the other methods
        print(f"  {label}: FAILED {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
        return {"method": label, "error": f"{type(e).__name__}: {str(e)[:300]}"}

    ref = fwd_bwd(methods["bf16 torch._grouped_mm"])
    rows = {}
    for label, fn in methods.items():
        try:
            got = fwd_bwd(fn)
        except Exception as e:
            rows[label] = failed(label, e)
            continue
        rows[label] = {"method": label, "sqnr_out": sqnr(ref[0], got[0]), "sqnr_dgrad": sqnr(ref[1], got[1]),
                       "sqnr_wgrad": sqnr(ref[2], got[2]), "fwd_all": [], "fwd_bwd_all": []}
        del got
    for _ in range(rounds):
        for label, fn in methods.items():
            r = rows[label]
            if "error" in r:
                continue
            try:
                r["fwd_all"].append(timer(lambda: fn(x, w, offs), rep_ms))
                r["fwd_bwd_all"].append(timer(lambda: fwd_bwd(fn), rep_ms))
            except Exception as e:
                rows[label] = failed(label, e)
    for r in rows.values():
        if "error" not in r:
            t_fwd, t_all = statistics.median(r["fwd_all"]), statistics.median(r["fwd_bwd_all"])
            r.update(fwd_ms=t_fwd, fwd_bwd_ms=t_all, fwd_tflops=flop / t_fwd / 1e9,
                     fwd_bwd_tflops=3 * flop / t_all / 1e9)
    rows = list(rows.values())
    by = {r["method"]: r for r in rows if "error" not in r}
    base, ao = by.get("bf16 torch._grouped_mm"), by.get("TorchAO fp8 rowwise")
    for r in rows:
        if "error" in r:
            continue
        for key in ("fwd", "fwd_bwd"):
            r[f"{key}_speedup_vs_bf16"] = base[f"{key}_ms"] / r[f"{key}_ms"] if base else None
            r[f"{key}_speedup_vs_torchao"] = ao[f"{key}_ms"] / r[f"{key}_ms"] if ao else None
    gemm = bench_gemms_alone(x.detach(), w.detach(), g, offs, flop, device, rep_ms) if device.type == "cuda" else []
    return {"shape": name, "M": M, "K": K, "N": N, "E": E, "results": rows, "gemm_only": gemm}


def bench_gemms_alone(x, w, g, offs, flop, device, rep_ms):
    """FP8 GEMM time alone (rowwise operands quantized beforehand), per GPU backend."""
    out = []
    xq, xs = library.quantize_activation(x, "rowwise", "e4m3fn", False, True)
    wq, ws, _, _ = library.quantize_weight(w, "rowwise", "e4m3fn", False, True)
    bf16_fwd = timer(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), rep_ms)
    out.append({"backend": "bf16 torch._grouped_mm", "fwd_ms": bf16_fwd, "fwd_tflops": flop / bf16_fwd / 1e9})
    for name in ("cuda", "triton"):
        if name not in available_backends(device):
            continue
        be = get_backend(name)
        if be.pads_wgrad_groups:
            p_offs, rows = padded_offsets(offs), padded_rows(x.shape[0], offs.numel())
        else:
            p_offs, rows = None, 0
        qa, sa, qb, sb = library.quantize_wgrad_operands(g, x, offs, "e4m3fn", False, True, p_offs, rows)
        w_offs = offs if p_offs is None else p_offs
        t_fwd = timer(lambda: be.mm_2d3d(xq, xs, wq, ws, offs, torch.bfloat16), rep_ms)
        t_wgrad = timer(lambda: be.mm_2d2d(qa, sa, qb, sb, w_offs, torch.bfloat16), rep_ms)
        out.append(
            {
                "backend": name,
                "fwd_ms": t_fwd,
                "fwd_tflops": flop / t_fwd / 1e9,
                "wgrad_ms": t_wgrad,
                "wgrad_tflops": flop / t_wgrad / 1e9,
            }
        )
    return out


def methods_for(device):
    here = set(available_backends(device))
    methods = {"bf16 torch._grouped_mm": lambda x, w, offs: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)}
    ao = torchao_fn() if device.type == "cuda" else None
    if ao is not None:
        methods["TorchAO fp8 rowwise"] = ao
    for recipe, backend in RECIPE_BACKENDS:
        if device.type == "cpu":
            backend = "emulated"
        if backend not in here or f"{recipe} / {backend}" in methods:
            continue
        methods[f"{recipe} / {backend}"] = (
            lambda x, w, offs, r=recipe, b=backend: fp8_grouped_mm(x, w, offs, recipe=r, backend=b)
        )
    # The gradient-accumulation case: weights unchanged between calls, their FP8 copies cached.
    cached_backend = "emulated" if device.type == "cpu" else "cuda"
    if cached_backend in here:
        cache = Fp8WeightCache()
        methods[f"rowwise / {cached_backend}, weight cache"] = (
            lambda x, w, offs: fp8_grouped_mm(x, w, offs, recipe="rowwise", backend=cached_backend, weight_cache=cache)
        )
    return methods


def collect(shapes: list[int], device: str, methods: list[str] | None = None, rounds: int = 1,
            rep_ms: int = 100) -> list[dict]:
    """One row per (shape, method) for the ``SHAPES`` indices ``shapes``, ``methods`` labels only (the
    BF16 baseline always runs), plus ``GEMM alone`` rows per backend. On the CPU: the first smoke
    shape, BF16 and rowwise on the emulated backend, no GEMM-alone rows."""
    dev = torch.device(device)
    chosen = SMOKE_SHAPES[:1] if dev.type != "cuda" else [SHAPES[i] for i in shapes]
    every = methods_for(dev)
    if dev.type != "cuda":
        methods = ["rowwise / emulated"]
    if methods:
        every = {k: v for k, v in every.items() if k == "bf16 torch._grouped_mm" or k in methods}
    rows = []
    for name, M, K, N, E in chosen:
        s = bench_shape(name, M, K, N, E, every, dev, rep_ms, rounds)
        for r in s["results"]:
            rows.append(dict(shape=name, M=M, K=K, N=N, E=E, **{k: v for k, v in r.items() if not k.endswith("_all")}))
        for r in s["gemm_only"] if dev.type == "cuda" else ():
            rows.append(dict(shape=name, M=M, K=K, N=N, E=E, method=f"GEMM alone: {r.pop('backend')}", **r))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows
