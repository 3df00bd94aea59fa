"""The column-wise quantizer's worker lag on one GPU: every lag 0..MAX_LAG against ``auto_lag``'s choice.

``auto_lag`` picks the largest lag whose ``lag + 1`` column blocks have at most 3.5 chunks (member
programs) per multiprocessor, at least 1 in jagged (wgrad) launches
(``moe_fp8/quant/kernels/colwise.py``; first fitted, with 3 per multiprocessor, to this script's shapes at
512-row chunks of 64 x 64 tiles, then to ``results/colwise_default_ab.md`` at the default tile): the expert
dgrad layout of every model's weights (incl. DeepSeek-V3 with 32 local experts) and the wgrad
dual of DeepSeek-V3 over 8 groups at 32768, 65536 and 131072 rows, of Llama 4 and of Qwen3.
Median GPU time of CUDA-graph replays; ``colwise_config``'s defaults otherwise.

    python benchmarks/sweep_colwise_lag.py [--out DIR]    # -> DIR/colwise_lag.{json,md}
    python benchmarks/sweep_colwise_lag.py --block-c 32 --chunk 1024 --kinds dgrad
    python benchmarks/sweep_colwise_lag.py --chunk 512 --block-r 64 --block-c 64   # the tile before 2026-11-30
    python benchmarks/sweep_colwise_lag.py --smoke        # tiny shapes, interpreter: checks the script
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import triton

import bench_quant
from moe_fp8.launch_math import cdiv
from moe_fp8.quant.kernels.colwise import MAX_LAG, auto_lag, colwise_config
from moe_fp8.quant.kernels.common import multiprocessor_count
from moe_fp8.testing import random_offsets

# (model, E, N, K): the dgrad layout quantizes W (E, N, K) over N; wgrad: (model, rows, N, K, groups)
DGRAD = [("DeepSeek-V3", 8, 4096, 7168), ("DeepSeek-V3", 8, 7168, 2048), ("DeepSeek-V3 E32", 32, 4096, 7168),
         ("DeepSeek-V3 E32", 32, 7168, 2048), ("Llama 4", 16, 8192, 5120), ("Qwen3-30B-A3B", 128, 1536, 2048),
         ("Qwen3-30B-A3B", 128, 2048, 768)]
WGRAD = [("DeepSeek-V3", 32768, 4096, 7168, 8), ("DeepSeek-V3", 65536, 4096, 7168, 8),
         ("DeepSeek-V3", 131072, 4096, 7168, 8), ("Llama 4", 16384, 8192, 5120, 16),
         ("Qwen3-30B-A3B", 65536, 1536, 2048, 128)]
SMOKE_DGRAD = [("smoke", 2, 32, 48)]
SMOKE_WGRAD = [("smoke", 64, 32, 48, 3)]
BLOCK_C = None  # columns per column block (--block-c); None: colwise_config's default
BLOCK_R = None  # rows per tile (--block-r); None: colwise_config's default
CHUNK = None  # rows per chunk (--chunk); None: colwise_config's default


def _tile() -> tuple[int, int, int]:
    """``(BLOCK_C, BLOCK_R, CHUNK)``: the command line's, else ``colwise_config``'s defaults."""
    cfg = colwise_config()
    return BLOCK_C or cfg["BLOCK_C"], BLOCK_R or cfg["BLOCK_R"], CHUNK or cfg["CHUNK"]


def _row(kind, model, shape, rows, nbytes, make_fn, device) -> dict:
    """Times ``make_fn(config)`` at every lag; ``auto`` is the lag the default config resolves to.
    ``kind``: "dgrad" (uniform groups) or "wgrad" (jagged)."""
    block_c, block_r, chunk = _tile()
    n_chunks = cdiv(rows, chunk)
    auto = auto_lag(n_chunks, multiprocessor_count(torch.device(device)), jagged=kind == "wgrad")
    us = {lag: bench_quant._time_us(make_fn(colwise_config(lag=lag, block_c=block_c, block_r=block_r, chunk=chunk)))
          for lag in range(MAX_LAG + 1)}
    best = min(us, key=us.get)
    row = dict(kind=kind, model=model, shape=shape, chunks=n_chunks, block_mib=round(rows * block_c * 2 / 2**20, 1),
               auto=auto,
               us={str(k): round(v, 2) for k, v in us.items()}, best=best,
               auto_vs_best=round(us[auto] / us[best], 3), auto_vs_lag0=round(us[0] / us[auto], 3),
               nbytes=nbytes)
    print(f"{kind:6s} {model:16s} {shape:26s} chunks {n_chunks:4d} block {row['block_mib']:5.1f} MiB "
          f"auto {auto} best {best} "
          + " ".join(f"{k}:{v:7.1f}" for k, v in us.items()) + f"  auto/best {row['auto_vs_best']:.3f}", flush=True)
    return row


def run(smoke: bool, kinds: tuple[str, ...], on_row=None) -> list[dict]:
    """Every lag on every shape of ``kinds``; ``on_row(rows)`` after each shape (``main`` writes the
    tables then, so a run cut short keeps the shapes it finished)."""
    dev = bench_quant.DEVICE
    gen = torch.Generator().manual_seed(0)
    rows = []
    for model, E, N, K in (SMOKE_DGRAD if smoke else DGRAD) if "dgrad" in kinds else ():
        w = torch.randn(E, N, K, device=dev, dtype=torch.bfloat16) * 0.02
        rows.append(_row("dgrad", model, f"{E}x{N}x{K}", E * N, E * N * K * 3 + E * K * 4,
                         lambda cfg: bench_quant._expert_t_variant(w, cfg, None), dev))
        del w
        if on_row is not None:
            on_row(rows)
    for model, M, N, K, G in (SMOKE_WGRAD if smoke else WGRAD) if "wgrad" in kinds else ():
        a = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        b = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        offs = random_offsets(M, G, "balanced", multiple_of=16, generator=gen).to(dev)
        rows.append(_row("wgrad", model, f"{M}x({N}+{K}) E={G}", M, M * (N + K) * 3 + G * (N + K) * 4,
                         lambda cfg: bench_quant._group_variant(a, b, offs, cfg, None), dev))
        del a, b
        if on_row is not None:
            on_row(rows)
    return rows


def _markdown(meta: dict, rows: list[dict]) -> str:
    lags = [str(k) for k in range(MAX_LAG + 1)]
    lines = ["# Column-wise quantizer: worker lag", "",
             f"{meta['date']}, {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, "
             f"{meta['sms']} multiprocessors. "
             f"BLOCK_R x BLOCK_C {meta['block_r']} x {meta['block_c']}, CHUNK {meta['chunk']}. µs: median of CUDA-graph replays. `block MiB`: "
             "one column block of all rows (bf16). `chunks`: member programs per column block. `auto`: "
             "`auto_lag`'s choice (largest lag <= 4 with (lag + 1) x chunks <= 3.5 per multiprocessor; at least 1 for "
             "wgrad).", "",
             "| kind | model | shape | chunks | block MiB | " + " | ".join(f"lag {k} µs" for k in lags)
             + " | auto | best | auto / best | lag 0 / auto |",
             "|---|---|---|---:|---:|" + "---:|" * len(lags) + "---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['model']} | {r['shape']} | {r['chunks']} | {r['block_mib']} | "
                     + " | ".join(f"{r['us'][k]:.1f}" for k in lags)
                     + f" | {r['auto']} | {r['best']} | {r['auto_vs_best']:.3f} | {r['auto_vs_lag0']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results", help="folder for colwise_lag.json and colwise_lag.md")
    p.add_argument("--kinds", default="dgrad,wgrad", help="dgrad (expert, uniform) and/or wgrad (jagged)")
    p.add_argument("--block-c", type=int, default=None, help="columns per column block (default: colwise_config's)")
    p.add_argument("--block-r", type=int, default=None, help="rows per tile (default: colwise_config's)")
    p.add_argument("--chunk", type=int, default=None, help="rows per chunk (default: colwise_config's)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter): checks the script")
    args = p.parse_args()
    if args.smoke:
        bench_quant.DEVICE = "cpu"
    elif not torch.cuda.is_available():
        sys.exit("sweep_colwise_lag.py needs a CUDA GPU (or --smoke)")
    global BLOCK_C, BLOCK_R, CHUNK
    BLOCK_C, BLOCK_R, CHUNK = args.block_c, args.block_r, args.chunk
    dev = torch.device(bench_quant.DEVICE)
    block_c, block_r, chunk = _tile()
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                gpu=torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (smoke run)",
                block_c=block_c, block_r=block_r, chunk=chunk, torch=torch.__version__, triton=triton.__version__,
                sms=multiprocessor_count(dev))
    os.makedirs(args.out, exist_ok=True)

    def write(rows: list[dict]) -> None:
        with open(os.path.join(args.out, "colwise_lag.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        with open(os.path.join(args.out, "colwise_lag.md"), "w") as f:
            f.write(_markdown(meta, rows))
        print(f"wrote {args.out}/colwise_lag.json and colwise_lag.md ({len(rows)} shapes)", flush=True)

    run(args.smoke, tuple(args.kinds.split(",")), on_row=write)


if __name__ == "__main__":
    main()
