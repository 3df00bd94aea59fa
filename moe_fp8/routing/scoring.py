"""Functional routing: router logits ``(T, E)`` -> top-k expert ids and weights.

Semantics per scoring function (``cfg`` is a :class:`RouterConfig`):

* softmax: ``p = softmax(logits.float())``, ``w, ids = topk(p, k)``; optional renormalisation
  ``w / (sum(w) + 1e-20)`` (Mixtral, Qwen3-MoE; DeepSeek-MoE-16B keeps raw probabilities).
* sigmoid, no bias, no groups (Llama 4): ``ids = topk(logits, k)``, ``w = sigmoid(top logits)``.
* sigmoid with correction bias and/or groups (DeepSeek-V3 ``noaux_tc``): ``s = sigmoid(logits)``,
  the selection key is ``s + bias``; groups are scored by the sum of their top-2 keys, the
  ``topk_group`` best groups stay and the others are masked to ``-inf`` (DeepSeek's reference
  code; transformers masks with 0.0, which differs only when a kept key is negative), then
  ``ids = topk(key, k)`` and the weights are the UNBIASED ``s`` of those experts.
* then ``w *= routed_scaling_factor``.

Ids come best first (``sorted=True``), so the slot order is deterministic.

NaN logits (defined behaviour, no host sync): a NaN logit is treated as ``-inf``: that expert
is never selected while a finite one is available and its weight is 0. A token whose logits
are all NaN still gets k distinct valid ids, all with weight 0, so it contributes nothing.
``RouterOutput.nan_count`` counts the NaN logits for monitoring. A ``+inf`` logit is clamped to
the largest finite fp32 value: under softmax its expert takes the token's whole weight (shared
equally by several ``+inf`` experts of one token) instead of softmax's NaN dropping the token;
sigmoid scoring saturates the same way as for any huge logit.
"""

from __future__ import annotations

import torch

from ..checks import check_tensor
from .config import RouterConfig, RouterOutput
from .losses import expert_counts, load_balancing_loss, router_z_loss

__all__ = ["route", "group_limited_mask"]

_NORM_EPS = 1e-20
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def group_limited_mask(key: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """``key`` ``(T, E)`` with every expert outside the ``topk_group`` best groups set to ``-inf``.

    A group's score is the sum of its two largest keys (its largest, for groups of one expert).
    """
    T, E = key.shape
    grouped = key.view(T, n_group, E // n_group)
    group_score = grouped.topk(min(2, E // n_group), dim=-1).values.sum(-1)
    keep = group_score.topk(topk_group, dim=-1).indices
    mask = torch.zeros(T, n_group, dtype=torch.bool, device=key.device).scatter_(1, keep, True)
    return grouped.masked_fill(~mask[:, :, None], float("-inf")).view(T, E)


def route(logits: torch.Tensor, cfg: RouterConfig, correction_bias: torch.Tensor | None = None) -> RouterOutput:
    """Route ``T`` tokens given their router logits.

    Args:
        logits: ``(T, E)`` bf16/fp16/fp32 (``T`` may be 0).
        cfg: the router configuration.
        correction_bias: ``(E,)`` selection bias (added in fp32), required iff ``cfg.use_correction_bias``.
    Returns:
        :class:`RouterOutput` (see its docstring); no host sync.
    """
    check_tensor("logits", logits, dtypes=_FLOATS, ndim=2)
    T, E = logits.shape
    if E != cfg.num_experts:
        raise ValueError(f"logits: expected {cfg.num_experts} experts in dim 1, got shape {(T, E)}")
    if cfg.use_correction_bias:
        if correction_bias is None:
            raise ValueError("correction_bias: required by a config with use_correction_bias=True")
        check_tensor("correction_bias", correction_bias, dtypes=_FLOATS, shape=(E,))
    elif correction_bias is not None:
        raise ValueError("correction_bias: given, but the config has use_correction_bias=False")

    k = cfg.top_k
    nan = torch.isnan(logits)
    ninf = float("-inf")  # NaN -> -inf, +inf -> the largest finite fp32, in one pass
    clean = torch.nan_to_num(logits.float(), nan=ninf, posinf=torch.finfo(torch.float32).max, neginf=ninf)
    if cfg.scoring == "softmax":
        density = torch.softmax(clean, dim=-1).nan_to_num(nan=0.0)  # all -inf rows -> 0
        weights, ids = density.topk(k, dim=-1)
    else:
        scores = torch.sigmoid(clean)
        density = scores / (scores.sum(-1, keepdim=True) + _NORM_EPS)
        if cfg.use_correction_bias or cfg.grouped:
            key = scores + correction_bias.float() if correction_bias is not None else scores
            key = key.masked_fill(nan, float("-inf"))
            if cfg.grouped:
                key = group_limited_mask(key, cfg.n_group, cfg.topk_group)
            ids = key.topk(k, dim=-1).indices
            weights = scores.gather(1, ids)
        else:
            top_logits, ids = clean.topk(k, dim=-1)
            weights = torch.sigmoid(top_logits)
    if cfg.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + _NORM_EPS)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor

    counts = expert_counts(ids, E, ids_in_range=True)  # a top-k over the E columns
    aux = None
    if cfg.aux_loss_coef > 0:
        aux = cfg.aux_loss_coef * load_balancing_loss(density, counts, k)
    if cfg.z_loss_coef > 0:
        z = cfg.z_loss_coef * router_z_loss(logits)
        aux = z if aux is None else aux + z
    return RouterOutput(
        topk_ids=ids,
        topk_weights=None if cfg.weights_on_input else weights,
        input_scales=weights if cfg.weights_on_input else None,
        logits=logits,
        expert_counts=counts,
        nan_count=nan.sum(),
        aux_loss=aux,
    )
