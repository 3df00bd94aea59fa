"""Replacement MoE blocks for Hugging Face models whose block forward cannot be kept.

* transformers 4.x blocks keep their experts in an ``nn.ModuleList`` and loop over them inside the
  block's forward: :class:`FP8HFMoEBlock` replaces the whole block, keeps its gate module (and
  shared experts), routes with the same semantics and returns what the original returned.
* Llama 4 runs every expert on every token with the router score folded into the input:
  :class:`FP8Llama4TextMoe` keeps the original ``router`` and ``shared_expert`` modules and routes
  top-k tokens through :class:`FP8GroupedExperts` instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..routing import RouterConfig, route
from .experts import FP8GroupedExperts

__all__ = ["FP8HFMoEBlock", "FP8Llama4TextMoe"]


class FP8HFMoEBlock(nn.Module):
    """A transformers-4.x MoE block (Mixtral, Qwen3-MoE, DeepSeek-V3) on FP8 grouped experts.

    Args:
        gate: the original gate module; its ``weight`` ``(E, H)`` gives the router logits
            (its forward is not called: 4.x gates differ in what they return).
        experts: the routed experts, weights stacked from the original ``ModuleList``.
        router_config: routing semantics of the family.
        shared_experts: the original shared-experts module, or ``None``.
        returns_logits: return ``(hidden_states, router_logits)`` (Mixtral, Qwen3-MoE) instead of
            ``hidden_states`` (DeepSeek-V3).
        logits_fp32: compute the logits in fp32 (DeepSeek-V3's gate) instead of the input dtype.
    """

    def __init__(self, gate: nn.Module, experts: FP8GroupedExperts, router_config: RouterConfig, *,
                 shared_experts: nn.Module | None = None, returns_logits: bool = True,
                 logits_fp32: bool = False) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.shared_experts = shared_experts
        self.router_config = router_config
        self.returns_logits = returns_logits
        self.logits_fp32 = logits_fp32

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weight = self.gate.weight
        if self.logits_fp32:
            logits = F.linear(x.float(), weight.float())
        else:
            logits = F.linear(x, weight.to(x.dtype))
        bias = getattr(self.gate, "e_score_correction_bias", None) if self.router_config.use_correction_bias else None
        r = route(logits, self.router_config, bias)
        weights = r.topk_weights if self.logits_fp32 else r.topk_weights.to(x.dtype)
        out = self.experts(x, r.topk_ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        out = out.reshape(shape)
        return (out, logits) if self.returns_logits else out


class FP8Llama4TextMoe(nn.Module):
    """Llama 4's MoE block: sigmoid top-k router score scales the expert INPUT, plus a shared expert.

    Keeps the original ``router`` and ``shared_expert`` modules; ``experts`` shares the original
    fused weights (in/out layout). Two router layouts, each returning what its block returned:

    * transformers >= 4.54: ``router`` is a ``Llama4Router`` returning ``(scores, logits)``, both
      ``(T, E)``; the block returns ``(out (T, H), logits (T, E))``.
    * transformers 4.51-4.53 (``linear_router=True``): ``router`` is a plain ``nn.Linear`` returning
      the logits ``(T, E)``; the block picks the top-k itself and returns ``(out (T, H), scores
      (E, T))``, the scores being ``sigmoid`` of the top-k logits (0 for the other experts) in the
      input dtype.
    """

    def __init__(self, router: nn.Module, experts: FP8GroupedExperts, shared_expert: nn.Module, *,
                 top_k: int, linear_router: bool = False) -> None:
        super().__init__()
        self.router = router
        self.experts = experts
        self.shared_expert = shared_expert
        self.top_k = top_k
        self.hidden_dim = experts.hidden_size
        self.num_experts = experts.num_experts
        self.linear_router = linear_router

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = hidden_states.reshape(-1, self.hidden_dim)
        if self.linear_router:
            router_logits = self.router(x)
            top, ids = torch.topk(router_logits, self.top_k, dim=1)
            scales = torch.sigmoid(top.float()).to(x.dtype)
            # (E, T): the old block's sigmoid over -inf-filled top-k logits, i.e. 0 off the top-k
            second = torch.zeros_like(router_logits, dtype=x.dtype).scatter_(1, ids, scales).t()
        else:
            router_scores, second = self.router(x)
            ids = torch.topk(second, self.top_k, dim=1).indices
            scales = router_scores.gather(1, ids)
        return self.shared_expert(x) + self.experts(x, ids, None, input_scales=scales), second
