"""The whole-model training step of a parallelized model at world size 1: what FSDP2, activation
checkpointing and per-block ``torch.compile`` cost and save on one GPU.

``python -m moe_fp8.bench.parallel_step [--model dsv3] [--out benchmarks/results]`` (one GPU, NCCL).
The model (``moe_fp8.bench.models``: DeepSeek-V3 layer sizes by default, 8 x 1024 tokens) is
converted by ``hf.convert`` with its defaults; variants: ``single`` (not parallelized),
``fsdp`` (``parallelize`` on a 1 x 1 mesh), ``fsdp+ac`` (activation checkpointing of every decoder
block), ``fsdp+compile`` and ``fsdp+ac+compile`` (each block compiled with ``fullgraph=True``).
A step: forward, backward, AdamW. Median step time over the last ``timed`` of ``steps`` steps,
peak memory (``max_memory_allocated``), and the losses of the first steps (same weights, same
batches: the variants must agree).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from ..parallel import parallelize
from . import models
from .report import run_env, write_report

VARIANTS = ("single", "fsdp", "fsdp+ac", "fsdp+compile", "fsdp+ac+compile")


def run_variant(base: torch.nn.Module, variant: str, batches: list[torch.Tensor], steps: int, timed: int) -> dict:
    """Train a converted copy of ``base`` in ``variant``; step times, peak memory, losses."""
    torch._dynamo.reset()
    model = models.convert(base, "ours_fp8", None)
    if variant != "single":
        mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("dp_shard", "ep"))
        parallelize(model, mesh, activation_checkpoint="ac" in variant, compile="compile" in variant)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
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
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return dict(variant=variant, step_ms=statistics.median(times[-timed:]) * 1e3, peak_gib=peak,
                losses=[round(v, 4) for v in losses[:3]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dsv3", choices=sorted(models.MODELS))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--timed", type=int, default=6)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 'pg')}", rank=0, world_size=1)
        torch.cuda.set_device(0)
        spec = models.MODELS[args.model]
        base = models.build(spec, 1024, "cuda")
        gen = torch.Generator(device="cuda").manual_seed(1)
        batches = [torch.randint(0, models.VOCAB, (8, 1025), device="cuda", generator=gen) for _ in range(4)]
        rows = []
        for variant in args.variants:
            row = run_variant(base, variant, batches, args.steps, args.timed)
            rows.append(row)
            print(f"{variant:18s} {row['step_ms']:8.1f} ms  peak {row['peak_gib']:6.2f} GiB  losses {row['losses']}",
                  flush=True)
        dist.destroy_process_group()
    env = run_env("cuda", model=args.model, tokens="8 x 1024")
    body = ["| variant | step ms | peak GiB | first losses |", "|---|---:|---:|---|"]
    body += [f"| {r['variant']} | {r['step_ms']:.1f} | {r['peak_gib']:.2f} | {r['losses']} |" for r in rows]
    write_report(args.out, f"parallel_step_{args.model}_gpu", env, rows,
                 f"Parallelized training step at world size 1 ({args.model})",
                 f"median of the last {args.timed} of {args.steps} steps, NCCL world size 1", body)


if __name__ == "__main__":
    main()
