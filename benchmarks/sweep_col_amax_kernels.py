"""The two row quantizations that also reduce column amaxes, swept on the GPU: rows per program,
warps and elements per loop step (``tile``). GB/s over the bytes each must move (the input read
once, the FP8 rows, scales and amaxes written once) as a fraction of the copy bandwidth of the same
run (``moe_fp8.bench.quant.copy_gbps``); median GPU time of CUDA-graph replays
(``moe_fp8.bench.quant.kernel_us``), so the host's launch time, which a training step hides behind
the GPU's work, is not counted.

* ``launch_group_rowwise_amax`` (activations, gradients): one group over ``M`` token rows for a dense
  linear, one group per expert over the routed rows for the grouped GEMMs.
* ``launch_expert_rowwise_col_amax`` (weights, forward layout): ``E`` experts of ``N`` rows; a dense
  linear's weight is one expert.

Fewer rows per program make more programs (the multiprocessors busy) and more atomics (one per
column and program). ``default`` marks the configuration the launchers pick.

    PYTHONPATH=. python benchmarks/sweep_col_amax_kernels.py --out DIR   (or with the package installed)
    ... --quick: the launchers' defaults and 128 rows per program only
    ... --shapes dense "Llama 4": only the shapes whose name contains one of these texts
    ... --mark RESULTS.json --name NAME: an earlier sweep written again, the current defaults marked
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
from pathlib import Path

import torch
import triton

from moe_fp8.bench.quant import copy_gbps, kernel_us
from moe_fp8.quant.formats import resolve_format
from moe_fp8.quant.kernels import rowwise

ACTIVATIONS = [  # (name, M, K, groups)
    ("Llama3-8B x (dense)", 8192, 4096, 1),
    ("Llama3-8B MLP grad (dense)", 8192, 14336, 1),
    ("DeepSeek-V3 dense x", 8192, 7168, 1),
    ("DeepSeek-V3 o_proj x (dense)", 8192, 16384, 1),
    ("DeepSeek-V3 q_b_proj x (dense)", 8192, 1536, 1),
    ("Llama 4 Scout shared-expert x (dense)", 8192, 5120, 1),
    ("Llama 4 Scout routed x, top-1", 8192, 5120, 16),
    ("Mixtral-8x7B routed x, top-2", 16384, 4096, 8),
    ("Qwen3-30B-A3B routed x", 65536, 2048, 128),
    ("DeepSeek-V3 routed x", 65536, 7168, 32),
]
WEIGHTS = [  # (name, E, N, K)
    ("Llama3-8B q_proj (dense)", 1, 4096, 4096),
    ("Llama3-8B gate_proj (dense)", 1, 14336, 4096),
    ("Llama3-8B down_proj (dense)", 1, 4096, 14336),
    ("DeepSeek-V3 gate_proj (dense)", 1, 18432, 7168),
    ("DeepSeek-V3 q_b_proj (dense)", 1, 24576, 1536),
    ("DeepSeek-V3 o_proj (dense)", 1, 7168, 16384),
    ("Llama 4 Scout shared-expert gate_proj (dense)", 1, 8192, 5120),
    ("DeepSeek-V3 w1, 8 experts", 8, 4096, 7168),
    ("Mixtral-8x7B w1, 8 experts", 8, 14336, 4096),
    ("Qwen3-30B-A3B w1, 128 experts", 128, 1536, 2048),
]
ROWS = (8, 16, 32, 64, 128)
WARPS_TILE = ((None, rowwise.TILE_ELEMENTS), (8, rowwise.TILE_ELEMENTS), (16, rowwise.TILE_ELEMENTS),
              (None, 2 * rowwise.TILE_ELEMENTS), (16, 2 * rowwise.TILE_ELEMENTS))


def sweep_activations(fmt, configs, copy: float, shapes: list[str]) -> list[dict]:
    rows_out = []
    for name, M, K, G in ACTIVATIONS:
        if not any(text in name for text in shapes):
            continue
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        offs = torch.linspace(M / G, M, G, device="cuda").round().to(torch.int32)
        q = torch.empty(M, K, device="cuda", dtype=fmt.torch_dtype)
        scale = torch.empty(M, device="cuda", dtype=torch.float32)
        bits = torch.zeros(G, K, device="cuda", dtype=torch.int32)
        nbytes = M * K * 3 + M * 4 + G * K * 4
        rows, tile = rowwise.col_amax_defaults(M, K)
        default = (rows, None, tile)
        for rows, warps, tile in configs(default):
            def step():
                bits.zero_()
                rowwise.launch_group_rowwise_amax(x, q, scale, bits, offs, fmt, True, rows_per_program=rows,
                                                  num_warps=warps, tile=tile)

            rows_out.append(_row("activation", name, (M, K, G), rows, warps, tile, (rows, warps, tile) == default,
                                 kernel_us(step), nbytes, copy))
    return rows_out


def sweep_weights(fmt, configs, copy: float, shapes: list[str]) -> list[dict]:
    rows_out = []
    for name, E, N, K in WEIGHTS:
        if not any(text in name for text in shapes):
            continue
        w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16)
        q = torch.empty(E, N, K, device="cuda", dtype=fmt.torch_dtype)
        scale = torch.empty(E, N, device="cuda", dtype=torch.float32)
        bits = torch.zeros(E, K, device="cuda", dtype=torch.int32)
        nbytes = E * N * K * 3 + E * N * 4 + E * K * 4
        rows, tile = rowwise.col_amax_defaults(N, K, E)
        default = (rows, None, tile)
        for rows, warps, tile in configs(default):
            def step():
                bits.zero_()
                rowwise.launch_expert_rowwise_col_amax(w, q, scale, bits, fmt, True, rows_per_program=rows,
                                                       num_warps=warps, tile=tile)

            rows_out.append(_row("weight", name, (E * N, K, E), rows, warps, tile, (rows, warps, tile) == default,
                                 kernel_us(step), nbytes, copy))
    return rows_out


def _row(kernel, name, shape, rows, warps, tile, default, us, nbytes, copy) -> dict:
    M, K, G = shape
    gbs = nbytes / us / 1e3
    row = dict(kernel=kernel, shape=name, M=M, K=K, groups=G, rows_per_program=rows, num_warps=warps or "auto",
               tile=tile, default=default, us=us, gbs=gbs, pct_copy=100 * gbs / copy)
    print(f"{kernel:10s} {name:30s} rows {rows:4d} warps {row['num_warps']!s:4s} tile {tile:5d}{' *' if default else '  '}"
          f" {us:8.1f} us {100 * gbs / copy:5.1f}% of copy", flush=True)
    return row


def mark_defaults(rows: list[dict]) -> list[dict]:
    """``rows`` with ``default`` set where a row's configuration is what the launchers pick now."""
    marked = []
    for r in rows:
        E = r["groups"] if r["kernel"] == "weight" else 1
        picked, tile = rowwise.col_amax_defaults(r["M"] // E, r["K"], E)
        marked.append({**r, "default": (r["rows_per_program"], r["num_warps"], r["tile"]) == (picked, "auto", tile)})
    return marked


def write_results(out: Path, name: str, meta: dict, rows: list[dict]) -> None:
    """``name``.json and ``name``.md in ``out``: every configuration, then each shape's default
    against its fastest configuration."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = ["# Row quantization with column amax: rows per program, warps, tile", "",
             f"{meta['date']} · {meta['gpu']} · torch {meta['torch']} · triton {meta['triton']} · "
             f"CUDA-graph replays, median · copy {meta['copy_gbps']:.0f} GB/s · `*`: the launcher's default", "",
             "| kernel | shape | default: rows / tile | µs | % of copy | fastest: rows / warps / tile | µs |",
             "|---|---|---|---:|---:|---|---:|"]
    for kernel, shape in dict.fromkeys((r["kernel"], r["shape"]) for r in rows):
        same = [r for r in rows if (r["kernel"], r["shape"]) == (kernel, shape)]
        best = min(same, key=lambda r: r["us"])
        picked = [f"{r['rows_per_program']} / {r['tile']} | {r['us']:.1f} | {r['pct_copy']:.0f}%"
                  for r in same if r["default"]] or ["not swept | - | -"]
        lines.append(f"| {kernel} | {shape} | {picked[0]} | {best['rows_per_program']} / {best['num_warps']} / "
                     f"{best['tile']} | {best['us']:.1f} |")
    lines += ["", "| kernel | shape | M | K | groups | rows per program | warps | tile | µs | GB/s | % of copy |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['kernel']} | {r['shape']} | {r['M']} | {r['K']} | {r['groups']} | {r['rows_per_program']}"
              f"{' *' if r['default'] else ''} | {r['num_warps']} | {r['tile']} | {r['us']:.1f} | {r['gbs']:.0f} | "
              f"{r['pct_copy']:.0f}% |" for r in rows]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--name", default="sweep_col_amax_kernels", help="file name of the results, no suffix")
    parser.add_argument("--quick", action="store_true", help="the defaults and 128 rows per program only")
    parser.add_argument("--shapes", nargs="*", default=[""], help="only the shapes whose name contains one of these texts")
    parser.add_argument("--mark", type=Path, help="no GPU run: write this sweep's JSON again with the launchers' "
                                                  "current defaults marked")
    args = parser.parse_args()
    if args.mark:
        swept = json.loads(args.mark.read_text())
        write_results(args.out, args.name, swept["meta"], mark_defaults(swept["rows"]))
        return
    fmt = resolve_format(None, torch.device("cuda"))

    def configs(default):
        if args.quick:
            return sorted({default, (rowwise.ROWS_PER_PROGRAM, None, rowwise.TILE_ELEMENTS)})
        return [(rows, warps, tile) for rows, (warps, tile) in itertools.product(ROWS, WARPS_TILE)]

    copy = copy_gbps()
    rows_out = sweep_activations(fmt, configs, copy, args.shapes) + sweep_weights(fmt, configs, copy, args.shapes)
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, copy_gbps=copy)
    write_results(args.out, args.name, meta, rows_out)


if __name__ == "__main__":
    main()
