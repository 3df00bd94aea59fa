"""FP8 token rows on the wire, with the input gradient's way home but no BF16 rows."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..routing import DispatchPlan, combine
from .exchange import all_to_all_rows

__all__ = ["FP8RowsAllToAll"]


class FP8RowsAllToAll(torch.autograd.Function):
    """``apply(x, q, route, send, recv, group) -> (stand_in, q_recv)``.

    ``q`` holds the FP8 token rows in the destination plan ``route``'s row order (the rowwise
    quantization of ``x (T, H)``, from ``permute_quantize(x, route)``); its first ``sum(send)`` rows
    go to their ranks as uint8 bytes and arrive as ``q_recv (R, H)`` (non-differentiable). The
    ``stand_in`` ``(R, H)`` in ``x``'s dtype holds no values (zero stride): the received rows'
    gradient flows into it, and the backward sends that gradient home (splits swapped) and sums
    each token's rows (the destination plan's combine) into ``x``'s gradient.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, q: torch.Tensor, route: DispatchPlan, send: list[int], recv: list[int],
                group: dist.ProcessGroup):
        ctx.route, ctx.send, ctx.recv, ctx.group = route, send, recv, group
        q_recv = all_to_all_rows(q.view(torch.uint8), send, recv, group).view(q.dtype)
        ctx.mark_non_differentiable(q_recv)
        ctx.set_materialize_grads(False)  # no zero gradient made for q_recv
        stand_in = x.new_empty(()).expand(q_recv.shape[0], x.shape[1])  # never read: no fill
        ctx.stand_in = (stand_in.shape, stand_in.dtype, stand_in.device)
        return stand_in, q_recv

    @staticmethod
    def backward(ctx, grad, _grad_q):
        if grad is None:  # no gradient reached the rows: zeros travel, so every rank enters the exchange
            shape, dtype, device = ctx.stand_in
            grad = torch.zeros(shape, dtype=dtype, device=device)
        rows = all_to_all_rows(grad.contiguous(), ctx.recv, ctx.send, ctx.group, ctx.route.num_rows)
        rows[sum(ctx.send):].zero_()
        return combine(rows, ctx.route, None), None, None, None, None, None
