"""Process groups of the benchmark scripts: the ranks ``torchrun`` started (one GPU each, NCCL; gloo
on CPU), or this process alone as a group of one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist


def init_ranks() -> tuple[int, int, torch.device, Callable[[], None]]:
    """``(rank, world size, device, close)``: joins the group ``torchrun`` describes in the
    environment, else makes one of world size 1; ``close()`` destroys it."""
    cuda = torch.cuda.is_available()
    launched = "WORLD_SIZE" in os.environ
    local = int(os.environ.get("LOCAL_RANK", 0)) if launched else 0
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    kw = {"device_id": device} if cuda else {}
    if cuda:
        torch.cuda.set_device(device)
    tmp = None
    if launched:
        dist.init_process_group("nccl" if cuda else "gloo", **kw)
    else:
        tmp = tempfile.TemporaryDirectory()
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{os.path.join(tmp.name, 'pg')}",
                                rank=0, world_size=1, **kw)

    def close() -> None:
        dist.destroy_process_group()
        if tmp is not None:
            tmp.cleanup()

    return dist.get_rank(), dist.get_world_size(), device, close


def max_over_ranks(value: float, device: torch.device) -> float:
    """``value``'s maximum over the ranks of the default group."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
