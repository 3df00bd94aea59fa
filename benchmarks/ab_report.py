"""What the A/B scripts write: the run's environment, ``<stem>.json`` (environment and rows) and
``<stem>.md`` (a title, one line of environment and method, then the script's lines)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import torch
import triton


def run_env(device: str, **extra) -> dict:
    """Date (UTC), GPU name (``"CPU (smoke)"`` off CUDA), torch and triton versions, and ``extra``."""
    return dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                gpu=torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke)", torch=torch.__version__,
                triton=triton.__version__, **extra)


def write_report(out: str | Path, stem: str, env: dict, rows: list[dict], title: str, method: str,
                 body: list[str]) -> None:
    """``out/stem.json`` and ``out/stem.md``: ``# title``, then date, GPU, versions and ``method`` on
    one line, then ``body`` (markdown lines)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    env_line = f"{env['date']} · {env['gpu']} · torch {env['torch']} · triton {env['triton']} · {method}"
    head = [f"# {title}", "", env_line, ""]
    (out / f"{stem}.md").write_text("\n".join(head + body) + "\n")
