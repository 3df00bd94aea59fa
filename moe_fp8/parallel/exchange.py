"""The collectives of expert parallelism: the count exchange, the one host copy of the split sizes,
and the differentiable row all-to-all (``torch.distributed.all_to_all_single``).

Every rank enters every collective in the same order, with zero rows too (``all_to_all_single``
takes empty tensors and all-zero splits on gloo and NCCL).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

__all__ = ["Splits", "RowsAllToAll", "all_to_all_rows", "exchange_counts"]


class Splits(NamedTuple):
    """Rows this rank sends to and receives from each rank, as host ints (from the one D2H copy).

    Attributes:
        send: ``ep_size`` rows sent to each rank (its destination's experts, in rank order).
        recv: ``ep_size`` rows received from each rank.
    """

    send: list[int]
    recv: list[int]

    @property
    def num_send(self) -> int:
        return sum(self.send)

    @property
    def num_recv(self) -> int:
        return sum(self.recv)


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, Splits]:
    """Send each rank the counts of its experts; copy the split sizes to the host once.

    Args:
        counts: ``(E,)`` int32 rows this rank routes to each global expert (the dispatch plan's
            ``counts``); rank ``d`` owns experts ``[d * E_l, (d + 1) * E_l)``.
        group: the expert-parallel process group (``W`` ranks, ``E = W * E_l``).
    Returns:
        ``recv_counts`` ``(W, E_l)`` int32 on ``counts``' device (rows from source ``s`` for local
        expert ``e``), and the :class:`Splits` read by ONE device-to-host copy: the only host sync
        of a layer forward.
    """
    world = dist.get_world_size(group)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    recv_counts = recv_counts.view(world, -1)
    sums = torch.cat([counts.view(world, -1).sum(1), recv_counts.sum(1)])
    host = sums.cpu().tolist()  # the one host sync: the split sizes the row all-to-alls need
    return recv_counts, Splits(host[:world], host[world:])


def all_to_all_rows(rows: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """``rows (sum(send), ...)`` -> ``(sum(recv), ...)``: block ``d`` of ``rows`` goes to rank ``d``;
    block ``s`` of the result came from rank ``s`` (not differentiable; see :class:`RowsAllToAll`)."""
    out = rows.new_empty((sum(recv),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class RowsAllToAll(torch.autograd.Function):
    """``apply(rows, send, recv, group)``: :func:`all_to_all_rows` whose backward is the reverse
    exchange (the gradient of the received rows goes back with the splits swapped)."""

    @staticmethod
    def forward(ctx, rows, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return all_to_all_rows(rows, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_rows(grad, ctx.recv, ctx.send, ctx.group), None, None, None
