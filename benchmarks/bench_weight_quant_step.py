"""The optimizer step with the expert weights' FP8 quantization: plain, cache + hook, fused kernel.

Two Qwen3-30B-A3B MoE layers' routed experts (E=128, H=2048, I=768: ``gate_up_proj (128, 1536,
2048)`` and ``down_proj (128, 2048, 768)``, 1.21 G parameters), bf16 parameters (and fp32 master
weights with bf16 GEMMs, under autocast). Per step, the work each path does on the weights:

* ``torch AdamW``: ``torch.optim.AdamW(fused=True)`` alone (its moments in the parameters' dtype);
* ``plain``: that step, then both FP8 layouts of every weight as the uncached forward and backward
  quantize them (forward layout + amax over N, then the dgrad layout from it);
* ``cache + hook``: the same AdamW with ``moe_fp8.optim.quantize_after_step``: the post-step hook
  re-quantizes both layouts into the modules' caches (the next forward and backward hit);
* ``fused (fp32 / bf16 moments)``: ``moe_fp8.optim.AdamWQuantize``: the ``adamw_quantize`` kernel
  updates each weight and writes its forward layout and amax in the same pass, the dgrad layout
  takes one more read; moments fp32 (default) or bf16 (torch's bytes for bf16 parameters).

Medians of CUDA-event times over ``--steps`` steps (after 3 warm-up steps); bytes are the minimum
each path must move (reads + writes, scales left out) and GB/s is set against a device-to-device
copy of 1 GiB. The entries' settings come from one forward of each layer on 256 tokens before the
timing (a check after it: the next forward hits every cache). Runs in well under 2 minutes.

Usage: ``python benchmarks/bench_weight_quant_step.py [--steps 20] [--out benchmarks/results]``
(writes ``weight_quant_step.json`` and ``.md``); ``--quick``: tiny shapes on the CPU (a smoke run).
"""

from __future__ import annotations

import argparse
import gc

import torch
from torch import nn

from moe_fp8 import FP8GroupedExperts
from moe_fp8.bench.report import run_env, write_report
from moe_fp8.bench.timing import event_median_ms
from moe_fp8.grouped_gemm import library as lib
from moe_fp8.grouped_gemm import select_backend
from moe_fp8.optim import AdamWQuantize, adamw_hyper, adamw_quantize, quantize_after_step

QWEN3_30B_A3B = dict(E=128, H=2048, I=768, layers=2, tokens=256, top_k=8)
QUICK = dict(E=4, H=64, I=32, layers=2, tokens=32, top_k=2)
HYPER = dict(lr=1e-6, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _layers(shape: dict, dtype: torch.dtype, device: str) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(FP8GroupedExperts(shape["E"], shape["H"], shape["I"], cache_weights=True, device=device,
                                           dtype=dtype) for _ in range(shape["layers"]))


def _forward(layers: nn.ModuleList, shape: dict, device: str) -> None:
    """One forward of every layer (fills the caches' entries, or hits them), no backward."""
    x = torch.randn(shape["tokens"], shape["H"], device=device)
    ids = torch.randint(0, shape["E"], (shape["tokens"], shape["top_k"]), device=device)
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        for layer in layers:
            layer(x, ids, None)


def _set_grads(layers: nn.ModuleList) -> None:
    for p in layers.parameters():
        p.grad = torch.randn_like(p) * 1e-3


def _plain_quantize(layers: nn.ModuleList, fmt: str, fused: bool) -> None:
    """Both layouts of every weight as the uncached forward and backward make them."""
    with torch.no_grad():
        for layer in layers:
            for w in (layer.gate_up_proj, layer.down_proj):
                if w.dtype == torch.bfloat16:
                    _, _, amax = lib.quantize_weight_forward_layout(w, fmt, False, fused)
                    lib.quantize_weight_dgrad_layout(w, amax, fmt, False, fused)
                else:  # fp32 master weights: the GEMMs' bf16 copy, quantized in both layouts
                    lib.quantize_weight(w.to(torch.bfloat16), "rowwise", fmt, False, fused)


def _median_ms(step, steps: int, device: str) -> float:
    for _ in range(3 if device == "cuda" else 1):
        step()
    return event_median_ms(step, steps)


def _bytes_per_param(path: str, p_bytes: int) -> int:
    """Minimum bytes read + written per weight element (scales left out)."""
    cast = 0 if p_bytes == 2 else 4 + 2  # fp32 weights: their bf16 copy (read fp32, write bf16)
    torch_adamw = 3 * p_bytes + 4 * p_bytes  # read p, g, m, v; write p, m, v (moments in p's dtype)
    quantize = cast + 2 * (2 + 1)  # each layout: read bf16, write fp8
    fused = {"fused (fp32 moments)": 4, "fused (bf16 moments)": 2}.get(path)
    if path == "torch AdamW":
        return torch_adamw
    if fused is not None:  # one update pass writing the forward layout, then the dgrad layout (+ the cast)
        return 3 * p_bytes + 4 * fused + 1 + cast + 2 + 1
    return torch_adamw + quantize


def _copy_gbs(device: str) -> float:
    if device != "cuda":
        return float("nan")
    src = torch.randn(1 << 28, device=device)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), 20, device)
    return 2 * src.numel() * 4 / ms / 1e6


