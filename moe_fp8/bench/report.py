"""The entry point's output: a printed table per benchmark kind, JSON, markdown and a PNG bar chart."""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import triton

from . import step_profile

#: kind -> (column header, row key, format); a missing or None value prints "-"
COLUMNS: dict[str, list[tuple[str, str, str]]] = {
    "quant": [("model", "model", "s"), ("kernel", "kernel", "s"), ("shape", "shape", "s"),
              ("ours µs", "ours_us", ".1f"),
              ("ours % copy", "ours_frac", ".0%"), ("TorchAO µs", "torchao_us", ".1f"),
              ("TorchAO % copy", "torchao_frac", ".0%"), ("vs TorchAO", "speedup", ".2f")],
    "gemm": [("shape", "shape", "s"), ("method", "method", "s"), ("fwd ms", "fwd_ms", ".3f"),
             ("fwd+bwd ms", "fwd_bwd_ms", ".3f"), ("fwd+bwd vs BF16", "fwd_bwd_speedup_vs_bf16", ".2f"),
             ("fwd+bwd vs TorchAO", "fwd_bwd_speedup_vs_torchao", ".2f"), ("SQNR out dB", "sqnr_out", ".1f"),
             ("wgrad ms", "wgrad_ms", ".3f")],
    "layer": [("layer", "layer", "s"), ("tokens", "tokens", "d"), ("recipe", "recipe", "s"), ("ms", "ms", ".2f"),
              ("vs BF16", "speedup", ".2f"), ("CUDA graph vs BF16", "graph_speedup", ".2f"),
              ("peak GiB", "peak_gib", ".2f"), ("SQNR dB", "sqnr_vs_bf16", ".1f")],
    "dense": [("layer", "layer", "s"), ("tokens", "tokens", "d"), ("recipe", "recipe", "s"), ("ms", "ms", ".2f"),
              ("vs BF16", "speedup", ".2f"), ("vs TorchAO rowwise", "speedup_vs_torchao", ".2f"),
              ("peak GiB", "peak_gib", ".2f"), ("SQNR dB", "sqnr_vs_bf16", ".1f")],
    "train": [("model", "model", "s"), ("recipe", "recipe", "s"), ("steps", "steps", "d"),
              ("tokens/s", "tokens_per_s", ",.0f"), ("vs BF16", "speedup", ".2f"),
              ("val loss", "final_val_loss", ".4f")],
    "dense_sweep": [("linear K->N", "layer", "s"), ("tokens", "tokens", "d"), ("BF16 ms", "bf16_ms", ".3f"),
                    ("FP8 ms", "fp8_ms", ".3f"), ("vs BF16", "speedup", ".2f"), ("BF16 graph ms", "bf16_graph_ms", ".3f"),
                    ("FP8 graph ms", "fp8_graph_ms", ".3f"), ("graph vs BF16", "graph_speedup", ".2f")],
    "model": [("model", "model", "s"), ("mode", "mode", "s"), ("variant", "variant", "s"),
              ("layers", "layers", "d"), ("micro-batches", "accumulate", "d"), ("step ms", "step_ms", ".1f"),
              ("fwd+bwd ms", "fwd_bwd_ms", ".1f"),
              ("optimizer ms", "optim_ms", ".1f"), ("tokens/s", "tokens_per_s", ",.0f"), ("vs HF BF16", "speedup", ".2f"),
              ("peak GiB", "peak_gib", ".2f"), ("peak after step 1", "steady_peak_gib", ".2f"),
              ("graphs", "graphs", "d"), ("graph breaks", "graph_breaks", "d"),
              ("empty experts", "empty_experts", ".1f"),
              ("loss", "final_loss", ".4f"), ("loss gap", "loss_gap", "+.2%")],
}
TITLES = {"quant": "Quantization kernels (bandwidth)", "gemm": "Grouped GEMM, forward+backward",
          "layer": "MoE layer (FP8MoE), forward+backward", "dense": "Dense MLP (FP8Linear), forward+backward",
          "train": "End-to-end training step (Hugging Face model)",
          "dense_sweep": "Dense linear (FP8Linear rowwise vs nn.Linear), forward+backward",
          "model": "Whole-model training step (Hugging Face models, converted vs unconverted)"}


def _cell(row: dict, key: str, spec: str) -> str:
    v = row.get(key)
    if v is None:
        return "-"
    return format(v, spec) + ("x" if "speedup" in key else "")


def _label(row: dict) -> str:
    if "variant" in row:
        return f"{row['model']} {row['mode']} {row['variant']}"
    return row.get("method", row.get("recipe", "?"))


