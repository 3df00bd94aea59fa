"""Routing plumbing on the GPU: dispatch plan, permute(+quantize), combine, against copy bandwidth and plain torch.

For DeepSeek-V3 (T=16384, k=8, E=256, H=7168, expert I=2048) and Qwen3-30B-A3B (T=16384, k=8,
E=128, H=2048, I=768), one run measures side by side (medians; our kernels by CUDA-graph replay,
``do_bench_cudagraph``, so the host's launch time does not hide a 0.1 ms kernel; the plan both
eagerly and replayed; plain PyTorch eagerly, ``do_bench``):

* a device-to-device copy (bytes read + written): the bandwidth ceiling;
* ours: ``make_dispatch_plan`` (eager and CUDA-graph replay), ``permute_quantize``, bf16
  ``permute``, ``combine`` forward and backward; a small launch-config sweep per kernel;
* plain PyTorch: ``argsort`` + ``bincount`` plan, ``index_select`` + reference rowwise quantizer,
  ``index_add_`` combine;
* the plan's share of a real MoE layer forward is measured by ``python -m moe_fp8.bench --kinds layer`` (host and
  GPU time of the plan against the layer's own forward), not here.

Bytes per kernel (the minimum each must move): permute(+quantize) reads ``T*H`` bf16 once and
writes ``M*H`` codes (+ ``M`` fp32 scales); combine reads ``T*k*H`` and writes ``T*H``; its
backward reads ``T*H + T*k*H`` and writes ``M*H`` (the quantizing backward, which the dgrad of
``rowwise_gw_hp`` experts takes, also ``M*H`` codes and ``M`` scales).

Usage: ``python benchmarks/bench_routing.py [--out DIR] [--name NAME] [--shapes NAME...] [--tokens T]``
(writes ``NAME.json`` and ``NAME.md``, default ``routing``; ``--tokens`` replaces the shapes' T, e.g.
8192 for the whole-model benchmark's 8 x 1024 tokens).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

import moe_fp8.routing.combine_ops as combine_ops
import moe_fp8.routing.permute_ops as permute_ops
from moe_fp8.quant.formats import E4M3FN
from moe_fp8.quant.reference import quantize_rowwise
from moe_fp8.routing import RouterConfig, combine, make_dispatch_plan, permute, permute_quantize, route
from moe_fp8.routing.reference import dispatch_plan_reference

SHAPES = {  # name: (T, k, E, H, I, router)
    "deepseek_v3": (16384, 8, 256, 7168, 2048, RouterConfig.deepseek_v3()),
    "qwen3_30b_a3b": (16384, 8, 128, 2048, 768, RouterConfig.qwen3_moe()),
}
PAD = 16


def ms(fn) -> float:
    """Median ms of eager calls (host launch time included where it exceeds the GPU's)."""
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def graph_ms(fn) -> float:
    """Median GPU ms of CUDA-graph replays of ``fn``."""
    return do_bench_cudagraph(fn, rep=60, return_mode="median")


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read + written."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    t = ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / t / 1e6


def sweep(label, apply, variants, fn, nbytes, copy_gbs, rows):
    """Time ``fn`` under each launch-config variant; return the best time (ms)."""
    best = None
    for v in variants:
        restore = apply(v)
        try:
            t = graph_ms(fn)
        finally:
            restore()
        rows.append({"kernel": label, "variant": str(v), "ms": t, "GBps": nbytes / t / 1e6, "of_copy": nbytes / t / 1e6 / copy_gbs})
        best = t if best is None else min(best, t)
    return best


def patch(module, **values):
    old = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    return lambda: [setattr(module, k, v) for k, v in old.items()]


def bench_shape(name, copy_gbs, sweep_rows, tokens=None):
    T, k, E, H, I, cfg = SHAPES[name]
    T = tokens or T
    N = T * k
    M = N + (PAD - 1) * E
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(T, E, device="cuda", generator=g)
    bias = torch.randn(E, device="cuda", generator=g) * 0.01 if cfg.use_correction_bias else None
    r = route(logits, cfg, bias)
    ids, w = r.topk_ids, r.topk_weights
    x = torch.randn(T, H, device="cuda", generator=g, dtype=torch.bfloat16)
    y = torch.randn(M, H, device="cuda", generator=g, dtype=torch.bfloat16)
    go = torch.randn(T, H, device="cuda", generator=g, dtype=torch.bfloat16)
    plan = make_dispatch_plan(ids, E, pad_multiple=PAD)
    res = {"T": T, "k": k, "E": E, "H": H, "I": I, "rows_M": M}

    # dispatch plan
    res["plan_ms"] = ms(lambda: make_dispatch_plan(ids, E, pad_multiple=PAD))
    res["plan_graph_ms"] = graph_ms(lambda: make_dispatch_plan(ids, E, pad_multiple=PAD))
    res["plan_torch_sort_ms"] = ms(lambda: dispatch_plan_reference(ids, E, PAD))

    # permute + quantize (ours), bf16 permute
    pq_bytes = T * H * 2 + M * H + M * 4
    warps = [4, 8, 16] if H > 4096 else [2, 4, 8]
    res["permute_quantize_ms"] = sweep(
        f"{name}/permute_quantize", lambda v: patch(permute_ops, _num_warps=lambda b, v=v: v), warps,
        lambda: permute_quantize(x, plan, E4M3FN), pq_bytes, copy_gbs, sweep_rows,
    )
    res["permute_quantize_bytes"] = pq_bytes
    p_bytes = T * H * 2 + M * H * 2
    res["permute_bf16_ms"] = sweep(
        f"{name}/permute_bf16", lambda v: patch(permute_ops, _num_warps=lambda b, v=v: v), warps,
        lambda: permute(x, plan), p_bytes, copy_gbs, sweep_rows,
    )
    res["permute_bf16_bytes"] = p_bytes

    # combine forward / backward (ours)
    c_bytes = N * H * 2 + T * H * 2 + N * 8
    res["combine_ms"] = sweep(
        f"{name}/combine_fwd", lambda v: patch(combine_ops, _FWD_BLOCK_H=v[0], _FWD_WARPS=v[1]),
        [(1024, 4), (2048, 8), (512, 4)], lambda: combine(y, plan, w), c_bytes, copy_gbs, sweep_rows,
    )
    res["combine_bytes"] = c_bytes
    cb_bytes = T * H * 2 + N * H * 2 + M * H * 2 + N * 12
    bwd = torch.ops.moe_fp8.routing_combine_backward
    res["combine_bwd_ms"] = sweep(
        f"{name}/combine_bwd", lambda v: patch(combine_ops, _BWD_TILE=v[0], _BWD_WARPS=v[1]),
        [(4096, 4), (8192, 8), (2048, 4)], lambda: bwd(go, y, plan.pair_to_row, plan.pad_rows, w), cb_bytes, copy_gbs, sweep_rows,
    )
    res["combine_bwd_bytes"] = cb_bytes
    cbq_bytes = cb_bytes + M * H + M * 4  # + grad_y's FP8 rows and scales
    bwd_q = torch.ops.moe_fp8.routing_combine_backward_quantize
    res["combine_bwd_quantize_ms"] = sweep(
        f"{name}/combine_bwd_quantize", lambda v: patch(combine_ops, _BWD_QUANTIZE_TILE=v[0], _BWD_WARPS=v[1]),
        [(4096, 4), (8192, 4), (4096, 8), (2048, 4), (8192, 8)],
        lambda: bwd_q(go, y, plan.pair_to_row, plan.pad_rows, w, "e4m3fn", True), cbq_bytes, copy_gbs, sweep_rows,
    )
    res["combine_bwd_quantize_bytes"] = cbq_bytes

    # plain PyTorch: argsort + bincount plan, index_select + reference quantizer, index_add_ combine
    flat = ids.reshape(-1)

    def torch_plan():
        order = flat.argsort(stable=True)
        offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
        return order, offs

    order, _ = torch_plan()
    src = order // k
    y_sorted = y[:N]
    w_sorted = w.reshape(-1)[order]
    res["torch_plan_ms"] = ms(torch_plan)
    res["torch_permute_quantize_ms"] = ms(lambda: quantize_rowwise(x.index_select(0, src), E4M3FN))
    res["torch_permute_bf16_ms"] = ms(lambda: x.index_select(0, src))
    res["torch_combine_ms"] = ms(
        lambda: torch.zeros(T, H, device="cuda", dtype=torch.bfloat16).index_add_(0, src, y_sorted * w_sorted[:, None].to(y.dtype))
    )
    for key, nbytes in (("permute_quantize", pq_bytes), ("permute_bf16", p_bytes), ("combine", c_bytes), ("combine_bwd", cb_bytes),
                        ("combine_bwd_quantize", cbq_bytes)):
        res[f"{key}_GBps"] = nbytes / res[f"{key}_ms"] / 1e6
        res[f"{key}_of_copy"] = res[f"{key}_GBps"] / copy_gbs
    res["speedup_vs_torch"] = {
        "plan": res["torch_plan_ms"] / res["plan_ms"],
        "permute_quantize": res["torch_permute_quantize_ms"] / res["permute_quantize_ms"],
        "permute_bf16": res["torch_permute_bf16_ms"] / res["permute_bf16_ms"],
        "combine": res["torch_combine_ms"] / res["combine_ms"],
    }
    return res


def markdown(meta, results, sweep_rows) -> str:
    lines = [
        "# Routing plumbing on the GPU (`benchmarks/bench_routing.py`)",
        "",
        f"{meta['date']} · {meta['gpu']} · torch {meta['torch']} · triton {meta['triton']} · "
        f"copy {meta['copy_GBps']:.0f} GB/s (1 GiB D2D, read+write) · groups padded to {PAD} rows · our kernels: medians of CUDA-graph replays; plain torch: eager do_bench medians",
        "",
        "| shape | kernel | ours ms | GB/s | of copy | plain torch ms | speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    for shape, r in results.items():
        name = f"{shape}, T={r['T']}"
        for key, tkey in (("permute_quantize", "torch_permute_quantize_ms"), ("permute_bf16", "torch_permute_bf16_ms"),
                          ("combine", "torch_combine_ms"), ("combine_bwd", None), ("combine_bwd_quantize", None)):
            base = f"{r[tkey]:.3f}" if tkey else "-"
            speed = f"{r[tkey] / r[key + '_ms']:.2f}x" if tkey else "-"
            lines.append(f"| {name} | {key} | {r[key + '_ms']:.3f} | {r[key + '_GBps']:.0f} | {r[key + '_of_copy']:.0%} | {base} | {speed} |")
        lines.append(f"| {name} | dispatch plan (eager / graph) | {r['plan_ms'] * 1e3:.1f} / {r['plan_graph_ms'] * 1e3:.1f} us | | "
                     f"| {r['torch_plan_ms'] * 1e3:.1f} us | {r['torch_plan_ms'] / r['plan_ms']:.2f}x |")
    lines += ["", "The plan's share of the MoE layer forward (host and GPU time) is measured by "
              "`python -m moe_fp8.bench --kinds layer`."]
    lines += ["", "Launch-config sweep (best is reported above):", "", "| kernel | variant | ms | GB/s | of copy |", "|---|---|---|---|---|"]
    for s in sweep_rows:
        lines.append(f"| {s['kernel']} | {s['variant']} | {s['ms']:.3f} | {s['GBps']:.0f} | {s['of_copy']:.0%} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--name", default="routing")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--tokens", type=int, default=None, help="tokens T for every shape (default: the shape's)")
    args = ap.parse_args()
    copy_gbs = copy_bandwidth()
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_GBps": copy_gbs,
        "pad_multiple": PAD,
    }
    sweep_rows, results = [], {}
    for name in args.shapes:
        results[name] = bench_shape(name, copy_gbs, sweep_rows, args.tokens)
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, f"{args.name}.json").write_text(json.dumps({"meta": meta, "results": results, "sweep": sweep_rows}, indent=1))
    md = markdown(meta, results, sweep_rows)
    Path(args.out, f"{args.name}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
