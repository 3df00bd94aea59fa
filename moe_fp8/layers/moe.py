"""``FP8MoE``: a drop-in MoE block (router + routed FP8 experts + optional shared experts)."""

from __future__ import annotations

import torch
from torch import nn

from ..quant.recipes import Float8Recipe, get_recipe
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
        backend, fmt, cache_weights: see :class:`FP8GroupedExperts` (``backend`` and ``cache_weights``
            only for the routed experts this layer builds, when ``experts`` is ``None``).
        return_router_output: make ``forward`` return ``(out, RouterOutput)`` (logits, aux loss,
            expert load, ...) instead of ``out``. Required when the router config has an aux or
            z-loss coefficient (the loss would be computed and dropped otherwise: ``ValueError``).
        experts: the routed experts, or ``None`` to build an :class:`FP8GroupedExperts` of
            ``num_experts`` experts. A module called as ``experts(tokens (T, H), topk_ids (T, k),
            topk_weights (T, k), input_scales=...) -> (T, H)`` with global expert ids in
            ``[0, num_experts)``, with ``recipe`` and ``reset_parameters()``; an ``FP8GroupedExperts``
            must match the sizes, expert count (``global_num_experts``) and recipe (else
            ``ValueError``). Expert parallelism passes its sharded experts here:
            ``moe_fp8.parallel.expert_parallel_moe`` builds such a layer, ``expert_parallel_from``
            shards a full one.

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
        cache_weights: bool = False,
        return_router_output: bool = False,
        experts: nn.Module | None = None,
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
        if experts is not None:
            _check_experts(experts, num_experts, hidden_size, expert_hidden_size, get_recipe(recipe))
        kw = dict(device=device, dtype=dtype)
        self.hidden_size = hidden_size
        self.return_router_output = return_router_output
        self.router = Router(hidden_size, router_config, **kw)
        self.experts = experts if experts is not None else FP8GroupedExperts(
            num_experts, hidden_size, expert_hidden_size, recipe=recipe, backend=backend, fmt=fmt,
            cache_weights=cache_weights, **kw)
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


def _check_experts(experts: nn.Module, num_experts: int, hidden_size: int, expert_hidden_size: int,
                   recipe: Float8Recipe) -> None:
    """Raise ``TypeError`` / ``ValueError`` when the given routed experts cannot serve this layer."""
    if not isinstance(experts, nn.Module):
        raise TypeError(f"experts: expected an nn.Module or None, got {type(experts).__name__}")
    if not isinstance(experts, FP8GroupedExperts):
        return
    for what, got, want in (
        ("global_num_experts", experts.global_num_experts, num_experts),
        ("hidden_size", experts.hidden_size, hidden_size),
        ("expert_hidden_size", experts.expert_hidden_size, expert_hidden_size),
        ("recipe", experts.recipe, recipe),
    ):
        if got != want:
            raise ValueError(f"experts: its {what} is {got!r}, this layer's is {want!r}")
