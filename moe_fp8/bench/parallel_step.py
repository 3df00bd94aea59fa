"""The whole-model training step of a parallelized model: what FSDP2, expert parallelism,
activation checkpointing and per-block ``torch.compile`` cost and save, on one GPU or on W.

``python -m moe_fp8.bench.parallel_step [--model dsv3] [--out benchmarks/results]`` (one GPU, NCCL
world size 1), or ``torchrun --standalone --nproc-per-node W -m moe_fp8.bench.parallel_step --ep E``
(W GPUs, a ``(W / E, E)`` mesh of ``("dp_shard", "ep")``: weak scaling, every rank its own 8 x 1024
tokens). The model (``moe_fp8.bench.models``: DeepSeek-V3 layer sizes by default, ``--layers``
decoder layers) is converted by ``hf.convert`` with its defaults (``--recipes fp8``) or with the
library's BF16 grouped experts and BF16 linears (``bf16``, the baseline that expert parallelism can
shard); variants: ``single`` (not parallelized; world size 1 only), ``fsdp`` (``parallelize``),
``fsdp+ac`` (activation checkpointing of every decoder block), ``fsdp+compile`` and
``fsdp+ac+compile`` (each block compiled with ``fullgraph=True``). A step: forward, backward, AdamW.
Median step time over the last ``timed`` of ``steps`` steps (the slowest rank's), tokens/s per GPU,
peak memory (``max_memory_allocated``, the largest rank's), and rank 0's losses of the first steps
(same weights, same batches: the variants must agree). ``--quick``: the CPU stand-in models on
gloo ranks, a few short steps, to check the script. ``--weak-scaling`` runs nothing: it tabulates
the reports of ``--out`` (one GPU and W GPUs) as tokens/s per GPU over one GPU's
(``parallel_step_<model>_weak_scaling.md``).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from ..parallel import parallelize
from . import models
from .ranks import init_ranks, max_over_ranks
from .report import run_env, write_report

VARIANTS = ("single", "fsdp", "fsdp+ac", "fsdp+compile", "fsdp+ac+compile")
RECIPES = {"fp8": "ours_fp8", "bf16": "ours_bf16"}


def run_variant(base: torch.nn.Module, recipe: str, variant: str, batches: list[torch.Tensor], steps: int, timed: int,
                mesh_shape: tuple[int, int], dispatch: str) -> dict:
    """Train a converted copy of ``base`` in ``variant``; step times, peak memory, losses."""
    torch._dynamo.reset()
    cuda = batches[0].is_cuda
    model = models.convert(base, RECIPES[recipe], None if cuda else "emulated", size_rules=cuda)
    if variant != "single":
        mesh = init_device_mesh(batches[0].device.type, mesh_shape, mesh_dim_names=("dp_shard", "ep"))
        parallelize(model, mesh, dispatch=dispatch if recipe == "fp8" else "bf16", activation_checkpoint="ac" in variant,
                    compile="compile" in variant)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(steps):
        batch = batches[i % len(batches)]
        t0 = time.perf_counter()
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # syncs
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    del model, opt
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    step_ms = max_over_ranks(statistics.median(times[-timed:]) * 1e3, batches[0].device)
    return dict(recipe=recipe, variant=variant, step_ms=step_ms, peak_gib=max_over_ranks(peak, batches[0].device),
                tokens_per_s_per_gpu=batches[0][:, 1:].numel() / (step_ms / 1e3),
                losses=[round(v, 4) for v in losses[:3]])


def weak_scaling(out: str | Path, model: str) -> list[dict]:
    """Rows of tokens/s per GPU on W GPUs over one GPU's, per (recipe, variant), from the reports in
    ``out`` (``parallel_step_<model>_gpu.json`` and every ``parallel_step_<model>_w<W>_ep<E>.json`` of
    the same layers, tokens per rank and dispatch); the one-GPU reference of a variant is its own row
    there."""
    out = Path(out)
    one = out / f"parallel_step_{model}_gpu.json"
    if not one.exists():
        raise FileNotFoundError(f"{one}: the one-GPU run (python -m moe_fp8.bench.parallel_step) is missing")
    one = json.loads(one.read_text())
    ref = {(r["recipe"], r["variant"]): r["tokens_per_s_per_gpu"] for r in one["rows"]}
    same = ("layers", "tokens_per_rank", "dispatch")
    rows = []
    for path in out.glob(f"parallel_step_{model}_w*_ep*.json"):
        report = json.loads(path.read_text())
        if any(report["env"].get(k) != one["env"].get(k) for k in same):  # another model size or batch
            continue
        world, ep = report["env"]["world_size"], report["env"]["ep"]
        for r in report["rows"]:
            base = ref.get((r["recipe"], r["variant"]))
            if base:
                rows.append(dict(recipe=r["recipe"], variant=r["variant"], world_size=world, ep=ep,
                                 tokens_per_s_per_gpu=r["tokens_per_s_per_gpu"],
                                 efficiency=r["tokens_per_s_per_gpu"] / base))
    if not rows:
        raise FileNotFoundError(f"{out}: no parallel_step_{model}_w<W>_ep<E>.json with a variant, layers, tokens "
                                "per rank and dispatch of the one-GPU run")
    return sorted(rows, key=lambda r: (r["recipe"], r["variant"], r["world_size"], r["ep"]))


def _write_weak_scaling(out: str, model: str) -> None:
    rows = weak_scaling(out, model)
    body = ["| recipe | variant | GPUs | ep | tokens/s per GPU | per GPU vs one GPU |", "|---|---|---:|---:|---:|---:|"]
    body += [f"| {r['recipe']} | {r['variant']} | {r['world_size']} | {r['ep']} | {r['tokens_per_s_per_gpu']:,.0f} | "
             f"{r['efficiency']:.0%} |" for r in rows]
    body += ["", "Target: >= 85% per GPU from 1 to 8 GPUs with the FP8 recipe (every rank its own tokens)."]
    write_report(out, f"parallel_step_{model}_weak_scaling", run_env("cuda" if torch.cuda.is_available() else "cpu"),
                 rows, f"Weak scaling of the parallelized training step ({model})",
                 "tokens/s per GPU over the same variant's on one GPU, from the reports in this folder", body)
    print("\n".join(body))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dsv3", choices=sorted(models.MODELS))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's own)")
    ap.add_argument("--recipes", nargs="+", default=["fp8"], choices=sorted(RECIPES))
    ap.add_argument("--variants", nargs="+", default=None, choices=VARIANTS,
                    help="default: all at world size 1, all but single on more ranks")
    ap.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: the world size)")
    ap.add_argument("--dispatch", default="bf16", choices=("bf16", "fp8"), help="of the fp8 recipe (bf16: always bf16)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--timed", type=int, default=6)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", "--smoke", action="store_true", help="CPU stand-in models, few short steps")
    ap.add_argument("--weak-scaling", action="store_true",
                    help="run nothing: tabulate the reports in --out against the one-GPU run")
    args = ap.parse_args()
    if args.weak_scaling:
        _write_weak_scaling(args.out, args.model)
        return
    rank, world, device, close = init_ranks()
    ep = world if args.ep is None else args.ep
    if ep < 1 or world % ep:
        raise SystemExit(f"--ep: expected a divisor of the world size {world}, got {ep}")
    variants = args.variants or [v for v in VARIANTS if world == 1 or v != "single"]
    if world > 1 and "single" in variants:
        raise SystemExit("variant single: world size 1 only")
    steps, timed, (batch, seq) = (3, 2, (2, 32)) if args.quick else (args.steps, args.timed, (8, 1024))
    try:
        spec = models._spec(args.model, device.type, args.layers)
        base = models.build(spec, seq, device.type)
        gen = torch.Generator(device=device).manual_seed(1 + rank)
        batches = [torch.randint(0, models.VOCAB, (batch, seq + 1), device=device, generator=gen) for _ in range(4)]
        rows = []
        for recipe in args.recipes:
            for variant in variants:
                if args.quick and "compile" in variant:
                    continue
                row = run_variant(base, recipe, variant, batches, steps, timed, (world // ep, ep), args.dispatch)
                rows.append(row)
                if rank == 0:
                    print(f"{recipe:5s} {variant:18s} {row['step_ms']:8.1f} ms  peak {row['peak_gib']:6.2f} GiB  "
                          f"losses {row['losses']}", flush=True)
    finally:
        close()
    if rank != 0:
        return
    env = run_env(device.type, model=args.model, layers=spec.layers, tokens_per_rank=f"{batch} x {seq}",
                  world_size=world, ep=ep, dispatch=args.dispatch)
    body = ["| recipe | variant | step ms | tokens/s per GPU | peak GiB | first losses (rank 0) |",
            "|---|---|---:|---:|---:|---|"]
    body += [f"| {r['recipe']} | {r['variant']} | {r['step_ms']:.1f} | {r['tokens_per_s_per_gpu']:,.0f} | "
             f"{r['peak_gib']:.2f} | {r['losses']} |" for r in rows]
    stem = f"parallel_step_{args.model}_gpu" if world == 1 else f"parallel_step_{args.model}_w{world}_ep{ep}"
    write_report(args.out, stem, env, rows, f"Parallelized training step, {world} rank(s), ep {ep} ({args.model})",
                 f"median of the last {timed} of {steps} steps (slowest rank), {args.dispatch} dispatch", body)


if __name__ == "__main__":
    main()