def table(kind: str, rows: list[dict], markdown: bool = False) -> str:
    """The rows of one kind as aligned text, or as a markdown table."""
    cols = COLUMNS[kind]
    cells = [[h for h, _, _ in cols]] + [[_cell(r, k, s) for _, k, s in cols] for r in rows if "error" not in r]
    cells += [[_label(r), "failed: " + r["error"][:160]] + [""] * (len(cols) - 2) for r in rows if "error" in r]
    if markdown:
        lines = ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(cols)]
        return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells[1:]])
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def headline(results: dict[str, list[dict]]) -> list[tuple[str, float, str]]:
    """``(label, speedup, against)`` bars: our default FP8 path against BF16 (quantization kernels: TorchAO)."""
    bars = []
    for r in results.get("quant", []):
        if r.get("speedup") is not None:
            bars.append((f"quant {r['model']}: {r['kernel']}", r["speedup"], "TorchAO"))
    for r in results.get("gemm", []):
        if r.get("method") in ("rowwise / cuda_auto", "rowwise / emulated") and r.get("fwd_bwd_speedup_vs_bf16"):
            bars.append((f"grouped GEMM {r['shape']}", r["fwd_bwd_speedup_vs_bf16"], "BF16"))
    for kind, recipes in (("layer", ("rowwise", "rowwise, no weight cache")), ("dense", ("ours rowwise",))):
        for r in results.get(kind, []):
            if r.get("recipe") in recipes:
                bars.append((f"{kind} {r['layer']} T={r['tokens']} {r['recipe']}", r["speedup"], "BF16"))
    for r in results.get("train", []):
        if r["recipe"] == "rowwise":
            bars.append(("training step (HF DeepSeek-V3-style)", r["speedup"], "BF16"))
    return bars


def write(out: Path, name: str, meta: dict, results: dict[str, list[dict]]) -> list[Path]:
    """``name``.json, ``name``.md and (with matplotlib) ``name``_speedups.png in ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json", out / f"{name}.md"]
    paths[0].write_text(json.dumps(dict(meta=meta, results=results), indent=1, default=str) + "\n")
    lines = [f"# `python -m moe_fp8.bench {meta['args']}`", "",
             f"{meta['date']} · {meta['gpu']} · torch {meta['torch']} · triton {meta['triton']} · "
             f"torchao {meta['torchao'] or 'not installed'} · {meta['seconds']:.0f} s"]
    if meta.get("copy_gbps"):
        lines += ["", f"Device-to-device copy bandwidth: {meta['copy_gbps']:.0f} GB/s (read + write)."]
    for kind, rows in results.items():
        lines += ["", f"## {TITLES[kind]}", "", table(kind, rows, markdown=True)]
        if kind == "model":
            broken = [r for r in rows if r.get("break_reasons")]
            if broken:
                lines += ["", "Graph breaks (the most frequent reasons):", ""]
                lines += [f"- {_label(r)}: " + "; ".join(r["break_reasons"]) for r in broken]
            lines += step_profile.markdown(rows)
    paths[1].write_text("\n".join(lines) + "\n")
    png = out / f"{name}_speedups.png"
    if plot(headline(results), png, f"{meta['gpu']}: FP8 speedups"):
        paths.append(png)
    return paths


def plot(bars: list[tuple[str, float, str]], path: Path, title: str) -> bool:
    """Horizontal bars of the speedups (1.0 marked); ``False`` without matplotlib or bars."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if not bars:
        return False
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(bars) + 1.2))
    colors = ["tab:green" if against == "BF16" else "tab:purple" for _, _, against in bars]
    ax.barh([f"{label} (vs {against})" for label, _, against in bars], [v for _, v, _ in bars], color=colors)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("speedup (x)")
    ax.set_title(title)
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def script_args(doc: str, steps: int) -> tuple[argparse.Namespace, str]:
    """A benchmark script's ``--steps`` (default ``steps``), ``--out`` and ``--quick`` (tiny shapes on
    the CPU, a smoke run) from the command line, and the device it runs on."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (a smoke run)")
    args = ap.parse_args()
    return args, "cuda" if torch.cuda.is_available() and not args.quick else "cpu"


def run_env(device: str, **extra) -> dict:
    """Date (UTC), GPU name (``"CPU (smoke)"`` off CUDA), torch and triton versions, and ``extra``."""
    return dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                gpu=torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke)", torch=torch.__version__,
                triton=triton.__version__, **extra)


def write_report(out: str | Path, stem: str, env: dict, rows: list[dict], title: str, method: str,
                 body: list[str]) -> None:
    """``out/stem.json`` and ``out/stem.md`` of a benchmark with a layout of its own: ``# title``, then
    date, GPU, versions and ``method`` on one line, then ``body`` (markdown lines)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    env_line = f"{env['date']} · {env['gpu']} · torch {env['torch']} · triton {env['triton']} · {method}"
    (out / f"{stem}.md").write_text("\n".join([f"# {title}", "", env_line, "", *body]) + "\n")