def _run_path(path: str, shape: dict, dtype: torch.dtype, device: str, steps: int, fmt: str) -> dict:
    layers = _layers(shape, dtype, device)
    fused_adamw = dict(fused=True) if device == "cuda" else dict(foreach=True)
    if path.startswith("fused"):
        state = torch.bfloat16 if "bf16" in path else torch.float32
        opt = AdamWQuantize(layers.parameters(), layers, state_dtype=state, **HYPER)
    else:
        opt = torch.optim.AdamW(layers.parameters(), **HYPER, **fused_adamw)
    if path == "cache + hook":
        quantize_after_step(opt, layers)
    _forward(layers, shape, device)  # the caches' entries: their dtype, format, backend
    _set_grads(layers)
    step = opt.step
    if path == "plain":
        fused = select_backend(None, torch.device(device)).fused_quant  # the modules' backend

        def step():
            opt.step()
            _plain_quantize(layers, fmt, fused)
    ms = _median_ms(step, steps, device)
    caches = [c for layer in layers for c in layer._caches]
    misses = sum(c.misses for c in caches)
    _forward(layers, shape, device)
    hits_next = sum(c.misses for c in caches) == misses  # after the step, the next forward hits
    params = sum(p.numel() for p in layers.parameters())
    nbytes = _bytes_per_param(path, torch.finfo(dtype).bits // 8) * params
    del layers, opt, caches
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return dict(weights=str(dtype).removeprefix("torch."), path=path, ms=ms, gbytes=nbytes / 1e9,
                gbs=nbytes / ms / 1e6, next_forward_hits=hits_next if path.startswith(("cache", "fused")) else None)


# adamw_quantize launch configs timed on one gate_up_proj (bf16, fp32 moments): DEFAULT_CONFIG's keys
CONFIGS = ({}, dict(tile=4096), dict(tile=1024, num_warps=4), dict(stages=1), dict(stages=3), dict(rows=128),
           dict(rows=32))


def _sweep(shape: dict, device: str, steps: int, fmt: str, copy_gbs: float) -> list[dict]:
    """The fused kernel alone (update + both layouts) on one ``(E, 2I, H)`` bf16 weight per config."""
    g = torch.Generator(device).manual_seed(0)
    dims = (shape["E"], 2 * shape["I"], shape["H"])
    p = (torch.randn(dims, generator=g, device=device) * 0.02).bfloat16()
    grad = (torch.randn(dims, generator=g, device=device) * 1e-3).bfloat16()
    m, v = torch.zeros(dims, device=device), torch.zeros(dims, device=device)
    hyper = adamw_hyper(step=1, **HYPER)
    nbytes = _bytes_per_param("fused (fp32 moments)", 2) * p.numel()
    rows = []
    for cfg in CONFIGS:
        ms = _median_ms(lambda: adamw_quantize(p, grad, m, v, hyper, fmt=fmt, config=cfg), steps, device)
        rows.append(dict(config=cfg or "default", ms=ms, gbs=nbytes / ms / 1e6, copy_frac=nbytes / ms / 1e6 / copy_gbs))
        print(f"  adamw_quantize {str(cfg or 'default'):<36} {ms:7.3f} ms  {rows[-1]['gbs']:6.0f} GB/s  "
              f"{rows[-1]['copy_frac']:.2f} of copy")
    return rows


PATHS = ("torch AdamW", "plain", "cache + hook", "fused (fp32 moments)", "fused (bf16 moments)")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    device = "cpu" if args.quick or not torch.cuda.is_available() else "cuda"
    shape = QUICK if device == "cpu" else QWEN3_30B_A3B
    steps = 1 if device == "cpu" else args.steps
    fmt = "e4m3fn"
    copy_gbs = _copy_gbs(device)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for path in PATHS:
            if dtype == torch.float32 and path == "fused (bf16 moments)":
                continue
            row = _run_path(path, shape, dtype, device, steps, fmt)
            row["copy_frac"] = row["gbs"] / copy_gbs
            rows.append(row)
            print(f"{row['weights']:>8}  {path:<22} {row['ms']:8.2f} ms  {row['gbytes']:6.2f} GB  "
                  f"{row['gbs']:7.0f} GB/s  {row['copy_frac']:5.2f} of copy  next forward hits: "
                  f"{row['next_forward_hits']}")
    sweep = _sweep(shape, device, steps, fmt, copy_gbs)
    header = "| weights | path | step ms | GB moved | GB/s | of copy | next forward hits |"
    body = [header, "|" + "---|" * 7]
    body += [f"| {r['weights']} | {r['path']} | {r['ms']:.2f} | {r['gbytes']:.2f} | {r['gbs']:.0f} | "
             f"{r['copy_frac']:.2f} | {'' if r['next_forward_hits'] is None else r['next_forward_hits']} |"
             for r in rows]
    body += ["", f"adamw_quantize alone on one gate_up_proj {tuple((shape['E'], 2 * shape['I'], shape['H']))} bf16, "
             "fp32 moments, per launch config:", "", "| config | ms | GB/s | of copy |", "|---|---|---|---|"]
    body += [f"| {r['config']} | {r['ms']:.3f} | {r['gbs']:.0f} | {r['copy_frac']:.2f} |" for r in sweep]
    env = run_env(device, shape=shape, copy_gbs=copy_gbs, steps=steps)
    write_report(args.out, "weight_quant_step" + ("_quick" if device == "cpu" else ""), env, rows + sweep,
                 "Optimizer step with the expert weights' FP8 quantization",
                 f"{shape['layers']} layers E={shape['E']} H={shape['H']} I={shape['I']}, median of {steps} "
                 f"steps ({'CUDA events' if device == 'cuda' else 'wall clock'}), copy {copy_gbs:.0f} GB/s", body)
    return rows


if __name__ == "__main__":
    main()
