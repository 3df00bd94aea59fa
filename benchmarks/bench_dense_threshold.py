"""Where FP8 pays for a dense linear: ``FP8Linear`` against ``nn.Linear`` (bf16), forward+backward, per shape.

``moe_fp8.hf.convert`` keeps a dense linear in BF16 when ``min(in_features, out_features) <
min_dense_size`` (default ``MIN_DENSE_SIZE`` = 512, a conservative guess). This script measures the
rule on the GPU: for T tokens (default 8192) it times one forward+backward of a linear ``K -> N`` in
BF16 and with ``FP8Linear`` (recipes ``rowwise``, ``rowwise_gw_hp``), on square shapes ``d -> d`` and
on the two narrow shapes of attention (``4096 -> d``, ``d -> 4096``), and prints per shape the
speedup and the smallest ``min(K, N)`` from which every measured shape of the sweep is at least
``--pay`` (default 1.0) times BF16. That ``min(K, N)`` is the threshold to put in ``MIN_DENSE_SIZE``.

Usage: ``python benchmarks/bench_dense_threshold.py [--tokens 8192] [--out benchmarks/results]``
(about a minute on one H200; on the CPU a smoke run of tiny shapes). Writes
``dense_threshold.json`` and ``dense_threshold.md``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from moe_fp8 import MIN_DENSE_SIZE, convert_to_fp8
from moe_fp8.bench import layer
from moe_fp8.bench.report import run_env, write_report

RECIPES = ("rowwise", "rowwise_gw_hp")
SIZES = (128, 256, 384, 512, 768, 1024, 1536, 2048, 4096)
WIDE = 4096


def shapes(sizes) -> list[tuple[int, int]]:
    """``(K, N)``: square ``d -> d``, and ``WIDE -> d`` / ``d -> WIDE`` (attention's narrow projections)."""
    out = []
    for d in sizes:
        out += [(d, d), (WIDE, d), (d, WIDE)] if d != WIDE else [(d, d)]
    return out


def measure(tokens: int, k: int, n: int, device: str) -> dict:
    torch.manual_seed(0)
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)
    row = dict(K=k, N=n, min_kn=min(k, n), tokens=tokens)
    base = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    row["bf16_ms"], _ = layer.measure(layer.fwd_bwd(base, x, dy))
    for recipe in RECIPES:
        fp8 = convert_to_fp8(nn.Sequential(nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)),
                             recipe=recipe)
        ms, _ = layer.measure(layer.fwd_bwd(fp8, x, dy))
        row[f"{recipe}_ms"], row[f"{recipe}_speedup"] = ms, row["bf16_ms"] / ms
    return row


def threshold(rows: list[dict], recipe: str, pay: float) -> int | None:
    """Smallest ``min(K, N)`` from which every row has ``speedup >= pay`` (``None``: not even the largest)."""
    best = None
    for m in sorted({r["min_kn"] for r in rows}, reverse=True):
        if all(r[f"{recipe}_speedup"] >= pay for r in rows if r["min_kn"] >= m):
            best = m
        else:
            break
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--pay", type=float, default=1.0, help="speedup over BF16 that counts as paying")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layer.DEVICE = device
    tokens, sizes = (args.tokens, SIZES) if device == "cuda" else (32, (16, 32))  # CPU: a smoke run
    rows = [measure(tokens, k, n, device) for k, n in shapes(sizes)]
    head = "| K | N | min(K,N) | bf16 ms | " + " | ".join(f"{r} ms | {r} x" for r in RECIPES) + " |"
    table = [head, "|" + "---|" * (4 + 2 * len(RECIPES))]
    for r in rows:
        cells = [str(r["K"]), str(r["N"]), str(r["min_kn"]), f"{r['bf16_ms']:.3f}"]
        cells += [f"{r[f'{x}_ms']:.3f} | {r[f'{x}_speedup']:.2f}" for x in RECIPES]
        table.append("| " + " | ".join(cells) + " |")
    found = {x: threshold(rows, x, args.pay) for x in RECIPES}
    verdict = [f"- {x}: FP8 >= {args.pay:.2f}x BF16 for every shape with min(K, N) >= {found[x]} "
               f"(MIN_DENSE_SIZE is {MIN_DENSE_SIZE})" for x in RECIPES]
    print("\n".join(table + [""] + verdict))
    env = run_env(device, tokens=tokens, pay=args.pay, thresholds=found, min_dense_size=MIN_DENSE_SIZE)
    method = f"T={tokens} tokens, forward+backward, medians (moe_fp8.bench.layer.measure)"
    write_report(args.out, "dense_threshold", env, rows, "Dense FP8Linear vs BF16: where FP8 pays", method,
                 table + [""] + verdict)


if __name__ == "__main__":
    main()
