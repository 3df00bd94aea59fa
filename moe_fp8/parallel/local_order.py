"""The on-device re-permutation between the order rows arrive in and the order the experts take.

Received rows arrive grouped by source rank, then by local expert (each source sends its rows
expert-sorted); the grouped GEMMs need them grouped by local expert, then by source rank (so each
expert's rows are the same rows, in the same order, as in one process holding every token). Both
orders and the map between them are computed on the device from the received counts: no host
sync, and the gathers are plain ``index_select`` (deterministic; no atomics either way).
"""

from __future__ import annotations

import torch

__all__ = ["ExpertOrder", "ReorderRows", "expert_major_order"]


class ExpertOrder:
    """Maps between source-major rows and expert-major rows of one rank's received tokens.

    Attributes:
        to_expert: ``(R,)`` int64: expert-major row ``i`` is source-major row ``to_expert[i]``.
        to_source: ``(R,)`` int64: the inverse permutation.
        offsets: ``(E_l,)`` int32 cumulative END offsets of the local experts' groups (expert-major).
    """

    def __init__(self, to_expert: torch.Tensor, to_source: torch.Tensor, offsets: torch.Tensor) -> None:
        self.to_expert, self.to_source, self.offsets = to_expert, to_source, offsets


def expert_major_order(recv_counts: torch.Tensor, num_rows: int) -> ExpertOrder:
    """The :class:`ExpertOrder` of ``num_rows`` received rows with ``recv_counts (W, E_l)`` int
    (rows from source ``s`` for local expert ``e``; ``num_rows`` its sum, known on the host)."""
    world, local = recv_counts.shape
    counts = recv_counts.long()
    src_start = (counts.reshape(-1).cumsum(0) - counts.reshape(-1)).view(world, local)
    by_expert = counts.t().reshape(-1)
    dst_start = (by_expert.cumsum(0) - by_expert).view(local, world).t()
    rows = torch.arange(num_rows, device=counts.device)
    to_source = _moved(rows, counts.reshape(-1), src_start.reshape(-1), dst_start.reshape(-1))
    to_expert = _moved(rows, by_expert, dst_start.t().reshape(-1), src_start.t().reshape(-1))
    offsets = counts.sum(0).cumsum(0).to(torch.int32)
    return ExpertOrder(to_expert, to_source, offsets)


def _moved(rows: torch.Tensor, counts: torch.Tensor, start: torch.Tensor, other_start: torch.Tensor) -> torch.Tensor:
    """For rows laid out in chunks of ``counts`` starting at ``start``, each row's index in the other
    layout, where the same chunks start at ``other_start`` (chunk of a row by ``repeat_interleave``
    with a static ``output_size``: no sync)."""
    chunk = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts,
                                    output_size=rows.numel())
    return rows - start[chunk] + other_start[chunk]


class ReorderRows(torch.autograd.Function):
    """``apply(x, index, inverse)`` = ``x[index]``; backward ``grad[inverse]`` (``index`` a permutation)."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None
