"""Expert-parallel FP8MoE training steps, one process per GPU (or per CPU process on gloo).

    torchrun --standalone --nproc-per-node 8 examples/expert_parallel.py            # GPUs, NCCL
    torchrun --standalone --nproc-per-node 2 examples/expert_parallel.py --cpu      # CPU, gloo

Each rank builds the same full layer (same seed) and keeps its shard of the experts; every rank
routes its own tokens. The replicated parameters' gradients (router, shared expert) are averaged
over the ranks as data parallelism would; each expert's gradient is complete on its owner.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from moe_fp8 import FP8MoE
from moe_fp8.parallel import expert_parallel_from


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU tensors, tiny shapes")
    ap.add_argument("--dispatch", choices=("bf16", "fp8"), default="fp8")
    ap.add_argument("--sync-free", action="store_true", help="static sizes: no host wait, every token to every rank")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    dist.init_process_group("gloo" if args.cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.cpu:
        device, (H, I, E, K, T) = "cpu", (64, 32, 2 * world, 2, 16)
    else:
        device, (H, I, E, K, T) = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}", (2048, 768, 8 * world, 8, 4096)
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same full layer on every rank
    full = FP8MoE(H, I, E, K, shared_expert_hidden_size=I, device=device, dtype=torch.bfloat16)
    moe = expert_parallel_from(full, dist.group.WORLD, dispatch=args.dispatch, sync_free=args.sync_free)
    del full
    opt = torch.optim.AdamW(moe.parameters(), lr=1e-4)
    replicated = [p for n, p in moe.named_parameters() if not n.startswith("experts.")]
    torch.manual_seed(1 + rank)  # each rank its own tokens
    for step in range(args.steps):
        x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
        loss = moe(x).float().pow(2).mean()
        loss.backward()
        for p in replicated:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step}: loss {loss.item():.5f} (rank 0's tokens), {E // world} experts per rank")
    dist.barrier()  # no rank closes its connections while another still receives its last messages
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
