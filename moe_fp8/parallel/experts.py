"""``ExpertParallelExperts``: routed FP8 experts sharded over an expert-parallel process group.

Forward on each rank, for its own tokens ``x (T, H)`` routed to global experts ``topk_ids (T, k)``:

1. the destination plan: one row per (token, rank owning one of its experts), grouped by rank
   (``destinations.destination_plan``), and the permute of the token rows into it (fused with the
   rowwise FP8 quantization for FP8 dispatch);
2. one ``all_to_all_single`` of the ``(W,)`` row counts and ONE device-to-host copy of the split
   sizes (the only host sync; kept on the autograd nodes for the return and the backward), waited
   for only once the send buffers are queued, so the device is busy while the host waits;
3. ``all_to_all_single`` of the token rows (BF16, or FP8 bytes as uint8), of their ``k`` expert ids
   (int32) and of their fp32 router weights / input scales / FP8 row scales;
4. on the receiving rank, the single-process experts on the received tokens: a dispatch plan over
   the ``E_l`` local experts (other ids dropped), the grouped GEMMs, and the combine of each token's
   local experts (router weights in fp32): one partial output row per received token;
5. the reverse all-to-all of the partial rows, and their sum per token on the source rank (the
   destination plan's combine: fp32, rank order, deterministic, no atomics).

The backward of each exchange is the reverse exchange with the splits swapped: no host sync.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from ..layers.experts import FP8GroupedExperts
from ..quant import formats
from ..routing import DispatchPlan, combine, make_dispatch_plan, permute, permute_quantize, permute_stand_in
from .destinations import destination_plan, every_rank_plan
from .exchange import RowsAllToAll, Splits, all_to_all_rows, exchange_counts
from .fp8_rows import FP8RowsAllToAll

__all__ = ["DISPATCH_MODES", "ExpertParallelExperts"]

DISPATCH_MODES = ("bf16", "fp8")


class ExpertParallelExperts(FP8GroupedExperts):
    """The local ``E / W`` experts of one rank of an expert-parallel group of ``W`` ranks.

    Rank ``r`` (its rank in ``group``) owns global experts ``[r * E_l, (r + 1) * E_l)``, ``E_l = E / W``;
    its parameters hold those experts only (``gate_up_proj (E_l, 2I, H)``, ``down_proj (E_l, H, I)``).

    Args:
        num_experts: ``E``, the global expert count (a multiple of the group size).
        hidden_size, expert_hidden_size, recipe, backend, fmt, cache_weights, device, dtype: as
            :class:`FP8GroupedExperts` (built with ``E_l`` experts).
        group: the expert-parallel ``torch.distributed`` process group (``None``: the default group).
        dispatch: ``"bf16"`` (token rows sent in the GEMM dtype, quantized after receipt) or
            ``"fp8"``: each token row quantized once on its source rank (fused with the permute),
            sent as FP8 bytes + its fp32 scale, and fed to the grouped GEMM as received; no BF16
            row travels, in training either: the first GEMM saves the FP8 rows and its weight
            gradient reads them dequantized (``fp8_saved_input``, set by this mode). Only for
            recipes with row scales and without input scales.
        A token visits each rank owning one of its experts once (one row per token and rank), and
        that rank returns the sum of its experts' outputs for it (rounded to the GEMM dtype): with
        one rank, or when a token's experts share a rank, the result is the single process's bit
        for bit; otherwise it differs by that rounding of the per-rank partial sums.
        checkpoint: recompute the local experts' grouped GEMMs, SwiGLU and combine in backward instead
            of keeping their activations (non-reentrant ``torch.utils.checkpoint`` around
            :meth:`grouped_mlp`; the received rows are kept). The recompute runs no collective and
            no host sync, and routes nothing again; checkpointing the whole layer instead repeats
            the routing, the exchanges and the host copy in backward. A plain attribute, settable.
        sync_free: static shapes, no host sync: every token is sent to every rank (``T`` rows to
            each, whether or not it has an expert there; those rows come back as zeros), so no
            count exchange or split sizes are needed and the forward can be captured in a CUDA
            graph. Every rank must then pass the same ``T``. Same results, bit for bit, as the
            default; costs ``W * T`` received rows per rank on the wire and in memory, and local
            experts' activations sized for ``W * T * k`` rows. A plain attribute, settable.

    ``weight_grad_scale`` (a plain attribute, default 1) multiplies the gradients of the expert
    weights. With 1 an expert's gradient is the SUM over the group's ranks of their losses'
    contributions (every token routed to it lands here); data-parallel training that averages the
    other parameters' gradients over the ranks sets ``1 / W`` (``moe_fp8.parallel.parallelize`` does).
    """

    def __init__(self, num_experts: int, hidden_size: int, expert_hidden_size: int, *, group=None,
                 dispatch: str = "bf16", checkpoint: bool = False, sync_free: bool = False, **kw) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: expert parallelism needs an initialised torch.distributed process group")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if rank < 0:
            raise ValueError("group: this process is not a member of the expert-parallel group")
        if not isinstance(num_experts, int) or num_experts < 1 or num_experts % world:
            raise ValueError(f"num_experts: expected a positive multiple of the expert-parallel group size {world}, "
                             f"got {num_experts!r}")
        if dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch: expected one of {DISPATCH_MODES}, got {dispatch!r}")
        super().__init__(num_experts // world, hidden_size, expert_hidden_size, **kw)
        if dispatch == "fp8" and self.recipe.scaling != "rowwise":
            hint = (" (hf.convert runs experts below its min_expert_size on the bf16 recipe: use dispatch='bf16', "
                    "or convert with min_expert_size=0)") if self.recipe.name == "bf16" else ""
            raise ValueError(f"dispatch: 'fp8' needs a recipe with row scales (rowwise, rowwise_gw_hp), "
                             f"got recipe {self.recipe.name!r}{hint}")
        if dispatch == "fp8":  # the FP8 rows are all that arrives: the first GEMM saves them
            self.fp8_saved_input = True
        self.group, self.dispatch, self.checkpoint, self.sync_free = group, dispatch, checkpoint, sync_free
        self.weight_grad_scale = 1.0
        self.ep_size, self.ep_rank = world, rank
        self.global_num_experts = num_experts
        # one source rank or one local expert: the rows arrive expert-major already
        self._reorder = world > 1 and self.num_experts > 1

    @classmethod
    def from_full(cls, experts: FP8GroupedExperts, group=None, dispatch: str = "bf16",
                  checkpoint: bool = False, sync_free: bool = False) -> ExpertParallelExperts:
        """The shard of this rank of the single-process ``experts`` (its parameters sliced and
        copied; same recipe, backend, format, layout and caching)."""
        if not isinstance(experts, FP8GroupedExperts) or isinstance(experts, ExpertParallelExperts):
            raise TypeError(f"experts: expected an FP8GroupedExperts, got {type(experts).__name__}")
        w1 = experts.gate_up_proj
        shard = cls(experts.num_experts, experts.hidden_size, experts.expert_hidden_size, group=group,
                    dispatch=dispatch, checkpoint=checkpoint, sync_free=sync_free, recipe=experts.recipe,
                    backend=experts.backend, fmt=experts.fmt, in_out_layout=experts.in_out_layout,
                    cache_weights=experts.cache_weights, fp8_saved_input=experts.fp8_saved_input,
                    device="meta", dtype=w1.dtype)
        shard.to_empty(device=w1.device)
        lo, hi = shard.ep_rank * shard.num_experts, (shard.ep_rank + 1) * shard.num_experts
        with torch.no_grad():
            shard.gate_up_proj.copy_(experts.gate_up_proj[lo:hi])
            shard.down_proj.copy_(experts.down_proj[lo:hi])
        return shard

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor | None,
                *, input_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Routed experts output of this rank's tokens; same arguments and result as
        :meth:`FP8GroupedExperts.forward`, with ``top_k_index`` GLOBAL expert ids (``[0, E)``; others
        are dropped). Every rank of the group must call it (collectives), also with ``T = 0``, and
        with the same ``top_k_weights`` / ``input_scales`` presence."""
        x, out_dtype = self.gemm_input(hidden_states, top_k_index, input_scales)
        fp8 = self.dispatch == "fp8"
        if fp8 and input_scales is not None:
            raise ValueError("input_scales: dispatch='fp8' quantizes each token once on its source rank, but input "
                             "scales (Llama 4) scale each routed row before its quantization; use dispatch='bf16'")
        T = top_k_index.shape[0]
        if self.sync_free:  # static sizes: every token to every rank, T rows each way per pair of ranks
            route, pending = every_rank_plan(T, self.ep_size, x.device), None
        else:
            route = destination_plan(top_k_index, self.num_experts, self.ep_size)
            pending = exchange_counts(route.counts, self.group)
        # the send buffers need no split sizes: queued before the host waits for them
        ids = top_k_index.to(torch.int32).index_select(0, route.row_to_pair.long().clamp(min=0) // route.top_k)
        rows = q = row_scale = None
        if fp8:
            q, row_scale = permute_quantize(x, route, formats.resolve_format(self.fmt, x.device),
                                            pow2=self.recipe.pow2_scales)
        else:
            rows = permute(x, route)
        cols = [t.float() for t in (top_k_weights, input_scales) if t is not None]
        floats = permute(torch.cat(cols, 1), route) if cols else None  # differentiable: their gradients go home
        if row_scale is not None:
            floats = row_scale[:, None] if floats is None else torch.cat([floats, row_scale[:, None]], 1)
        splits = Splits([T] * self.ep_size, [T] * self.ep_size) if pending is None else pending.wait()

        send, recv, group = splits.send, splits.recv, self.group
        ids = all_to_all_rows(ids, send, recv, group) - self.ep_rank * self.num_experts
        if rows is not None:
            rows = RowsAllToAll.apply(rows, send, recv, group)
        if q is not None:  # rows: a stand-in for the received FP8 rows, the input gradient's way home
            rows, q = FP8RowsAllToAll.apply(x, q, route, send, recv, group)
        weights = scales = None
        if floats is not None:  # router weights, input scales (each k columns), FP8 row scale
            floats = RowsAllToAll.apply(floats, send, recv, group)
            k = top_k_index.shape[1]
            weights = floats[:, :k] if top_k_weights is not None else None
            scales = floats[:, -k:] if input_scales is not None else None
            row_scale = floats[:, -1].detach().contiguous() if q is not None else None
        partial = self._local_experts(rows, ids, weights, scales, (q, row_scale) if q is not None else None)
        back = RowsAllToAll.apply(partial, recv, send, group, route.num_rows)
        return combine(back, route, None).to(out_dtype)

    def _local_experts(self, rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None,
                       scales: torch.Tensor | None, fp8_rows: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """``(R, H)``: each received token's output summed over this rank's experts, as one process
        computes it (``FP8GroupedExperts.forward`` on the received tokens), from the BF16 token rows
        ``rows (R, H)`` as received, or their FP8 ``(q (R, H), scale (R,))`` as received with ``rows``
        a stand-in that carries the gradient (:class:`FP8RowsAllToAll`)."""
        # as in one process: an expert without tokens keeps a zero row for its weight gradient
        plan = make_dispatch_plan(ids, self.num_experts, empty_group_rows=True)
        if fp8_rows is None:
            x_perm, x_fp8 = self.permuted_rows(rows, plan, scales, stand_in=self.fp8_saved_input)
        else:  # each expert row is its token's FP8 row: the same bytes and scale as quantizing after receipt
            x_fp8 = _expert_fp8_rows(*fp8_rows, plan)
            x_perm = permute_stand_in(rows, plan)
        if self.checkpoint and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self.grouped_mlp, x_perm, plan, weights, x_fp8,
                                                     self.fp8_saved_input, use_reentrant=False)
        return self.grouped_mlp(x_perm, plan, weights, x_fp8, self.fp8_saved_input)

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        w1, w2 = super()._weights()
        if self.weight_grad_scale == 1.0:
            return w1, w2
        return _ScaleGrad.apply(w1, self.weight_grad_scale), _ScaleGrad.apply(w2, self.weight_grad_scale)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, global_experts={self.global_num_experts}, ep_rank={self.ep_rank}, "
                f"ep_size={self.ep_size}, dispatch={self.dispatch}, checkpoint={self.checkpoint}, "
                f"sync_free={self.sync_free}")


def _expert_fp8_rows(q: torch.Tensor, scale: torch.Tensor, plan: DispatchPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert row's FP8 token row, ``(q (M, H), scale (M,))`` in ``plan``'s row layout, from the
    received token rows ``q (R, H)`` fp8 and their ``scale (R,)`` fp32; the plan's padding rows
    (an empty expert's zero row among them) get zero bytes and scale 1."""
    rows, pad = plan.row_to_pair.shape[0], plan.pad_rows.long()
    if q.shape[0] == 0:  # nothing received (a host-known count): the padding rows alone
        return torch.zeros(rows, q.shape[1], dtype=torch.uint8, device=q.device).view(q.dtype), scale.new_ones(rows)
    token = plan.row_to_pair.long().clamp(min=0) // plan.top_k
    q_rows = q.view(torch.uint8).index_select(0, token).index_fill_(0, pad, 0).view(q.dtype)
    return q_rows, scale.index_select(0, token).index_fill_(0, pad, 1.0)


class _ScaleGrad(torch.autograd.Function):
    """``apply(w, scale)``: a view of ``w`` (so a weight cache keyed on its base still hits) whose
    gradient is ``scale`` times the incoming one."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None
