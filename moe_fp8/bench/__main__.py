"""``python -m moe_fp8.bench [--preset dsv3|llama4|qwen3|all] [--quick] [--kinds quant gemm ...]``.

Runs the preset's benchmarks (quantization kernels, grouped GEMM, MoE layer, dense MLP, end-to-end
training step), prints a table per kind and writes ``bench_<preset>[_quick].json``, ``.md`` and
``_speedups.png`` to ``--out`` (default ``benchmarks/results``). TorchAO's counterparts run beside
ours where ``torchao`` imports. Without CUDA every kind runs tiny shapes on the CPU (Triton kernels
in the interpreter, FP8 GEMMs emulated): that checks the code paths, its times mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import triton

from . import presets, report
from .balanced_routing import ROUTINGS


def _collect(kind: str, args: dict, device: str, gemm_methods: list[str] | None) -> tuple[list[dict], dict]:
    if kind == "quant":
        from . import quant

        return quant.collect(args["models"], device)
    if kind == "gemm":
        from . import grouped_gemm

        return grouped_gemm.collect(args["shapes"], device, methods=gemm_methods), {}
    if kind == "layer":
        from . import layer

        return layer.collect(args["layers"], args["tokens"], device), {}
    if kind == "dense":
        from . import dense

        return dense.collect(device), {}
    if kind == "dense_sweep":
        from . import dense_sweep

        return dense_sweep.collect(device), {}
    if kind == "model":
        from . import models

        return models.collect(device, models=args.get("models"), modes=args.get("modes"),
                              loss_steps=args.get("steps"), variants=args.get("variants"),
                              accumulate=args.get("accumulate") or 1, layers=args.get("layers"),
                              profile=bool(args.get("profile")), router_aux_loss=args.get("router_aux_loss"),
                              routing=args.get("routing") or "learned"), {}
    from . import train

    return train.collect(device, steps=args.get("steps")), {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_fp8.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=list(presets.PRESETS), default="dsv3")
    ap.add_argument("--quick", action="store_true", help="the first shape of each kind only")
    ap.add_argument("--kinds", nargs="+", choices=presets.KINDS, help="kinds to run (default: the preset's; a kind the preset lacks runs with the shapes of --preset all)")
    ap.add_argument("--gemm-methods", nargs="+", default=presets.GEMM_METHODS,
                    help="grouped-GEMM method labels ('all': every recipe and backend)")
    ap.add_argument("--models", nargs="+", help="whole-model kind: models to run (default: all but llama4_scout)")
    ap.add_argument("--modes", nargs="+", help="whole-model kind: eager, compiled, reduce-overhead (default: all)")
    ap.add_argument("--steps", type=int, help="whole-model kind: eager steps trained for the loss (default 150)")
    ap.add_argument("--variants", nargs="+", help="whole-model kind: variants to run (default: each mode's)")
    ap.add_argument("--accumulate", type=int, default=1,
                    help="whole-model kind: micro-batches of 8 x 1024 tokens per optimizer step (default 1)")
    ap.add_argument("--layers", type=int, help="whole-model kind: decoder layers of every model (default: each model's)")
    ap.add_argument("--router-aux-loss", type=float, metavar="COEF",
                    help="whole-model kind: the Qwen3-MoE models' load-balancing loss coefficient, added to "
                         "the loss (default 0: none; Qwen3-30B-A3B's released config has 0.001)")
    ap.add_argument("--routing", choices=ROUTINGS, default="learned",
                    help="whole-model kind: the MoE routers score the hidden states (learned, default) or random "
                         "inputs (balanced: a trained router's even load; an untrained model routes most tokens to "
                         "a few experts)")
    ap.add_argument("--profile", action="store_true",
                    help="whole-model kind: one more step per row profiled (device time by kernel category) and, "
                         "on CUDA, the allocations alive at its peak memory")
    ap.add_argument("--name", help="result file stem (default bench_<preset>[_quick])")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # the kernels were defined at import, before the interpreter could be asked for: start again
        argv = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, "-m", "moe_fp8.bench", *argv],
                  dict(os.environ, TRITON_INTERPRET="1"))
    plan = presets.plan(args.preset, args.kinds, args.quick)
    if "model" in plan:
        plan["model"] = dict(plan["model"], models=args.models, modes=args.modes, steps=args.steps,
                             variants=args.variants, accumulate=args.accumulate, layers=args.layers,
                             profile=args.profile, router_aux_loss=args.router_aux_loss, routing=args.routing)
    gemm_methods = None if device == "cpu" or args.gemm_methods == ["all"] else args.gemm_methods
    name = args.name or f"bench_{args.preset}" + ("_quick" if args.quick else "")
    start = time.time()
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                gpu=torch.cuda.get_device_name() if device == "cuda" else "CPU (interpreter; times mean nothing)",
                torch=torch.__version__, triton=triton.__version__, torchao=_torchao_version(),
                args=" ".join(argv if argv is not None else sys.argv[1:]), seconds=0.0)
    results: dict[str, list[dict]] = {}
    bar = _bar(len(plan))
    for kind, kind_args in plan.items():
        if bar is not None:
            bar.set_description(f"{args.preset}: {kind}")
        rows, extra = _collect(kind, kind_args, device, gemm_methods)
        results[kind] = rows
        meta.update({k: v for k, v in extra.items() if v is not None})
        meta["seconds"] = time.time() - start
        paths = report.write(args.out, name, meta, results)  # after every kind: a cut-short run keeps the rest
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    for kind, rows in results.items():
        print(f"\n{report.TITLES[kind]}\n{report.table(kind, rows)}")
    print(f"\nwrote {', '.join(str(p) for p in paths)} in {meta['seconds']:.0f} s")
    return 0


def _torchao_version() -> str | None:
    try:
        import torchao
    except Exception:  # noqa: BLE001 - not installed, or not importable with this torch
        return None
    return torchao.__version__


def _bar(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="kind", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
