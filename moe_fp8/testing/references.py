"""fp64 references of the grouped GEMM forms and of a routed SwiGLU MoE forward (plain torch, CPU)."""

from __future__ import annotations

import torch

from ..checks import check_offsets, check_offsets_values, check_tensor

__all__ = ["reference_grouped_mm", "reference_grouped_mm_2d2d", "reference_moe_forward"]


def reference_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """fp64 ``x[rows of g] @ w[g].T`` for each group; ``(M, N)`` fp64, zero past ``offs[-1]``."""
    check_tensor("x", x, ndim=2)
    check_tensor("w", w, ndim=3, shape=(None, None, x.shape[1]))
    check_offsets(offs, num_groups=w.shape[0])
    check_offsets_values(offs, x.shape[0])
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    x64, w64 = x.detach().double().cpu(), w.detach().double().cpu()
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x64[start:end] @ w64[g].T
        start = end
    return out


def reference_grouped_mm_2d2d(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """fp64 ``a[rows of g].T @ b[rows of g]`` for each group (the wgrad form); ``(E, N, K)`` fp64.

    ``a`` is ``(M, N)`` (e.g. grad_out), ``b`` is ``(M, K)`` (e.g. x); rows at or past ``offs[-1]``
    belong to no group, and an empty group's slice is zero.
    """
    check_tensor("a", a, ndim=2)
    check_tensor("b", b, ndim=2, shape=(a.shape[0], None))
    check_offsets(offs)
    check_offsets_values(offs, a.shape[0])
    out = torch.zeros(offs.numel(), a.shape[1], b.shape[1], dtype=torch.float64)
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[g] = a64[start:end].T @ b64[start:end]
        start = end
    return out


def reference_moe_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """fp64 routed-experts forward of a SwiGLU MoE: ``sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))``.

    Args:
        x: ``(T, H)``.
        topk_ids: ``(T, k)`` integer expert ids.
        topk_weights: ``(T, k)`` router weights.
        w_gate_up: ``(E, 2I, H)``, gate rows first then up rows (``nn.Linear`` layout).
        w_down: ``(E, H, I)``.
    Returns:
        ``(T, H)`` fp64 on the CPU.
    """
    check_tensor("x", x, ndim=2)
    check_tensor("topk_ids", topk_ids, ndim=2, shape=(x.shape[0], None))
    check_tensor("topk_weights", topk_weights, ndim=2, shape=tuple(topk_ids.shape))
    check_tensor("w_gate_up", w_gate_up, ndim=3, shape=(None, None, x.shape[1]))
    E, two_i, _ = w_gate_up.shape
    check_tensor("w_down", w_down, ndim=3, shape=(E, x.shape[1], two_i // 2))
    x64 = x.detach().double().cpu()
    ids = topk_ids.cpu()
    wts = topk_weights.detach().double().cpu()
    out = torch.zeros_like(x64)
    for e in range(E):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        gate, up = (x64[tok] @ w_gate_up[e].detach().double().cpu().T).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ w_down[e].detach().double().cpu().T
        out.index_add_(0, tok, y * wts[tok, slot, None])
    return out
