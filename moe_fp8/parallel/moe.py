"""``expert_parallel_moe``: an ``FP8MoE`` built with its routed experts sharded over an expert-parallel group."""

from __future__ import annotations

from ..layers.moe import FP8MoE
from .experts import ExpertParallelExperts

__all__ = ["expert_parallel_moe"]


def expert_parallel_moe(hidden_size: int, expert_hidden_size: int, num_experts: int, top_k: int, *, group=None,
                        dispatch: str = "bf16", checkpoint: bool = False, sync_free: bool = False,
                        recipe="rowwise", backend: str | None = None, fmt=None, cache_weights: bool = False,
                        device=None, dtype=None, **moe_kwargs) -> FP8MoE:
    """An :class:`FP8MoE` whose routed experts are this rank's ``E / W`` over ``group`` (``W`` ranks).

    The routed experts are an :class:`ExpertParallelExperts` (rank ``r`` owns experts
    ``[r * E / W, (r + 1) * E / W)``, initialised on this rank; ``E`` must be a multiple of ``W``);
    the router and the shared experts are whole on every rank, which routes and runs them on its own
    tokens and exchanges their rows by all-to-all. Every rank must call ``forward``. Build it on every
    rank with the same seed (or load the same state) so that the replicated parts agree;
    :func:`expert_parallel_from` shards a full single-process layer instead.

    Args:
        hidden_size, expert_hidden_size, num_experts, top_k: as :class:`FP8MoE` (``num_experts`` is
            the global ``E``).
        group: the expert-parallel ``torch.distributed`` process group (``None``: the default group).
        dispatch, checkpoint, sync_free: see :class:`ExpertParallelExperts` (``"bf16"`` or ``"fp8"``
            rows on the wire; see ``docs/expert-parallel.md``).
        recipe, fmt, device, dtype: for the routed and the shared experts, as in :class:`FP8MoE`;
            backend, cache_weights: for the routed experts.
        moe_kwargs: the other keyword arguments of :class:`FP8MoE` (``router_config``,
            ``shared_expert_hidden_size``, ``return_router_output``).

    Raises ``ValueError`` without an initialised process group, for an ``E`` that ``W`` does not
    divide, or a ``dispatch`` the recipe cannot send.
    """
    experts = ExpertParallelExperts(num_experts, hidden_size, expert_hidden_size, group=group, dispatch=dispatch,
                                    checkpoint=checkpoint, sync_free=sync_free, recipe=recipe, backend=backend,
                                    fmt=fmt, cache_weights=cache_weights, device=device, dtype=dtype)
    return FP8MoE(hidden_size, expert_hidden_size, num_experts, top_k, recipe=recipe, fmt=fmt, experts=experts,
                  device=device, dtype=dtype, **moe_kwargs)
