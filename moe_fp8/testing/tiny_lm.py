"""``TinyMoELM``: a small decoder language model built from the library's own layers (``FP8MoE``,
``FP8Linear``), for tests and examples that need a whole model without Hugging Face.

Each block: ``x + proj(norm(x))`` (a dense ``FP8Linear`` standing in for attention: the model has
no attention, so sequences are independent token streams), then ``x + moe(norm(x))`` with an
``FP8MoE`` (routed SwiGLU experts and one shared expert). Embedding, final norm and head stay in
high precision.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import FP8Linear, FP8MoE
from ..routing import RouterConfig

__all__ = ["TinyMoELM", "lm_loss"]


class _Block(nn.Module):
    def __init__(self, hidden: int, expert_hidden: int, router: RouterConfig, recipe: str, backend: str | None,
                 device, dtype) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.norm1, self.norm2 = nn.RMSNorm(hidden, **kw), nn.RMSNorm(hidden, **kw)
        dense = recipe if recipe in ("rowwise", "rowwise_gw_hp", "tensorwise") else None
        self.proj = (FP8Linear(hidden, hidden, bias=False, recipe=dense, **kw) if dense
                     else nn.Linear(hidden, hidden, bias=False, **kw))
        self.moe = FP8MoE(hidden, expert_hidden, router.num_experts, router.top_k, router_config=router,
                          shared_expert_hidden_size=expert_hidden, recipe=recipe, backend=backend, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(self.norm1(x))
        return x + self.moe(self.norm2(x))


class TinyMoELM(nn.Module):
    """``forward(ids (B, S) int64) -> logits (B, S, vocab)``.

    Args:
        vocab, hidden, expert_hidden, layers: sizes (``hidden``, ``expert_hidden`` multiples of 16).
        router: the routing of every MoE layer (its ``num_experts``, ``top_k``); default: 8
            experts, top-2 softmax.
        recipe: of the experts and the dense projections (``"bf16"``: plain ``nn.Linear`` there).
        backend: grouped-GEMM backend of the experts.
    """

    def __init__(self, vocab: int = 64, hidden: int = 32, expert_hidden: int = 32, layers: int = 2, *,
                 router: RouterConfig | None = None, recipe: str = "rowwise", backend: str | None = None,
                 device=None, dtype=None) -> None:
        super().__init__()
        router = router or RouterConfig(8, 2, "softmax", renormalize=True)
        kw = dict(device=device, dtype=dtype)
        self.embed = nn.Embedding(vocab, hidden, **kw)
        self.layers = nn.ModuleList(_Block(hidden, expert_hidden, router, recipe, backend, device, dtype)
                                    for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, **kw)
        self.head = nn.Linear(hidden, vocab, bias=False, **kw)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (fp32) of ``logits (B, S, V)`` predicting ``ids (B, S)`` shifted by one."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
