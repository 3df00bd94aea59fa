"""Router configuration and the router's output record.

One :class:`RouterConfig` describes every router the library supports; the presets reproduce the
routing of the real models (exact values in ``shared/reference/torch_api_and_models.md`` §5):

======================  =========  ===========  =======  ========================================
preset                  scoring    renormalize  scaling  other
======================  =========  ===========  =======  ========================================
``mixtral()``           softmax    yes          1        8 experts, top-2
``qwen3_moe()``         softmax    yes          1        128 experts, top-8 (checkpoint setting)
``deepseek_moe_16b()``  softmax    no           1        64 experts, top-6
``deepseek_v3()``       sigmoid    yes (+1e-20) 2.5     256 experts, top-8, 8 groups keep 4,
                                                         selection-only correction bias
``llama4()``            sigmoid    no           1        top-1, weights scale the expert INPUT
======================  =========  ===========  =======  ========================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

__all__ = ["RouterConfig", "RouterOutput"]

Scoring = Literal["softmax", "sigmoid"]


@dataclass(frozen=True)
class RouterConfig:
    """How a router turns logits ``(T, E)`` into ``top_k`` experts and weights per token.

    Attributes:
        num_experts: routed experts ``E``.
        top_k: experts per token ``k`` (``1 <= k <= E``).
        scoring: ``"softmax"`` (probabilities over all experts, fp32) or ``"sigmoid"``
            (independent per-expert scores).
        renormalize: divide the k selected weights by their sum (``+ 1e-20``, which changes no
            bit of a softmax sum and matches DeepSeek-V3's ``norm_topk_prob``).
        n_group, topk_group: group-limited selection (DeepSeek-V3, sigmoid only): the experts form ``n_group``
            equal groups, a group's score is the sum of its top-2 (biased) scores, only the
            ``topk_group`` best groups stay eligible. ``n_group=1`` disables it.
        use_correction_bias: sigmoid only: add the ``e_score_correction_bias`` buffer ``(E,)``
            to the scores for SELECTION only; the weights come from the unbiased scores.
        routed_scaling_factor: multiplies the final weights (after renormalisation).
        weights_on_input: Llama 4: the weight multiplies the expert's INPUT token, not its
            output; the router then returns ``input_scales`` and no combine weights.
        aux_loss_coef: weight of the load-balancing loss (Switch/GShard form); 0 disables it.
        z_loss_coef: weight of the router z-loss (ST-MoE); 0 disables it.
        bias_update_rate: step ``gamma`` of the aux-loss-free bias update.
        logits_dtype: dtype of the router matmul (``None``: the input's dtype, as HF Mixtral /
            Qwen3 / Llama 4 do; ``torch.float32``: DeepSeek-V3's fp32 gate).
    """

    num_experts: int
    top_k: int
    scoring: Scoring = "softmax"
    renormalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    use_correction_bias: bool = False
    routed_scaling_factor: float = 1.0
    weights_on_input: bool = False
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    bias_update_rate: float = 1e-3
    logits_dtype: torch.dtype | None = torch.float32

    def __post_init__(self) -> None:
        E, k = self.num_experts, self.top_k
        if not isinstance(E, int) or E < 1:
            raise ValueError(f"num_experts: expected a positive int, got {E!r}")
        if not isinstance(k, int) or not 1 <= k <= E:
            raise ValueError(f"top_k: expected an int in [1, num_experts={E}], got {k!r}")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring: expected 'softmax' or 'sigmoid', got {self.scoring!r}")
        if self.n_group < 1 or E % self.n_group:
            raise ValueError(f"n_group: expected a positive divisor of num_experts={E}, got {self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group: expected an int in [1, n_group={self.n_group}], got {self.topk_group}")
        if self.topk_group * (E // self.n_group) < k:
            raise ValueError(
                f"topk_group: {self.topk_group} groups of {E // self.n_group} experts hold fewer than top_k={k}"
            )
        if self.use_correction_bias and self.scoring != "sigmoid":
            raise ValueError("use_correction_bias: only supported with scoring='sigmoid'")
        if self.n_group > 1 and self.scoring != "sigmoid":
            raise ValueError("n_group: group-limited selection is only supported with scoring='sigmoid'")
        if self.weights_on_input and (self.renormalize or self.routed_scaling_factor != 1.0):
            raise ValueError("weights_on_input: incompatible with renormalize / routed_scaling_factor")
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")

    @property
    def grouped(self) -> bool:
        return self.n_group > 1

    # --- presets of the real models -------------------------------------------------------
    @classmethod
    def mixtral(cls, num_experts: int = 8, top_k: int = 2, **kw) -> RouterConfig:
        """Mixtral 8x7B: softmax over all experts (fp32), top-2, renormalise; bf16 gate matmul."""
        return cls(num_experts, top_k, "softmax", renormalize=True, logits_dtype=None, **kw)

    @classmethod
    def qwen3_moe(cls, num_experts: int = 128, top_k: int = 8, **kw) -> RouterConfig:
        """Qwen3-30B-A3B: softmax (fp32), top-8, renormalise (``norm_topk_prob`` of the checkpoint)."""
        return cls(num_experts, top_k, "softmax", renormalize=True, logits_dtype=None, **kw)

    @classmethod
    def deepseek_moe_16b(cls, num_experts: int = 64, top_k: int = 6, **kw) -> RouterConfig:
        """DeepSeek-MoE-16B: softmax, top-6, no renormalisation."""
        return cls(num_experts, top_k, "softmax", renormalize=False, **kw)

    @classmethod
    def deepseek_v3(cls, num_experts: int = 256, top_k: int = 8, n_group: int = 8, topk_group: int = 4, **kw) -> RouterConfig:
        """DeepSeek-V3 ``noaux_tc``: sigmoid, grouped top-k on biased scores, normalise, x2.5."""
        kw.setdefault("routed_scaling_factor", 2.5)
        return cls(
            num_experts,
            top_k,
            "sigmoid",
            renormalize=True,
            n_group=n_group,
            topk_group=topk_group,
            use_correction_bias=True,
            logits_dtype=torch.float32,
            **kw,
        )

    @classmethod
    def llama4(cls, num_experts: int = 16, top_k: int = 1, **kw) -> RouterConfig:
        """Llama 4 Scout (16 experts) / Maverick (128): top-1 logit, sigmoid score scales the input."""
        return cls(num_experts, top_k, "sigmoid", weights_on_input=True, logits_dtype=None, **kw)


class RouterOutput(NamedTuple):
    """What a router returns (a NamedTuple: a pytree for ``torch.compile``).

    Attributes:
        topk_ids: ``(T, k)`` int64 expert ids, best first; always in ``[0, E)`` and distinct per token.
        topk_weights: ``(T, k)`` fp32 combine weights, or ``None`` when the config puts the
            weights on the input (Llama 4): then combine with unit weights.
        input_scales: ``(T, k)`` fp32 factors for the expert INPUTS (Llama 4:
            ``expert_in = x * input_scales[:, j:j+1]``), else ``None``.
        logits: ``(T, E)`` router logits (``logits_dtype``), NaN kept as given.
        expert_counts: ``(E,)`` int32 (token, slot) pairs routed to each expert (load monitor).
        nan_count: 0-d int64 count of NaN logits (on device: reading it syncs).
        aux_loss: 0-d fp32 ``aux_loss_coef * load_balancing + z_loss_coef * z_loss``, or
            ``None`` when both coefficients are 0.
    """

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor | None
    input_scales: torch.Tensor | None
    logits: torch.Tensor
    expert_counts: torch.Tensor
    nan_count: torch.Tensor
    aux_loss: torch.Tensor | None
