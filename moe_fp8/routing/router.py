"""``Router``: the gate ``nn.Module`` (bias-free linear ``H -> E`` + :func:`route`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import check_tensor
from .config import RouterConfig, RouterOutput
from .losses import update_correction_bias_
from .scoring import route

__all__ = ["Router"]


class Router(nn.Module):
    """Router gate: ``logits = x @ weight.T`` in ``cfg.logits_dtype``, then :func:`route`.

    Parameters and buffers (names as in Hugging Face, so state dicts load as they are):
        weight: ``(E, H)`` parameter (``nn.Linear`` layout, no bias).
        e_score_correction_bias: ``(E,)`` fp32 buffer, only with ``cfg.use_correction_bias``;
            used for selection only and moved by :meth:`update_bias` (aux-loss-free balancing).
        load_since_update: ``(E,)`` int64 buffer (same condition): pairs routed to each expert
            by training forwards since the last :meth:`update_bias` (no sync, graph-safe).
    """

    def __init__(self, hidden_size: int, config: RouterConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        if not isinstance(config, RouterConfig):
            raise TypeError(f"config: expected RouterConfig, got {type(config).__name__}")
        if hidden_size < 1:
            raise ValueError(f"hidden_size: expected >= 1, got {hidden_size}")
        self.config = config
        self.hidden_size = hidden_size
        E = config.num_experts
        self.weight = nn.Parameter(torch.empty(E, hidden_size, device=device, dtype=dtype))
        self.reset_parameters()
        if config.use_correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(E, device=device, dtype=torch.float32))
            self.register_buffer("load_since_update", torch.zeros(E, device=device, dtype=torch.int64))

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default init of the gate weight (buffers are left as they are)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """Route ``x`` ``(..., H)``; the outputs are per token, flattened to ``T = x.numel() // H``."""
        check_tensor("x", x, dtypes=(torch.bfloat16, torch.float16, torch.float32))
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected last dim {self.hidden_size}, got shape {tuple(x.shape)}")
        dtype = self.config.logits_dtype or x.dtype
        logits = F.linear(x.reshape(-1, self.hidden_size).to(dtype), self.weight.to(dtype))
        bias = self.e_score_correction_bias if self.config.use_correction_bias else None
        out = route(logits, self.config, bias)
        if self.config.use_correction_bias and self.training:
            self.load_since_update.add_(out.expert_counts)
        return out

    @torch.no_grad()
    def update_bias(self) -> None:
        """Apply one aux-loss-free bias step from the load since the last call, then reset it."""
        if not self.config.use_correction_bias:
            raise RuntimeError("update_bias: this router has no correction bias (use_correction_bias=False)")
        update_correction_bias_(self.e_score_correction_bias, self.load_since_update, self.config.bias_update_rate)
        self.load_since_update.zero_()

    def extra_repr(self) -> str:
        c = self.config
        return f"hidden={self.hidden_size}, experts={c.num_experts}, top_k={c.top_k}, scoring={c.scoring}"
