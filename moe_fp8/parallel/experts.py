"""``ExpertParallelExperts``: routed FP8 experts sharded over an expert-parallel process group.

Forward on each rank, for its own tokens ``x (T, H)`` routed to global experts ``topk_ids (T, k)``:

1. the dispatch plan over all ``E`` experts and the permute (+ fused rowwise FP8 quantization),
   exactly as in one process: rows end up sorted by expert, hence by destination rank;
2. one ``all_to_all_single`` of the ``(E,)`` counts and ONE device-to-host copy of the per-rank
   split sizes (the only host sync; kept on the autograd nodes for the combine and the backward);
3. ``all_to_all_single`` of the rows: BF16, or FP8 bytes (as uint8) + fp32 row scales;
4. on-device re-permutation from (source rank, expert) order to (expert, source rank) order
   (the identity, skipped, with one rank or one local expert);
5. the local experts' grouped GEMMs (``FP8GroupedExperts.grouped_mlp``);
6. the reverse re-permutation and all-to-all, then the combine on the source rank (router weights
   in fp32, deterministic, no atomics).

The backward of each exchange is the reverse exchange with the splits swapped: no host sync.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from ..checks import check_tensor
from ..layers.experts import FP8GroupedExperts
from ..layers.param_checks import check_parameters
from ..quant import formats
from ..routing import combine, make_dispatch_plan, permute_quantize
from .exchange import RowsAllToAll, Splits, all_to_all_rows, exchange_counts
from .local_order import ExpertOrder, ReorderRows, expert_major_order

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
        dispatch: ``"bf16"`` (rows sent in the GEMM dtype and quantized after receipt) or
            ``"fp8"``: each row quantized once on its source rank (fused with the permute), sent
            as FP8 bytes + its fp32 scale, and fed to the grouped GEMM as received. Only for recipes
            with row scales. While the expert weights need gradients the BF16 rows are sent too
            (the weight gradient of the first GEMM reads them): see ``docs/expert-parallel.md``.
        checkpoint: recompute the local experts' grouped GEMMs and SwiGLU in backward instead of
            keeping their activations (non-reentrant ``torch.utils.checkpoint`` around
            :meth:`grouped_mlp`; the received rows are kept). The recompute runs no collective and
            no host sync, and routes nothing again; checkpointing the whole layer instead repeats
            the routing, the exchanges and the host copy in backward. A plain attribute, settable.
    """

    def __init__(self, num_experts: int, hidden_size: int, expert_hidden_size: int, *, group=None,
                 dispatch: str = "bf16", checkpoint: bool = False, **kw) -> None:
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
            raise ValueError(f"dispatch: 'fp8' needs a recipe with row scales (rowwise, rowwise_gw_hp), "
                             f"got recipe {self.recipe.name!r}")
        self.group, self.dispatch, self.checkpoint = group, dispatch, checkpoint
        self.ep_size, self.ep_rank = world, rank
        self.global_num_experts = num_experts
        # one source rank or one local expert: the rows arrive expert-major already
        self._reorder = world > 1 and self.num_experts > 1

    @classmethod
    def from_full(cls, experts: FP8GroupedExperts, group=None, dispatch: str = "bf16",
                  checkpoint: bool = False) -> ExpertParallelExperts:
        """The shard of this rank of the single-process ``experts`` (its parameters sliced and
        copied; same recipe, backend, format, layout and caching)."""
        if not isinstance(experts, FP8GroupedExperts) or isinstance(experts, ExpertParallelExperts):
            raise TypeError(f"experts: expected an FP8GroupedExperts, got {type(experts).__name__}")
        w1 = experts.gate_up_proj
        shard = cls(experts.num_experts, experts.hidden_size, experts.expert_hidden_size, group=group,
                    dispatch=dispatch, checkpoint=checkpoint, recipe=experts.recipe, backend=experts.backend,
                    fmt=experts.fmt, in_out_layout=experts.in_out_layout, cache_weights=experts._caches is not None,
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
        are dropped). Every rank of the group must call it (collectives), also with ``T = 0``."""
        x, out_dtype = self.gemm_input(hidden_states, top_k_index, input_scales)
        plan = make_dispatch_plan(top_k_index, self.global_num_experts)
        fp8 = self.dispatch == "fp8"
        # BF16 rows travel in BF16 dispatch, and in FP8 dispatch while something needs a gradient
        # (the first GEMM's weight gradient reads them, and they carry the input gradient home)
        send_bf16 = not fp8 or (torch.is_grad_enabled() and _needs_grad(self, x, input_scales))
        if send_bf16 or input_scales is not None:
            x_perm, x_fp8 = self.permuted_rows(x, plan, input_scales, quantize=fp8)
        else:  # FP8 rows alone: the fused permute + quantize, no BF16 copy
            fmt = formats.resolve_format(self.fmt, x.device)
            x_perm, x_fp8 = None, permute_quantize(x, plan, fmt, pow2=self.recipe.pow2_scales)
        recv_counts, splits = exchange_counts(plan.counts, self.group)
        order = expert_major_order(recv_counts, splits.num_recv)
        rows_fp8 = None if x_fp8 is None else self._dispatch_fp8(x_fp8, splits, order)
        if send_bf16:
            rows = RowsAllToAll.apply(x_perm[: splits.num_send], splits.send, splits.recv, self.group)
            rows = ReorderRows.apply(rows, order.to_expert, order.to_source) if self._reorder else rows
        else:  # never read: fp8_grouped_mm reads x only for its backward when x_fp8 is given
            rows = x.new_empty(splits.num_recv, self.hidden_size)
        if self.checkpoint and torch.is_grad_enabled():
            y = torch.utils.checkpoint.checkpoint(self.grouped_mlp, rows, order.offsets, rows_fp8, use_reentrant=False)
        else:
            y = self.grouped_mlp(rows, order.offsets, rows_fp8)
        if self._reorder:
            y = ReorderRows.apply(y, order.to_source, order.to_expert)
        y = RowsAllToAll.apply(y, splits.recv, splits.send, self.group)
        y = _pad_rows(y, plan.num_rows)
        return combine(y, plan, top_k_weights).to(out_dtype)

    def _dispatch_fp8(self, x_fp8: tuple[torch.Tensor, torch.Tensor], splits: Splits, order: ExpertOrder):
        """The received FP8 rows ``(q (R, H) fp8, scale (R,) fp32)`` in expert-major order, from the
        source rows ``x_fp8`` (plan order): the FP8 bytes travel as uint8, the scales as fp32."""
        n, send, recv, group = splits.num_send, splits.send, splits.recv, self.group
        q, scale = x_fp8
        q_recv = all_to_all_rows(q[:n].view(torch.uint8), send, recv, group)
        s_recv = all_to_all_rows(scale[:n], send, recv, group)
        if self._reorder:
            q_recv, s_recv = q_recv.index_select(0, order.to_expert), s_recv.index_select(0, order.to_expert)
        return q_recv.view(q.dtype), s_recv

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, global_experts={self.global_num_experts}, ep_rank={self.ep_rank}, "
                f"ep_size={self.ep_size}, dispatch={self.dispatch}, checkpoint={self.checkpoint}")


def _needs_grad(experts: ExpertParallelExperts, x: torch.Tensor, input_scales: torch.Tensor | None) -> bool:
    return (x.requires_grad or (input_scales is not None and input_scales.requires_grad)
            or any(p.requires_grad for p in experts.parameters()))


def _pad_rows(y: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``y`` with zero rows appended up to ``num_rows`` (the plan's rows past the routed ones: pairs
    with dropped ids; never read by the combine)."""
    return y if y.shape[0] == num_rows else torch.cat([y, y.new_zeros(num_rows - y.shape[0], y.shape[1])])
