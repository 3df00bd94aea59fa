"""Helpers for tests and benchmarks: SQNR, random token-group offsets, fp64 references.

Everything here is plain PyTorch, may sync with the device, and is not meant for hot paths.
"""

from __future__ import annotations

from typing import Literal

import torch

from .checks import check_offsets, check_offsets_values, check_tensor

__all__ = [
    "sqnr",
    "OFFSET_KINDS",
    "random_offsets",
    "group_sizes",
    "reference_grouped_mm",
    "reference_moe_forward",
]

OffsetKind = Literal["balanced", "skewed", "empty", "one"]
OFFSET_KINDS: tuple[str, ...] = ("balanced", "skewed", "empty", "one")


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``20 log10(||ref|| / ||ref - x||)`` in dB (fp64).

    ``inf`` when ``x`` equals ``ref``; NaN anywhere gives NaN (which fails any ``>=`` check).
    """
    if ref.shape != x.shape:
        raise ValueError(f"x: expected shape {tuple(ref.shape)} like ref, got {tuple(x.shape)}")
    ref64, x64 = ref.detach().double().cpu(), x.detach().double().cpu()
    noise = torch.linalg.vector_norm(ref64 - x64)
    signal = torch.linalg.vector_norm(ref64)
    if torch.isnan(noise) or torch.isnan(signal):
        return float("nan")
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(signal / noise))


def random_offsets(
    num_rows: int,
    num_groups: int,
    kind: OffsetKind = "balanced",
    *,
    multiple_of: int = 1,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Random cumulative end offsets ``(num_groups,)`` int32 with ``offs[-1] == num_rows``.

    Kinds: ``balanced`` (each row lands in a uniformly random group), ``skewed`` (group
    probabilities ~ U^4, a few hot experts), ``empty`` (about a third of the groups, at least one,
    get no rows), ``one`` (every row in one random group). With ``multiple_of`` > 1, every group
    size is a multiple of it and ``num_rows`` must be one too.
    """
    if kind not in OFFSET_KINDS:
        raise ValueError(f"kind: expected one of {OFFSET_KINDS}, got {kind!r}")
    if num_groups < 1:
        raise ValueError(f"num_groups: expected >= 1, got {num_groups}")
    if num_rows < 0 or num_rows % multiple_of:
        raise ValueError(f"num_rows: expected a non-negative multiple of {multiple_of}, got {num_rows}")
    units = num_rows // multiple_of
    u = torch.rand(num_groups, generator=generator, dtype=torch.float64)
    if kind == "balanced":
        p = torch.ones(num_groups, dtype=torch.float64)
    elif kind == "skewed":
        p = u**4 + 1e-3
    elif kind == "empty":
        p = torch.ones(num_groups, dtype=torch.float64)
        n_empty = max(1, num_groups // 3) if num_groups > 1 else 0
        p[torch.randperm(num_groups, generator=generator)[:n_empty]] = 0
    else:
        p = torch.zeros(num_groups, dtype=torch.float64)
        p[int(torch.randint(num_groups, (1,), generator=generator))] = 1
    if units:
        picks = torch.multinomial(p, units, replacement=True, generator=generator)
        sizes = torch.bincount(picks, minlength=num_groups)
    else:
        sizes = torch.zeros(num_groups, dtype=torch.int64)
    return (torch.cumsum(sizes, 0) * multiple_of).to(torch.int32).to(device)


def group_sizes(offs: torch.Tensor) -> torch.Tensor:
    """Rows per group ``(E,)`` int64 from cumulative end offsets."""
    o = offs.to(torch.int64)
    return torch.diff(o, prepend=o.new_zeros(1))


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
