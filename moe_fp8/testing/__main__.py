"""``python -m moe_fp8.testing``: the grouped-GEMM battery on built-in implementations.

    python -m moe_fp8.testing --impl torch --impl moe_fp8:triton --recipes rowwise,bf16 --quick \\
        --device cpu --json out.json --markdown out.md

Prints a table per implementation and a summary line each; exits 1 when a check failed or errored,
0 otherwise (skips included). A TorchAO spec without TorchAO installed is reported and left out.
On a CPU, ``moe_fp8:triton`` needs the Triton interpreter: the command then re-runs itself with
``TRITON_INTERPRET=1`` (it must be set before Triton kernels are defined).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .builtin import ADAPTER_SPECS, get_adapter
from .cases import FORMS
from .harness import check_grouped_mm
from .report import format_summary, format_table, run_environment, write_json, write_markdown
from .results import CheckResult


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moe_fp8.testing", description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", action="append", help=f"implementation spec, repeatable: {', '.join(ADAPTER_SPECS)} "
                   "(default: moe_fp8)")
    p.add_argument("--recipes", default="rowwise",
                   help="comma-separated recipes for each moe_fp8 spec that names none (default: rowwise)")
    p.add_argument("--quick", action="store_true", help="the tiny battery (M <= 80, K, N <= 48, E <= 8)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--forms", default=",".join(FORMS), help="comma-separated forms (default: 2d3d,2d2d)")
    p.add_argument("--no-backward", action="store_true", help="skip the dx / dw checks")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a case counts as a hang")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="run cases in a worker process (default: on CUDA)")
    p.add_argument("--jobs", type=int, default=1,
                   help="implementations run at once, each in its own worker process (implies --isolate)")
    p.add_argument("--json", help="write every result and the environment here")
    p.add_argument("--markdown", help="write the summary and the tables here")
    return p.parse_args(argv)


def _specs(args: argparse.Namespace) -> list[str]:
    out = []
    for spec in args.impl or ["moe_fp8"]:
        head, *rest = spec.split(":")
        if head == "moe_fp8" and len(rest) < 2:
            out += [":".join(["moe_fp8", rest[0] if rest else "auto", r]) for r in args.recipes.split(",")]
        else:
            out.append(spec)
    return out


def _reexec_with_interpreter(specs: list[str], device: str) -> None:
    """Re-run this command with ``TRITON_INTERPRET=1`` when a Triton backend is asked for on a CPU."""
    wants_triton = any(s.startswith("moe_fp8:triton") for s in specs)
    if device == "cpu" and wants_triton and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        env = dict(os.environ, TRITON_INTERPRET="1")
        os.execve(sys.executable, [sys.executable, "-m", "moe_fp8.testing", *sys.argv[1:]], env)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    specs = _specs(args)
    if argv is None:
        _reexec_with_interpreter(specs, args.device)
    forms = tuple(f for f in args.forms.split(",") if f)
    adapters = []
    for spec in specs:
        try:
            adapters.append(get_adapter(spec))
        except ImportError as e:
            print(f"{spec}: not installed ({e}); left out", flush=True)

    def run(adapter) -> list[CheckResult]:
        t0 = time.perf_counter()
        results = check_grouped_mm(adapter, forms=forms, device=args.device, quick=args.quick, verbose=False,
                                   backward=not args.no_backward, timeout=args.timeout,
                                   isolate=True if args.jobs > 1 else args.isolate)
        print(f"== {adapter.name} on {args.device} ({time.perf_counter() - t0:.1f} s)\n{format_table(results)}\n",
              flush=True)
        return results

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:  # threads only wait on their worker processes
        runs: dict[str, list[CheckResult]] = dict(zip((a.name for a in adapters), pool.map(run, adapters)))
    print("\n".join(format_summary(k, v) for k, v in runs.items()))
    env = run_environment(args.device)
    command = "python -m moe_fp8.testing " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    if args.json:
        write_json(args.json, env, runs)
    if args.markdown:
        write_markdown(args.markdown, env, runs, command)
    bad = any(r.status in ("fail", "error") for v in runs.values() for r in v)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
