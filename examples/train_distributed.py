"""Distributed training of an MoE language model with FP8 expert matmuls: FSDP2 + expert parallelism
on a DeviceMesh (``moe_fp8.parallel.parallelize``), gradient accumulation, DCP checkpoints that
resume on any mesh layout.

    torchrun --standalone --nproc-per-node 4 examples/train_distributed.py --cpu --mesh dp_shard=2,ep=2
    torchrun --standalone --nproc-per-node 8 examples/train_distributed.py --mesh dp_replicate=2,dp_shard=2,ep=2
    torchrun --standalone --nproc-per-node 8 examples/train_distributed.py --model deepseek_v3 --dispatch fp8

    # save after step 2, then resume from it on another layout
    torchrun --standalone --nproc-per-node 4 examples/train_distributed.py --cpu --mesh dp_shard=2,ep=2 \\
        --steps 4 --save ckpt --save-at 2
    torchrun --standalone --nproc-per-node 4 examples/train_distributed.py --cpu --mesh dp_shard=4,ep=1 \\
        --steps 4 --resume ckpt

``--cpu``: gloo on CPU tensors, tiny sizes, the ``emulated`` grouped-GEMM backend; otherwise NCCL,
one GPU per rank, BF16 compute (FSDP mixed precision over FP32 weights), the default backend.
Every rank is a data-parallel rank: it builds the same model from one seed, takes its slice of each
global batch and the mean loss over it. The data are synthetic token streams, each sequence a walk
through one fixed random permutation of the vocabulary (a next token that one token predicts).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from moe_fp8 import hf
from moe_fp8.parallel import MESH_DIMS, checkpoint, parallelize
from moe_fp8.quant.recipes import RECIPES
from moe_fp8.routing import RouterConfig
from moe_fp8.testing import TinyMoELM, lm_loss

STEP_FILE = "train_step.json"


class Sizes(NamedTuple):
    vocab: int
    hidden: int
    expert_hidden: int
    layers: int
    experts: int
    top_k: int
    seq: int
    batch: int  # sequences per global micro-batch


CPU_SIZES = Sizes(vocab=64, hidden=32, expert_hidden=32, layers=2, experts=8, top_k=2, seq=16, batch=8)
GPU_SIZES = Sizes(vocab=32768, hidden=2048, expert_hidden=1024, layers=4, experts=16, top_k=4, seq=2048, batch=32)


def parse_mesh(spec: str) -> dict[str, int]:
    """``"dp_shard=2,ep=2"`` -> ``{"dp_shard": 2, "ep": 2}`` in ``MESH_DIMS`` order (``dp_shard``
    and ``ep`` default to 1)."""
    sizes = {}
    for part in spec.split(","):
        name, _, size = part.partition("=")
        if name not in MESH_DIMS or name in sizes or not size.isdigit() or int(size) < 1:
            raise ValueError(f"--mesh {spec}: expected NAME=SIZE pairs, names among {MESH_DIMS}")
        sizes[name] = int(size)
    return {d: sizes.get(d, 1) for d in MESH_DIMS if d in sizes or d != "dp_replicate"}


def hf_model(family: str, s: Sizes, recipe: str, backend: str | None) -> nn.Module:
    import transformers  # noqa: PLC0415  (optional dependency: pip install -e '.[hf]')

    heads = max(2, s.hidden // 128)
    head_dim = s.hidden // heads
    common = dict(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=2 * s.hidden,
                  moe_intermediate_size=s.expert_hidden, num_hidden_layers=s.layers, num_attention_heads=heads,
                  num_key_value_heads=heads, num_experts_per_tok=s.top_k, tie_word_embeddings=False)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(num_experts=s.experts, norm_topk_prob=True, head_dim=head_dim, **common)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.DeepseekV3Config(n_routed_experts=s.experts, n_group=2, topk_group=1, n_shared_experts=1,
                                            first_k_dense_replace=1, q_lora_rank=s.hidden // 2,
                                            kv_lora_rank=s.hidden // 2, qk_rope_head_dim=head_dim // 2,
                                            qk_nope_head_dim=head_dim // 2, v_head_dim=head_dim, rope_scaling=None,
                                            **common)
        model = transformers.DeepseekV3ForCausalLM(cfg)
    return hf.convert(model, recipe=recipe, backend=backend, min_expert_size=0, min_fp8_wgrad_size=0, min_dense_size=0)


def build_model(name: str, s: Sizes, recipe: str, backend: str | None, device: torch.device) -> nn.Module:
    """The single-process model, the same on every rank (one seed)."""
    torch.manual_seed(0)
    with device:
        if name == "tiny":
            router = RouterConfig(s.experts, s.top_k, "softmax", renormalize=True)
            return TinyMoELM(s.vocab, s.hidden, s.expert_hidden, s.layers, router=router, recipe=recipe,
                             backend=backend)
        return hf_model(name, s, recipe, backend)


def global_batch(step: int, s: Sizes, accumulate: int, seed: int) -> torch.Tensor:
    """``(accumulate, batch, seq)`` token ids of ``step``, the same on every rank and in every run."""
    perm = torch.randperm(s.vocab, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed + step)
    ids = torch.empty(accumulate, s.batch, s.seq, dtype=torch.long)
    ids[..., 0] = torch.randint(0, s.vocab, (accumulate, s.batch), generator=gen)
    for t in range(1, s.seq):
        ids[..., t] = perm[ids[..., t - 1]]
    return ids


def logits_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU tensors, tiny sizes")
    ap.add_argument("--mesh", help="dim sizes, e.g. dp_shard=2,ep=2 or dp_replicate=2,dp_shard=2,ep=2; their "
                                   "product is the world size (default: dp_shard=WORLD,ep=1)")
    ap.add_argument("--model", choices=("tiny", "deepseek_v3", "qwen3_moe"), default="tiny")
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="rowwise")
    ap.add_argument("--dispatch", choices=("bf16", "fp8"), default="bf16", help="token exchange between ep ranks")
    ap.add_argument("--activation-checkpoint", action="store_true", help="recompute each block in backward")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block (sync-free dispatch at ep > 1)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--lr", type=float, help="AdamW's (default: 3e-3 with --cpu, else 3e-4)")
    ap.add_argument("--seed", type=int, default=1, help="of the data")
    ap.add_argument("--save", metavar="DIR", help="save a DCP checkpoint (model + optimizer) to DIR")
    ap.add_argument("--save-at", type=int, metavar="K", help="... after step K (default: the last)")
    ap.add_argument("--resume", metavar="DIR", help="load DIR (saved on any layout) and continue after its step")
    args = ap.parse_args()
    if "WORLD_SIZE" not in os.environ:
        ap.error("run under torchrun (see the launch commands in the module docstring)")
    world = int(os.environ["WORLD_SIZE"])
    try:
        mesh_sizes = parse_mesh(args.mesh or f"dp_shard={world}")
    except ValueError as e:
        ap.error(str(e))
    if math.prod(mesh_sizes.values()) != world:
        ap.error(f"--mesh {args.mesh}: its sizes multiply to {math.prod(mesh_sizes.values())}, "
                 f"but torchrun started {world} ranks")
    if args.save_at is not None and not (args.save and 1 <= args.save_at <= args.steps):
        ap.error(f"--save-at {args.save_at}: needs --save and a step in 1..{args.steps}")
    sizes = CPU_SIZES if args.cpu else GPU_SIZES
    if sizes.batch % world:
        ap.error(f"the global batch of {sizes.batch} sequences does not split over {world} ranks")

    if args.cpu:
        device, backend = torch.device("cpu"), "emulated"
    else:
        device, backend = torch.device("cuda", int(os.environ["LOCAL_RANK"])), None
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if args.cpu else "nccl")
    rank = dist.get_rank()
    mesh = init_device_mesh(device.type, tuple(mesh_sizes.values()), mesh_dim_names=tuple(mesh_sizes))
    ep = mesh_sizes["ep"]
    mp_policy = None if args.cpu else MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = parallelize(build_model(args.model, sizes, args.recipe, backend, device), mesh, dispatch=args.dispatch,
                        sync_free=args.compile and ep > 1, activation_checkpoint=args.activation_checkpoint,
                        compile=args.compile, mp_policy=mp_policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr or (3e-3 if args.cpu else 3e-4))

    first = 1
    if args.resume:
        checkpoint.load(args.resume, model, optimizer)
        with open(os.path.join(args.resume, STEP_FILE)) as f:
            first = json.load(f)["step"] + 1
    save_at = args.save_at or args.steps
    if rank == 0:
        print(f"{args.model} ({args.recipe}) on mesh {mesh_sizes}, {args.dispatch} dispatch, "
              f"{sizes.experts // ep} experts per ep rank, steps {first}..{args.steps}")

    rows = slice(rank * sizes.batch // world, (rank + 1) * sizes.batch // world)
    tokens, seconds = 0, 0.0
    for step in range(first, args.steps + 1):
        began = time.perf_counter()
        micro_batches = global_batch(step, sizes, args.accumulate, args.seed)[:, rows].to(device)
        total = torch.zeros((), device=device)
        for a, ids in enumerate(micro_batches):
            model.set_requires_gradient_sync(a == args.accumulate - 1)  # reduce once, at the last micro-batch
            loss = lm_loss(logits_of(model, ids), ids) / args.accumulate
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        mean = total.item() / world  # the mean loss over the global batch (waits for the step)
        if step > first:  # the first step (compile, warm-up) is not timed
            tokens += args.accumulate * sizes.batch * sizes.seq
            seconds += time.perf_counter() - began
        if rank == 0:
            print(f"step {step} loss {mean:.4f}", flush=True)
        if args.save and step == save_at:
            checkpoint.save(args.save, model, optimizer)
            if rank == 0:
                with open(os.path.join(args.save, STEP_FILE), "w") as f:
                    json.dump({"step": step}, f)
                print(f"saved {args.save} after step {step}")
    if rank == 0 and tokens:
        print(f"{tokens / seconds:.0f} tokens/s (global, steps after the first)")
    # what holds the process groups (the model's FSDP and expert-parallel state, the mesh) is freed
    # before they are destroyed, while the interpreter is whole: a gloo group whose last reference
    # goes at interpreter exit can abort the process after its work is done
    del model, optimizer, mesh
    gc.collect()
    dist.barrier()  # no rank closes its connections while another still receives its last messages
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
