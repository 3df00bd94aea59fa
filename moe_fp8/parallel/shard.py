"""Expert-parallel layers and models from full single-process ones (the experts sliced per rank):
``expert_parallel_from`` copies an ``FP8MoE``; ``shard_experts`` shards a whole model in place."""

from __future__ import annotations

import copy

from torch import nn

from ..layers.experts import FP8GroupedExperts
from ..layers.moe import FP8MoE
from .experts import ExpertParallelExperts

__all__ = ["expert_parallel_from", "grouped_experts_of", "shard_experts"]


def grouped_experts_of(model: nn.Module) -> list[tuple[nn.Module, str, FP8GroupedExperts]]:
    """``(parent, attribute, experts)`` of every ``FP8GroupedExperts`` of the single-process ``model``.
    Raises ``ValueError`` when ``model`` is one itself, or holds expert-parallel ones."""
    if isinstance(model, FP8GroupedExperts):
        raise ValueError("model: an FP8GroupedExperts itself; use ExpertParallelExperts.from_full")
    found = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, FP8GroupedExperts)]
    if any(isinstance(child, ExpertParallelExperts) for _, _, child in found):
        raise ValueError("model: its experts are already expert-parallel")
    return found


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


def shard_experts(model: nn.Module, group=None, dispatch: str = "bf16", checkpoint: bool = False,
                  sync_free: bool = False) -> nn.Module:
    """Shard every ``FP8GroupedExperts`` of ``model`` over ``group``, in place; return ``model``.

    Each becomes this rank's :class:`ExpertParallelExperts` (experts ``[r * E / W, (r + 1) * E / W)``,
    parameters copied; the full experts are dropped). Everything else (routers, shared experts,
    attention, embeddings) stays as it is: replicated, each rank running it on its own tokens. For a
    Hugging Face model converted by ``moe_fp8.hf.convert`` (every supported family and layout: the
    converted blocks call their experts with global expert ids) and for models built from
    ``FP8MoE`` / ``FP8GroupedExperts``. Call it on every rank with the same model state, before
    building the optimizer (the expert parameters are new tensors); every rank must then run every
    forward. ``dispatch``, ``checkpoint``, ``sync_free``: see :class:`ExpertParallelExperts`.
    Raises ``ValueError`` when ``model`` holds no ``FP8GroupedExperts``, or expert-parallel ones.
    """
    found = grouped_experts_of(model)
    if not found:
        raise ValueError("model: no FP8GroupedExperts found (convert a Hugging Face model with moe_fp8.hf.convert "
                         "first)")
    for parent, name, child in found:
        setattr(parent, name, ExpertParallelExperts.from_full(child, group, dispatch, checkpoint, sync_free))
    return model
