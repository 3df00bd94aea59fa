"""Rows per program of the row quantization that also reduces per-group column amaxes
(``launch_group_rowwise_amax``), swept on the GPU: GB/s over the bytes it must move (x read once, the
FP8 rows and scales written once) as a fraction of the copy bandwidth of the same run.

Dense linears call it with one group over ``M`` = tokens rows; the grouped GEMMs with one group per
expert over the routed rows. Fewer rows per program give more programs (the GPU's multiprocessors
busy) and more atomics (one per column and program).

    PYTHONPATH=. python benchmarks/sweep_group_rowwise_rows.py --out DIR   (or with the package installed)
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import triton

from moe_fp8.bench.timing import event_median_ms
from moe_fp8.quant.formats import resolve_format
from moe_fp8.quant.kernels.rowwise import launch_group_rowwise_amax

SHAPES = [  # (name, M, K, groups)
    ("Llama3-8B x (dense)", 8192, 4096, 1),
    ("Llama3-8B MLP grad (dense)", 8192, 14336, 1),
    ("DeepSeek-V3 dense x", 8192, 7168, 1),
    ("Qwen3-30B-A3B routed x", 65536, 2048, 128),
    ("DeepSeek-V3 routed x", 65536, 7168, 32),
]
ROWS = (4, 8, 16, 32, 64, 128)


def _copy_gbs(x: torch.Tensor) -> float:
    out = torch.empty_like(x)
    ms = event_median_ms(lambda: out.copy_(x), 50)
    return 2 * x.numel() * x.element_size() / ms / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    fmt = resolve_format(None, torch.device("cuda"))
    rows_out = []
    for name, M, K, G in SHAPES:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        offs = torch.linspace(M / G, M, G, device="cuda").round().to(torch.int32)
        q = torch.empty(M, K, device="cuda", dtype=fmt.torch_dtype)
        scale = torch.empty(M, device="cuda", dtype=torch.float32)
        bits = torch.zeros(G, K, device="cuda", dtype=torch.int32)
        copy = _copy_gbs(x)
        nbytes = M * K * 3 + M * 4 + G * K * 4
        for rows in ROWS:
            def step():
                bits.zero_()
                launch_group_rowwise_amax(x, q, scale, bits, offs, fmt, True, rows_per_program=rows)

            ms = event_median_ms(step, 50)
            gbs = nbytes / ms / 1e6
            rows_out.append(dict(shape=name, M=M, K=K, groups=G, rows_per_program=rows,
                                 programs=triton.cdiv(M, rows), us=ms * 1e3, gbs=gbs, pct_copy=100 * gbs / copy))
            print(f"{name:28s} rows {rows:4d}: {ms * 1e3:8.1f} us {gbs:7.0f} GB/s {100 * gbs / copy:5.1f}% of copy")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    (args.out / "sweep_group_rowwise_rows.json").write_text(json.dumps(dict(meta=meta, rows=rows_out), indent=1))
    lines = ["# Rows per program of the group-amax row quantization", "",
             f"{meta['date']} · {meta['gpu']} · torch {meta['torch']} · triton {meta['triton']}", "",
             "| shape | M | K | groups | rows per program | programs | µs | GB/s | % of copy |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['shape']} | {r['M']} | {r['K']} | {r['groups']} | {r['rows_per_program']} | {r['programs']} | "
              f"{r['us']:.1f} | {r['gbs']:.0f} | {r['pct_copy']:.0f}% |" for r in rows_out]
    (args.out / "sweep_group_rowwise_rows.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
