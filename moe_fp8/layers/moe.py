"""``FP8MoE``: a drop-in MoE block (router + routed FP8 experts + optional shared experts)."""

from __future__ import annotations

import torch
from torch import nn

from ..routing import Router, RouterConfig, RouterOutput
from .experts import FP8GroupedExperts
from .mlp import SwiGLUMLP
from .param_checks import check_parameters

__all__ = ["FP8MoE"]


class FP8MoE(nn.Module):
    """Mixture-of-Experts block whose expert matmuls run in FP8.

    ``out = sum_j w_j * expert_{e_j}(x) [+ shared(x)]`` with SwiGLU experts; the router decides
    ``e_j`` and ``w_j`` (see ``moe_fp8.routing.RouterConfig`` and its presets ``mixtral()``,
    ``qwen3_moe()``, ``deepseek_moe_16b()``, ``deepseek_v3()``, ``llama4()``).

    Args:
        hidden_size: ``H`` (multiple of 16).
        expert_hidden_size: ``I`` of each routed expert (multiple of 16).
        num_experts: routed experts ``E``.
        top_k: experts per token.
        router_config: routing semantics; default: softmax top-k with renormalisation (Mixtral /
            Qwen3-MoE). Its ``num_experts`` and ``top_k`` must match.
        shared_expert_hidden_size: intermediate size of the shared SwiGLU expert(s) (DeepSeek:
            ``n_shared * I``; Llama 4: ``I``); 0 for none.
        recipe: ``"rowwise"``, ``"rowwise_gw_hp"``, ``"tensorwise"``, ``"blockwise"`` or ``"bf16"``
            (the exact BF16 baseline of the same module).
        backend, fmt, cache_weights: see :class:`FP8GroupedExperts`.
        return_router_output: make ``forward`` return ``(out, RouterOutput)`` (logits, aux loss,
            expert load, ...) instead of ``out``. Required when the router config has an aux or
            z-loss coefficient (the loss would be computed and dropped otherwise: ``ValueError``).
        ep_group: a ``torch.distributed`` process group for expert parallelism, or ``None`` (all
            experts local). With a group of ``W`` ranks each rank holds ``E / W`` experts
            (:class:`moe_fp8.parallel.ExpertParallelExperts`; ``E`` must be a multiple of ``W``),
            routes its own tokens and exchanges their rows by all-to-all; every rank must call
            ``forward``. ``moe_fp8.parallel.expert_parallel_from`` shards a full layer instead.
        dispatch: with ``ep_group``, ``"bf16"`` or ``"fp8"`` rows on the wire (see ``docs/expert-parallel.md``);
            ``moe.experts.sync_free = True`` switches to the sync-free dispatch.

    ``forward(x (..., H)) -> (..., H)`` in ``x``'s dtype (or the autocast dtype). Parameters still
    on the meta device (build there, then ``to_empty`` and load or ``reset_parameters``), or on
    another device than ``x``, raise ``ValueError``.
    """

    def __init__(
        self,
        hidden_size: int,
        expert_hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        router_config: RouterConfig | None = None,
        shared_expert_hidden_size: int = 0,
        recipe="rowwise",
        backend: str | None = None,
        fmt=None,
        cache_weights: bool = True,
        return_router_output: bool = False,
        ep_group=None,
        dispatch: str = "bf16",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if router_config is None:
            router_config = RouterConfig(num_experts, top_k, "softmax", renormalize=True)
        if (router_config.num_experts, router_config.top_k) != (num_experts, top_k):
            raise ValueError(
                f"router_config: expected num_experts={num_experts}, top_k={top_k}, "
                f"got {router_config.num_experts}, {router_config.top_k}"
            )
        if not return_router_output and (router_config.aux_loss_coef > 0 or router_config.z_loss_coef > 0):
            raise ValueError(
                "return_router_output: must be True when router_config has aux_loss_coef or z_loss_coef > 0 "
                "(the loss is returned in RouterOutput.aux_loss; without it the loss would be dropped)"
            )
        if ep_group is None and dispatch != "bf16":
            raise ValueError(f"dispatch: {dispatch!r} needs an ep_group (without one no rows travel)")
        kw = dict(device=device, dtype=dtype)
        self.hidden_size = hidden_size
        self.return_router_output = return_router_output
        self.router = Router(hidden_size, router_config, **kw)
        experts_kw = dict(recipe=recipe, backend=backend, fmt=fmt, cache_weights=cache_weights, **kw)
        if ep_group is None:
            self.experts = FP8GroupedExperts(num_experts, hidden_size, expert_hidden_size, **experts_kw)
        else:
            from ..parallel import ExpertParallelExperts  # noqa: PLC0415  (parallel imports this package)

            self.experts = ExpertParallelExperts(num_experts, hidden_size, expert_hidden_size, group=ep_group,
                                                 dispatch=dispatch, **experts_kw)
        self.shared_experts = (
            SwiGLUMLP(hidden_size, shared_expert_hidden_size, recipe=recipe, fmt=fmt, **kw)
            if shared_expert_hidden_size
            else None
        )

    @property
    def recipe(self):
        return self.experts.recipe

    def reset_parameters(self) -> None:
        """Initialise every parameter (after ``to_empty`` from the meta device, say)."""
        self.router.reset_parameters()
        self.experts.reset_parameters()
        if self.shared_experts is not None:
            for m in self.shared_experts.modules():
                if isinstance(m, nn.Linear):
                    m.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, RouterOutput]:
        shape = x.shape
        if not shape or shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected last dim {self.hidden_size}, got shape {tuple(shape)}")
        check_parameters(self, x)
        tokens = x.reshape(-1, self.hidden_size)
        r = self.router(tokens)
        out = self.experts(tokens, r.topk_ids, r.topk_weights, input_scales=r.input_scales)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        out = out.reshape(shape[:-1] + (out.shape[-1],))
        return (out, r) if self.return_router_output else out
