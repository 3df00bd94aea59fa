"""Load monitoring and balancing for routers: expert counts, aux losses, the aux-loss-free bias update.

Everything here is device-side and sync-free (shapes come from metadata only).
"""

from __future__ import annotations

import torch

from ..checks import check_tensor

__all__ = ["expert_counts", "load_balancing_loss", "router_z_loss", "update_correction_bias_"]


def expert_counts(topk_ids: torch.Tensor, num_experts: int, *, ids_in_range: bool = False) -> torch.Tensor:
    """``(E,)`` int32: how many (token, slot) pairs chose each expert.

    Ids outside ``[0, E)`` are not counted; ``ids_in_range=True`` (ids from a top-k over ``E``
    columns) skips that masking (three kernels instead of eight). Integer atomics are
    order-independent, so the result is the same on every run. (``torch.bincount`` is avoided: on
    CUDA it syncs to size its output.)
    """
    ids = topk_ids.reshape(-1).long()
    ones = torch.ones_like(ids, dtype=torch.int32)
    if ids_in_range:
        return torch.zeros(num_experts, dtype=torch.int32, device=ids.device).scatter_add_(0, ids, ones)
    valid = (ids >= 0) & (ids < num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, torch.where(valid, ids, num_experts), ones)
    return counts[:num_experts]


def load_balancing_loss(density: torch.Tensor, counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch / GShard load-balancing loss ``E * sum_e f_e * P_e`` (1.0 at perfect balance).

    ``f_e = counts[e] / (T * k)`` is the fraction of (token, slot) pairs routed to expert ``e``
    (not differentiable); ``P_e`` is the mean over tokens of ``density[:, e]``, the router's
    probability of ``e`` (softmax probabilities, or sigmoid scores normalised per token as in
    DeepSeek-V3's sequence-wise balance loss). Hugging Face's ``load_balancing_loss_func``
    (Mixtral, Qwen3-MoE) returns ``top_k`` times this value. With ``T = 0`` the loss is 0.

    Args:
        density: ``(T, E)`` fp32 router probabilities (differentiable).
        counts: ``(E,)`` integer pairs per expert.
    Returns:
        0-d fp32 tensor.
    """
    T, E = density.shape
    f = counts.float() / max(T * top_k, 1)
    p = density.float().sum(0) / max(T, 1)
    return E * (f * p).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss ``mean_t logsumexp(logits_t)^2`` (fp32, 0-d).

    NaN logits are ignored (treated as -inf); a token whose logits are all NaN adds 0.
    With ``T = 0`` the loss is 0.
    """
    clean = logits.float().masked_fill(torch.isnan(logits), float("-inf"))
    lse = torch.logsumexp(clean, dim=-1)
    lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return lse.square().sum() / max(logits.shape[0], 1)


@torch.no_grad()
def update_correction_bias_(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's aux-loss-free balancing step, in place: ``b_e += rate * sign(mean - load_e)``.

    Overloaded experts (load above the mean) lose ``rate``, underloaded ones gain it, balanced
    ones keep their bias. ``counts`` is the load since the last update (sum it over data-parallel
    ranks first when training distributed). Returns ``bias``.
    """
    check_tensor("bias", bias, dtypes=(torch.float32, torch.bfloat16, torch.float16), ndim=1)
    check_tensor("counts", counts, ndim=1, shape=(bias.shape[0],))
    load = counts.float()
    bias.add_(torch.sign(load.mean() - load), alpha=rate)
    return bias
