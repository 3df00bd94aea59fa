"""Bandwidth of the Triton FP8 quantization kernels, against device copy and TorchAO 0.18.

For every kernel: median GPU time (``triton.testing.do_bench_cudagraph``: calls replayed from a CUDA
graph, so Python and launch overhead are not counted, for TorchAO alike), GB/s over the
bytes it must move (each input read once, each output and scale written once), and that as a
fraction of the device-to-device copy bandwidth measured in the same run; TorchAO's counterpart
beside it when ``torchao`` imports. Inputs are random normal bf16 (never zeros).

    python benchmarks/bench_quant.py                      # table -> benchmarks/results/quant.{json,md}
    python benchmarks/bench_quant.py --sweep --out DIR    # also time kernel configurations
    python benchmarks/bench_quant.py --models "Llama 4" --kernels padded   # only the rows named so

Needs a CUDA GPU (``--smoke``: tiny shapes on the CPU, kernels in the Triton interpreter, to check
the script itself; its numbers mean nothing). Shapes: DeepSeek-V3 (A 32768x7168, W 8x4096x7168 and 8x7168x2048), Llama 4
(A 16384x5120, W 16x8192x5120), Qwen3-30B-A3B (A 65536x2048, W 128x1536x2048 and 128x2048x768);
the wgrad operands of W (E, N, K) are grad_out (M, N) and the activations (M, K) over E balanced
groups (multiples of 16 tokens), and as the FP8MoE wgrad calls it ("padded out": groups of any size,
written into 16-row aligned groups of a padded buffer).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch
import triton
from timing import wall_median_ms
from triton.testing import do_bench, do_bench_cudagraph

from moe_fp8.grouped_gemm.padding import padded_offsets, padded_rows
from moe_fp8.quant import ops
from moe_fp8.quant.formats import E4M3FN
from moe_fp8.quant.kernels import colwise, rowwise
from moe_fp8.quant.kernels.colwise import colwise_config, launch_expert_colwise_t, launch_group_colwise
from moe_fp8.quant.kernels.rowwise import launch_rowwise, rowwise_config
from moe_fp8.testing import random_offsets

MODELS = {
    # more_groups: wgrad operands also timed over that many groups (DeepSeek-V3 with 32 local experts)
    "DeepSeek-V3": dict(tokens=32768, hidden=7168, weights=[(8, 4096, 7168), (8, 7168, 2048)], more_groups=(32,)),
    "Llama 4": dict(tokens=16384, hidden=5120, weights=[(16, 8192, 5120)]),
    "Qwen3-30B-A3B": dict(tokens=65536, hidden=2048, weights=[(128, 1536, 2048), (128, 2048, 768)]),
}
SMOKE_MODELS = {"smoke": dict(tokens=64, hidden=48, weights=[(2, 32, 48)], more_groups=(3,))}
FP8 = torch.float8_e4m3fn
DEVICE = "cuda"
# Kernel configurations timed with --sweep: colwise (CHUNK, BLOCK_R, BLOCK_C, STAGES, LAG, num_warps, maxnreg,
# two_pass) (the first is run with and without the hardware cast) and rowwise (tile, num_warps).
STRIP_SWEEP = [(512, 64, 64, 3, 0, 4, 96, False), (512, 64, 64, 3, 4, 4, 96, False),
               (512, 64, 64, 3, 0, 4, None, False), (512, 64, 64, 3, 0, 4, 96, True),
               (512, 64, 64, 3, 0, 4, None, True), (1024, 64, 64, 3, 0, 4, None, True),
               (2048, 64, 64, 3, 0, 4, None, True),
               # 256-row chunks of 32 x 128: colwise_config's default since fbd3600 (at auto_lag)
               (256, 32, 128, 3, 0, 4, 96, False), (256, 32, 128, 3, 2, 4, 96, False),
               (512, 32, 128, 3, 0, 4, 96, False), (256, 32, 128, 3, 0, 4, 96, True)]
ROW_SWEEP = [(4096, 4), (8192, 8)]


def _torchao():
    try:
        import torchao
        from torchao.prototype.moe_training import kernels
    except Exception as e:  # noqa: BLE001 - any import failure means "not installed here"
        print(f"torchao not available: {e!r}", file=sys.stderr)
        return None, None
    return kernels, torchao.__version__


def _time_us(fn) -> float:
    if DEVICE != "cuda":  # smoke run
        return wall_median_ms(fn, calls=1) * 1e3
    try:
        return do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3
    except Exception as e:  # noqa: BLE001 - report and fall back to event timing of eager calls
        print(f"CUDA-graph timing failed ({e!r:.200}); timing eager calls instead", file=sys.stderr)
        return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def _copy_gbps() -> float:
    """Device-to-device copy of 1 GiB, timed eagerly: captured in a CUDA graph the copy becomes a
    memcpy node that ran at 2.7 TB/s instead of 4.2 on one H200 (2026-11)."""
    src = torch.randn(1 << (29 if DEVICE == "cuda" else 16), device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    us = do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median") * 1e3 if DEVICE == "cuda" else (
        _time_us(lambda: dst.copy_(src)))
    return 2 * src.numel() * 2 / us / 1e3


class Table:
    """Rows of the bandwidth table; ``kernels``: substrings of the kernel names to time (None: all)."""

    def __init__(self, copy_gbps: float, kernels: list[str] | None = None):
        self.copy = copy_gbps
        self.kernels = kernels
        self.rows: list[dict] = []

    def wants(self, kernel: str) -> bool:
        return self.kernels is None or any(k in kernel for k in self.kernels)

    def time(self, model, kernel, shape, nbytes, ours_fn, ao_fns=(), **extra) -> None:
        """Times ``ours_fn`` and the TorchAO callables ``ao_fns`` (their medians summed: TorchAO's
        counterpart may be two kernels) and adds the row, if ``kernel`` is wanted."""
        if self.wants(kernel):
            ao_us = sum(_time_us(f) for f in ao_fns) if ao_fns else None
            self.add(model, kernel, shape, nbytes, _time_us(ours_fn), ao_us, **extra)

    def add(self, model, kernel, shape, nbytes, ours_us, ao_us=None, **extra):
        row = dict(model=model, kernel=kernel, shape=shape, bytes=nbytes, ours_us=round(ours_us, 2),
                   ours_gbps=round(nbytes / ours_us / 1e3, 1), ours_frac=round(nbytes / ours_us / 1e3 / self.copy, 3))
        if ao_us is not None:
            row.update(torchao_us=round(ao_us, 2), torchao_gbps=round(nbytes / ao_us / 1e3, 1),
                       torchao_frac=round(nbytes / ao_us / 1e3 / self.copy, 3), speedup=round(ao_us / ours_us, 2))
        row.update(extra)
        self.rows.append(row)
        ao = f"  torchao {ao_us:8.1f} us {row['torchao_frac']:5.1%}  x{row['speedup']:.2f}" if ao_us else ""
        print(f"{model:14s} {kernel:28s} {shape:22s} {ours_us:8.1f} us {row['ours_frac']:5.1%}{ao}", flush=True)


def _rowwise_variant(x, tile, warps, hw_cast):
    M, K = x.shape
    q, s = torch.empty((M, K), dtype=FP8, device=x.device), torch.empty(M, device=x.device)
    cfg = rowwise_config(M, K, tile=tile, num_warps=warps)
    return lambda: launch_rowwise(x, q, s, E4M3FN, True, M=M, K=K, rows_per_group=M, stride_g=0,
                                  stride_r=x.stride(0), stride_k=1, config=cfg, hw_cast=hw_cast)


def _strip_config(chunk, br, bc, stages, lag, warps, maxnreg, two_pass):
    return colwise_config(chunk=chunk, block_r=br, block_c=bc, stages=stages, lag=lag, num_warps=warps,
                          maxnreg=maxnreg, two_pass=two_pass)


def _strip_label(v) -> str:
    return "chunk={} {}x{} stages={} lag={} w{} maxnreg={} two_pass={}".format(*v)


def _expert_t_variant(w, cfg, hw_cast):
    E, N, K = w.shape
    q, s = torch.empty((E, K, N), dtype=FP8, device=w.device), torch.empty((E, K), device=w.device)
    return lambda: launch_expert_colwise_t(w, q, s, E4M3FN, True, config=cfg, hw_cast=hw_cast)


def _group_variant(a, b, offs, cfg, hw_cast):
    M = a.shape[0]
    qa = torch.empty_strided((M, a.shape[1]), (1, M), dtype=FP8, device=a.device)
    qb = torch.empty_strided((M, b.shape[1]), (1, M), dtype=FP8, device=a.device)
    sa = torch.empty((offs.numel(), a.shape[1]), device=a.device)
    sb = torch.empty((offs.numel(), b.shape[1]), device=a.device)
    return lambda: launch_group_colwise(a, qa, sa, b, qb, sb, offs, None, E4M3FN, True, config=cfg, hw_cast=hw_cast)


def _compiled(jit_fn) -> dict:
    """Compiled variants of a Triton kernel so far, ``{cache key: CompiledKernel}`` (none in the interpreter)."""
    out = {}
    for entry in getattr(jit_fn, "device_caches", {}).values():  # (kernel_cache, ...) in triton 3.4-3.9
        if isinstance(entry, tuple) and entry and isinstance(entry[0], dict):
            out.update(entry[0])
    return out


def _resources(jit_fn, before: dict) -> str:
    """Registers per thread and spilled bytes of the variants compiled since ``before``, as the
    compiler reported them on this GPU ('' if none was compiled, e.g. a configuration seen before)."""
    new = [k for key, k in _compiled(jit_fn).items() if key not in before]
    return ", ".join(f"{getattr(k, 'n_regs', '?')} regs, {getattr(k, 'n_spills', '?')} spills" for k in new)


def run(models, sweep: bool, deadline: float, ao, on_model_done=None,
        kernels: list[str] | None = None) -> tuple[Table, list[dict]]:
    """Times every kernel on each model in turn; ``on_model_done(table, sweeps)`` after each model
    (``main`` writes the tables then, so a run cut short keeps the models it finished)."""
    table = Table(_copy_gbps(), kernels)
    print(f"device-to-device copy: {table.copy:.0f} GB/s (read + write)", flush=True)
    sweeps: list[dict] = []
    gen = torch.Generator().manual_seed(0)

    def sweep_row(model, kernel, shape, nbytes, variant, fn):
        jit_fn = rowwise._rowwise_kernel if kernel == "rowwise" else colwise._colwise_kernel
        before = _compiled(jit_fn)
        us = _time_us(fn)
        sweeps.append(dict(model=model, kernel=kernel, shape=shape, variant=variant, us=round(us, 2),
                           frac=round(nbytes / us / 1e3 / table.copy, 3), resources=_resources(jit_fn, before)))
        print(f"   sweep {model:14s} {kernel:24s} {shape:22s} {variant:34s} {us:8.1f} us {sweeps[-1]['frac']:5.1%} "
              f"{sweeps[-1]['resources']}", flush=True)

    for model in models:
        spec = MODELS.get(model) or SMOKE_MODELS[model]
        M, H = spec["tokens"], spec["hidden"]
        x = torch.randn(M, H, device=DEVICE, dtype=torch.bfloat16)
        shape = f"{M}x{H}"
        nbytes = M * H * 3 + M * 4
        table.time(model, "rowwise (A)", shape, nbytes, lambda: ops.triton_quantize_rowwise(x, E4M3FN, True),
                   [lambda: ao.triton_fp8_rowwise_2d_scale_and_cast(x, FP8, True)] if ao else ())
        if sweep and time.time() < deadline:
            for tile, warps in ROW_SWEEP:
                for hw in ((True, False) if (tile, warps) == ROW_SWEEP[0] else (True,)):
                    sweep_row(model, "rowwise", shape, nbytes, f"tile={tile} warps={warps} hw_cast={hw}",
                              _rowwise_variant(x, tile, warps, hw))
        table.time(model, "blockwise 1x128 (A)", shape, M * H * 3 + M * triton.cdiv(H, 128) * 4,
                   lambda: ops.triton_quantize_blockwise(x, E4M3FN, (1, 128), True))
        table.time(model, "tensorwise (A)", shape, nbytes - M * 4 + 4,
                   lambda: ops.triton_quantize_tensorwise(x, E4M3FN, True))
        del x

        for E, N, K in spec["weights"]:
            w = torch.randn(E, N, K, device=DEVICE, dtype=torch.bfloat16) * 0.02
            w_t = w.transpose(-2, -1)  # TorchAO's B_t: (E, K, N) column-major
            shape = f"{E}x{N}x{K}"
            base = E * N * K * 3
            ao_fwd = (lambda: ao.triton_fp8_colwise_3d_scale_and_cast(w_t, FP8, True)) if ao else None
            ao_dgrad = (lambda: ao.triton_fp8_rowwise_3d_transpose_rhs(w_t, FP8, True)) if ao else None
            table.time(model, "expert colwise fwd (W)", shape, base + E * N * 4,
                       lambda: ops.triton_quantize_expert_colwise(w, E4M3FN, True, False), [ao_fwd] if ao else ())
            table.time(model, "expert colwise dgrad (W)", shape, base + E * K * 4,
                       lambda: ops.triton_quantize_expert_colwise(w, E4M3FN, True, True), [ao_dgrad] if ao else ())
            table.time(model, "expert dual fwd+dgrad (W)", shape, E * N * K * 4 + (E * N + E * K) * 4,
                       lambda: ops.triton_quantize_expert_colwise_dual(w, E4M3FN, True), [ao_fwd, ao_dgrad] if ao else (),
                       **({"torchao_note": "sum of TorchAO's two kernels"} if ao else {}))
            table.time(model, "expert fwd + col amax (W)", shape, base + E * N * 4 + E * K * 4,
                       lambda: ops.triton_quantize_expert_rowwise_with_amax(w, E4M3FN, True))
            if table.wants("expert dgrad from amax (W)"):
                _, _, col_amax = ops.triton_quantize_expert_rowwise_with_amax(w, E4M3FN, True)
                table.time(model, "expert dgrad from amax (W)", shape, base + E * K * 8,
                           lambda: ops.triton_quantize_expert_colwise_from_amax(w, col_amax, E4M3FN, True))
            table.time(model, "blockwise 128x128 (W)", shape, base + E * triton.cdiv(N, 128) * triton.cdiv(K, 128) * 4,
                       lambda: ops.triton_quantize_blockwise(w, E4M3FN, (128, 128), True))
            if sweep and time.time() < deadline:
                for v in STRIP_SWEEP:
                    for hw in ((True, False) if v == STRIP_SWEEP[0] else (True,)):
                        sweep_row(model, "expert colwise dgrad", shape, base + E * K * 4,
                                  _strip_label(v) + f" hw_cast={hw}",
                                  _expert_t_variant(w, _strip_config(*v), hw))
            del w, w_t

            a = torch.randn(M, N, device=DEVICE, dtype=torch.bfloat16)
            b = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
            for G in (E, *spec.get("more_groups", ())):
                offs = random_offsets(M, G, "balanced", multiple_of=16, generator=gen).to(DEVICE)
                shape = f"{M}x({N}+{K}) E={G}"
                nbytes = M * (N + K) * 3 + G * (N + K) * 4
                table.time(model, "group colwise dual (wgrad)", shape, nbytes,
                           lambda: ops.triton_quantize_group_colwise_dual(a, b, offs, E4M3FN, True),
                           [lambda: ao.triton_fp8_per_group_colwise_scales_dual(a, b, offs, FP8, True)] if ao else ())
                if G == E:
                    skew = random_offsets(M, E, "skewed", multiple_of=16, generator=gen).to(DEVICE)
                    table.time(model, "group colwise dual, skewed", shape, nbytes,
                               lambda: ops.triton_quantize_group_colwise_dual(a, b, skew, E4M3FN, True),
                               group_sizes=torch.diff(skew, prepend=skew.new_zeros(1)).tolist())
                # as the FP8MoE wgrad calls it: routed (unaligned) groups, written 16-row padded
                routed = random_offsets(M, G, "balanced", generator=gen).to(DEVICE)
                p_offs, p_rows = padded_offsets(routed), padded_rows(M, G)
                p_bytes = nbytes + (p_rows - M) * (N + K)
                table.time(model, "group colwise dual, padded out", shape, p_bytes,
                           lambda: ops.triton_quantize_group_colwise_dual(
                               a, b, routed, E4M3FN, True, padded_offs=p_offs, padded_rows=p_rows))
                # the backward since the dgrad's row quantization of grad_out (a) returns its group amax
                if table.wants("group dual, a from amax, padded") or table.wants("group dual, both from amax, padded"):
                    _, _, a_amax = ops.triton_quantize_rowwise_with_group_amax(a, routed, E4M3FN, True)
                    table.time(model, "group dual, a from amax, padded", shape, p_bytes,
                               lambda: ops.triton_quantize_group_colwise_dual(
                                   a, b, routed, E4M3FN, True, padded_offs=p_offs, padded_rows=p_rows, a_amax=a_amax))
                if table.wants("group dual, both from amax, padded"):
                    _, _, b_amax = ops.triton_quantize_rowwise_with_group_amax(b, routed, E4M3FN, True)
                    table.time(model, "group dual, both from amax, padded", shape, p_bytes,
                               lambda: ops.triton_quantize_group_colwise_dual(
                                   a, b, routed, E4M3FN, True, padded_offs=p_offs, padded_rows=p_rows, a_amax=a_amax,
                                   b_amax=b_amax))
                if G == E:
                    table.time(model, "rowwise + group amax (a)", f"{M}x{N} E={G}", M * N * 3 + M * 4 + G * N * 4,
                               lambda: ops.triton_quantize_rowwise_with_group_amax(a, routed, E4M3FN, True))
                    table.time(model, "rowwise (a)", f"{M}x{N}", M * N * 3 + M * 4,
                               lambda: ops.triton_quantize_rowwise(a, E4M3FN, True))
                if sweep and time.time() < deadline:
                    for v in STRIP_SWEEP:
                        for hw in ((True, False) if v == STRIP_SWEEP[0] else (True,)):
                            sweep_row(model, "group colwise dual", shape, nbytes,
                                      _strip_label(v) + f" hw_cast={hw}",
                                      _group_variant(a, b, offs, _strip_config(*v), hw))
            del a, b
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        if on_model_done is not None:
            on_model_done(table, sweeps)
    return table, sweeps


def _markdown(meta: dict, table: Table, sweeps: list[dict]) -> str:
    lines = [
        "# FP8 quantization kernels: bandwidth",
        "",
        f"{meta['date']}, {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, "
        f"torchao {meta['torchao'] or 'not installed'}. Models: {', '.join(meta.get('models', []))}. "
        f"Device-to-device copy: **{meta['copy_gbps']:.0f} GB/s** "
        "(read + write). GB/s count each input read once and each output and scale written once; "
        "`% copy` is that over the copy bandwidth. Median GPU time of `triton.testing.do_bench_cudagraph` "
        "(CUDA-graph replay: no Python or launch overhead, for both libraries).",
        "",
        "| model | kernel | shape | ours µs | ours GB/s | ours % copy | TorchAO µs | TorchAO % copy | speedup |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table.rows:
        ao = (f"{r['torchao_us']:.1f} | {r['torchao_frac']:.0%} | {r['speedup']:.2f}x" if "torchao_us" in r
              else "- | - | -")
        lines.append(f"| {r['model']} | {r['kernel']} | {r['shape']} | {r['ours_us']:.1f} | {r['ours_gbps']:.0f} | "
                     f"{r['ours_frac']:.0%} | {ao} |")
    lines += ["", "TorchAO's dual expert number is the sum of its two weight kernels (it has no dual kernel)."]
    if sweeps:
        lines += ["", "## Configuration sweep", "",
                  "Registers: per thread, as compiled on this GPU, for configurations compiled in that row.", "",
                  "| model | kernel | shape | variant | µs | % copy | registers |", "|---|---|---|---|---:|---:|---|"]
        lines += [f"| {s['model']} | {s['kernel']} | {s['shape']} | {s['variant']} | {s['us']:.1f} | {s['frac']:.0%} | "
                  f"{s['resources']} |" for s in sweeps]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results", help="folder for quant.json and quant.md")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ", ".join(MODELS))
    p.add_argument("--sweep", action="store_true", help="also time kernel configurations")
    p.add_argument("--budget-s", type=float, default=400, help="skip further sweeps after this many seconds")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter): checks the script")
    p.add_argument("--kernels", help="comma-separated substrings of the kernel names to time (default: all), "
                   "e.g. 'padded' for the three padded group duals")
    args = p.parse_args()
    global DEVICE
    if args.smoke:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        sys.exit("bench_quant.py needs a CUDA GPU (or --smoke)")
    ao, ao_version = _torchao() if DEVICE == "cuda" else (None, None)
    start = time.time()
    models = list(SMOKE_MODELS) if args.smoke else [m.strip() for m in args.models.split(",")]
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (smoke run)"
    os.makedirs(args.out, exist_ok=True)

    def write(table: Table, sweeps: list[dict]) -> None:
        meta = dict(date=datetime.date.today().isoformat(), gpu=gpu, torch=torch.__version__,
                    triton=triton.__version__, torchao=ao_version, python=platform.python_version(),
                    copy_gbps=round(table.copy, 1), seconds=round(time.time() - start, 1),
                    models=sorted({r["model"] for r in table.rows}, key=models.index))
        with open(os.path.join(args.out, "quant.json"), "w") as f:
            json.dump(dict(meta=meta, rows=table.rows, sweep=sweeps), f, indent=1)
        with open(os.path.join(args.out, "quant.md"), "w") as f:
            f.write(_markdown(meta, table, sweeps))
        print(f"wrote {args.out}/quant.json and quant.md ({', '.join(meta['models'])}) at {meta['seconds']} s",
              flush=True)

    kernels = [k.strip() for k in args.kernels.split(",")] if args.kernels else None
    run(models, args.sweep, start + args.budget_s, ao, on_model_done=write, kernels=kernels)


if __name__ == "__main__":
    main()
