"""Where a rank's tokens go: one row per (token, destination rank), not per (token, expert).

A token routed to ``k`` experts visits each rank owning one of them ONCE: the rank receives the
token row with its ``k`` expert ids (and weights) and runs its own experts on it, then returns ONE
row, the token's output summed over that rank's experts. The token-to-rank map is itself a
routing: each token has up to ``C = min(k, W)`` distinct destination ranks, listed in increasing
rank order, so :func:`~moe_fp8.routing.make_dispatch_plan` over ``W`` "experts" (the ranks) gives
the send order (rows grouped by destination rank, tokens in order within a rank) and the
:func:`~moe_fp8.routing.combine` of the returned rows (deterministic, rank order, fp32).
"""

from __future__ import annotations

import torch

from ..routing import DispatchPlan, make_dispatch_plan

__all__ = ["destination_plan", "destination_ranks", "every_rank_plan"]


def destination_ranks(topk_ids: torch.Tensor, experts_per_rank: int, world: int) -> torch.Tensor:
    """``(T, min(k, W))`` int32: the distinct ranks owning each token's experts, in increasing order
    along the row, -1 in the columns left over (with ``W <= k`` column ``d`` holds rank ``d`` or -1).

    Args:
        topk_ids: ``(T, k)`` int32/int64 global expert ids; ids outside ``[0, W * experts_per_rank)``
            go nowhere.
        experts_per_rank: ``E_l`` (rank ``d`` owns experts ``[d * E_l, (d + 1) * E_l)``).
        world: ``W``, the expert-parallel group size.
    """
    T, k = topk_ids.shape
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < world * experts_per_rank)
    if world <= k:  # a (T, W) mask: column d holds d where some expert of the token is on rank d
        ranks = torch.arange(world, device=ids.device)
        there = ((ids.div(experts_per_rank, rounding_mode="floor")[:, :, None] == ranks) & valid[:, :, None]).any(1)
        return torch.where(there, ranks.to(torch.int32), -1).to(torch.int32)
    rank = torch.where(valid, ids.div(experts_per_rank, rounding_mode="floor"), world)  # W: nowhere
    if k > 1:  # distinct ranks first: sort, mark repeats as nowhere, sort again
        rank = rank.sort(dim=1).values
        repeated = torch.cat([rank.new_zeros(T, 1, dtype=torch.bool), rank[:, 1:] == rank[:, :-1]], 1)
        rank = torch.where(repeated, world, rank).sort(dim=1).values
    return torch.where(rank < world, rank, -1).to(torch.int32)


def destination_plan(topk_ids: torch.Tensor, experts_per_rank: int, world: int) -> DispatchPlan:
    """The :class:`~moe_fp8.routing.DispatchPlan` of this rank's tokens over the ``W`` ranks: its
    ``counts (W,)`` are the rows sent to each rank, its first ``counts.sum()`` rows the send
    buffer's (grouped by rank, tokens in order); ``top_k`` is ``min(k, W)``."""
    return make_dispatch_plan(destination_ranks(topk_ids, experts_per_rank, world), world)


def every_rank_plan(num_tokens: int, world: int, device: torch.device) -> DispatchPlan:
    """The static destination plan of the sync-free dispatch: every token to every rank (row
    ``d * T + t`` holds token ``t`` for rank ``d``; ``counts`` are ``T`` each, known on the host)."""
    ranks = torch.arange(world, dtype=torch.int32, device=device).expand(num_tokens, world)
    return make_dispatch_plan(ranks, world)
