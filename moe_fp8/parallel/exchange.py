"""The collectives of expert parallelism: the count exchange, the one host copy of the split sizes,
and the differentiable row all-to-all (``torch.distributed.all_to_all_single``).

Every rank enters every collective in the same order, with zero rows too (``all_to_all_single``
takes empty tensors and all-zero splits on gloo and NCCL).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

__all__ = ["PendingSplits", "Splits", "RowsAllToAll", "all_to_all_rows", "exchange_counts"]


class Splits(NamedTuple):
    """Rows this rank sends to and receives from each rank, as host ints (from the one D2H copy).

    Attributes:
        send: ``ep_size`` token rows sent to each rank (one per token with an expert there).
        recv: ``ep_size`` token rows received from each rank.
    """

    send: list[int]
    recv: list[int]


class PendingSplits:
    """The split sizes on their way to the host: :meth:`wait` blocks until they are there.

    Between the count exchange and :meth:`wait` the caller queues the device work that needs no
    split sizes (the permutes into the send buffers), so the device has work while the host waits
    and then catches up."""

    def __init__(self, sizes: torch.Tensor, world: int) -> None:
        self.world = world
        if sizes.is_cuda:
            self._host = torch.empty(sizes.shape, dtype=sizes.dtype, pin_memory=True)
            self._host.copy_(sizes, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = sizes, None

    def wait(self) -> Splits:
        """The :class:`Splits`; on a GPU the one host wait of a layer forward (an event of the copy)."""
        if self._ready is not None:
            self._ready.synchronize()
        host = self._host.tolist()
        return Splits(host[: self.world], host[self.world :])


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> PendingSplits:
    """Tell each rank how many rows it receives from this one, and start the copy of the split
    sizes to the host (the only host sync of a layer forward, at :meth:`PendingSplits.wait`).

    Args:
        counts: ``(W,)`` int32 rows this rank sends to each rank (the destination plan's ``counts``).
        group: the expert-parallel process group (``W`` ranks).
    """
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)
    return PendingSplits(torch.cat([counts, recv]), dist.get_world_size(group))


def all_to_all_rows(rows: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup,
                    out_rows: int = 0) -> torch.Tensor:
    """The first ``sum(send)`` rows of ``rows`` -> ``(max(sum(recv), out_rows), ...)``: block ``d`` of the
    sent rows goes to rank ``d``; block ``s`` of the result came from rank ``s``; result rows past
    ``sum(recv)`` are left unwritten (not differentiable; see :class:`RowsAllToAll`)."""
    n_recv = sum(recv)
    out = rows.new_empty((max(n_recv, out_rows),) + tuple(rows.shape[1:]))
    sent = rows[: sum(send)]
    dist.all_to_all_single(out[:n_recv], sent.contiguous(), output_split_sizes=recv, input_split_sizes=send,
                           group=group)
    return out


class RowsAllToAll(torch.autograd.Function):
    """``apply(rows, send, recv, group, out_rows=0)``: :func:`all_to_all_rows` whose backward is the
    reverse exchange (the gradient of the received rows goes back with the splits swapped; rows of
    ``rows`` past ``sum(send)`` get zero gradient)."""

    @staticmethod
    def forward(ctx, rows, send, recv, group, out_rows=0):
        ctx.send, ctx.recv, ctx.group, ctx.rows = send, recv, group, rows.shape[0]
        return all_to_all_rows(rows, send, recv, group, out_rows)

    @staticmethod
    def backward(ctx, grad):
        grad_rows = all_to_all_rows(grad, ctx.recv, ctx.send, ctx.group, ctx.rows)
        grad_rows[sum(ctx.send):].zero_()
        return grad_rows, None, None, None, None
