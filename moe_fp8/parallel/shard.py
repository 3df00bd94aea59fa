"""Build an expert-parallel ``FP8MoE`` from a full single-process one (the experts sliced per rank)."""

from __future__ import annotations

import copy

from ..layers.moe import FP8MoE
from .experts import ExpertParallelExperts

__all__ = ["expert_parallel_from"]


def expert_parallel_from(moe: FP8MoE, group=None, dispatch: str = "bf16", checkpoint: bool = False,
                         sync_free: bool = False) -> FP8MoE:
    """A copy of ``moe`` whose routed experts are this rank's shard over ``group``.

    The router and the shared experts are copied whole (replicated: each rank routes and runs them
    on its own tokens); the routed experts become an :class:`ExpertParallelExperts` holding experts
    ``[r * E / W, (r + 1) * E / W)`` of ``moe`` (rank ``r`` of ``W``), copied. ``moe`` is unchanged
    and its full experts are never copied whole. Call it on every rank with the same ``moe`` state.
    ``dispatch``, ``checkpoint``, ``sync_free``: see :class:`ExpertParallelExperts`.
    """
    if not isinstance(moe, FP8MoE):
        raise TypeError(f"moe: expected an FP8MoE, got {type(moe).__name__}")
    if isinstance(moe.experts, ExpertParallelExperts):
        raise ValueError("moe: its experts are already expert-parallel")
    experts = moe.experts
    moe._modules["experts"] = None  # deep-copy the rest only
    try:
        ep = copy.deepcopy(moe)
    finally:
        moe._modules["experts"] = experts
    ep.experts = ExpertParallelExperts.from_full(experts, group, dispatch, checkpoint, sync_free)
    return ep
