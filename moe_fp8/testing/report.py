"""The harness's table (case x check), its summary line, and the JSON / markdown it writes."""

from __future__ import annotations

import datetime
import json
from collections import Counter
from pathlib import Path

import torch

from .results import CHECKS, CheckResult, count_statuses

__all__ = ["format_summary", "format_table", "run_environment", "write_json", "write_markdown"]


def _grid(results: list[CheckResult]) -> tuple[list[str], list[str], dict[tuple[str, str], CheckResult]]:
    cases = list(dict.fromkeys(r.case for r in results))
    present = {r.check for r in results}
    checks = [c for c in CHECKS if c in present]
    return cases, checks, {(r.case, r.check): r for r in results}


def format_table(results: list[CheckResult], *, markdown: bool = False) -> str:
    """One row per case, one column per check: the SQNR in dB or ``pass`` for a passing check,
    ``FAIL ...``, ``ERROR``, ``skip``; ``-`` where the check does not apply. Failures, errors and
    skips are listed below the table with their reasons."""
    cases, checks, cells = _grid(results)
    rows = [["case", *checks]] + [[c, *(cells[c, k].cell() if (c, k) in cells else "-" for k in checks)]
                                  for c in cases]
    if markdown:
        lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    else:
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    notes = [f"{r.case} {r.check}: {r.status}: {r.detail}" for r in results if r.status in ("fail", "error")]
    skips = Counter(r.detail for r in results if r.status == "skip")
    notes += [f"skip ({n} checks): {why}" for why, n in skips.items()]
    return "\n".join(lines + ([""] + [("- " if markdown else "  ") + n for n in notes] if notes else []))


def format_summary(name: str, results: list[CheckResult]) -> str:
    """``name: 120 pass, 0 fail, 0 error, 14 skip; min SQNR out 27.9 / dx 28.1 / dw 25.3 dB``."""
    n = count_statuses(results)
    mins = []
    for check in ("out", "dx", "dw"):
        vals = [r.value for r in results if r.check == check and r.status in ("pass", "fail") and r.value is not None]
        if vals:
            mins.append(f"{check} {min(vals):.1f}")
    tail = f"; min SQNR {' / '.join(mins)} dB" if mins else ""
    return f"{name}: " + ", ".join(f"{v} {k}" for k, v in n.items()) + tail


def run_environment(device: str) -> dict:
    """Date (UTC), device name, torch / triton / torchao versions."""
    import importlib.metadata as md

    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else "CPU"
    return dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), device=gpu,
                torch=torch.__version__, triton=version("triton"), torchao=version("torchao"))


def write_json(path: str | Path, env: dict, runs: dict[str, list[CheckResult]]) -> None:
    """``{"env": ..., "runs": {impl: [result dicts]}, "summary": {impl: counts}}``."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    head = json.dumps(dict(env=env, summary={k: count_statuses(v) for k, v in runs.items()}), indent=1)
    body = ",\n".join(f"  {json.dumps(k)}: [\n" + ",\n".join("   " + json.dumps(r.to_dict()) for r in v) + "\n  ]"
                      for k, v in runs.items())
    Path(path).write_text(head[:-2] + ',\n "runs": {\n' + body + "\n }\n}\n")  # one line per result


def write_markdown(path: str | Path, env: dict, runs: dict[str, list[CheckResult]], command: str) -> None:
    """The environment, the command, one summary line per implementation, then each one's table."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    versions = " · ".join(f"{k} {env[k]}" for k in ("torch", "triton", "torchao") if env.get(k))
    lines = ["# Grouped-GEMM correctness battery (moe_fp8.testing)", "",
             f"{env['date']} · {env['device']} · {versions}", "", f"`{command}`", ""]
    lines += [f"- {format_summary(k, v)}" for k, v in runs.items()]
    for k, v in runs.items():
        lines += ["", f"## {k}", "", format_table(v, markdown=True)]
    Path(path).write_text("\n".join(lines) + "\n")
