"""Expert parallelism on ``torch.distributed`` (NCCL on GPUs, gloo on CPU): each rank of an
expert-parallel group owns ``E / W`` experts; token rows travel by ``all_to_all_single`` in BF16 or
as FP8 bytes + row scales. See ``docs/expert-parallel.md``.

Typical use (every rank, same seed or loaded state)::

    moe = expert_parallel_moe(H, I, E, k, group=group, dispatch="fp8")  # local experts only
    ep = expert_parallel_from(full_moe, group, dispatch="bf16")         # or: shard a full layer
    shard_experts(hf.convert(model), group, dispatch="fp8")             # or: a converted model, in place
    parallelize(model, mesh, dispatch="fp8")                            # or: FSDP2 + EP on a DeviceMesh
"""

from .destinations import destination_plan, destination_ranks
from .exchange import RowsAllToAll, Splits, all_to_all_rows, exchange_counts
from .experts import DISPATCH_MODES, ExpertParallelExperts
from .fsdp import MESH_DIMS, ParallelLayout, parallelize
from .moe import expert_parallel_moe
from .shard import expert_parallel_from, shard_experts
from .wire import dispatch_bytes_per_row

__all__ = [
    "DISPATCH_MODES",
    "ExpertParallelExperts",
    "MESH_DIMS",
    "ParallelLayout",
    "RowsAllToAll",
    "Splits",
    "all_to_all_rows",
    "destination_plan",
    "destination_ranks",
    "dispatch_bytes_per_row",
    "exchange_counts",
    "parallelize",
    "expert_parallel_from",
    "expert_parallel_moe",
    "shard_experts",
]
