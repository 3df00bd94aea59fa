"""Pure-PyTorch reference quantizers: the numerics spec every kernel must reproduce bit for bit.

Scale convention (the same for every granularity):

* ``amax``: the largest ``|x|`` over the scaling group, in fp32, clamped below by ``EPS`` so an
  all-zero group gives zeros, not NaN.
* ``inv_scale = fmt.max / amax`` (fp32, IEEE round-to-nearest division). With ``pow2=True`` it is
  rounded DOWN to a power of two (``amax * inv_scale <= fmt.max`` still holds).
* ``q = clamp(x.float() * inv_scale, -fmt.max, fmt.max).to(fmt.torch_dtype)`` (round to nearest
  even; the clamp makes the cast independent of torch's overflow behaviour, which saturates for
  e4m3fn in torch >= 2.12 and gives NaN in older torch and for fnuz).
* ``scale = 1 / inv_scale`` (fp32, IEEE division): the **dequantization** scale the GEMMs take,
  ``x ~= q.float() * scale``. It equals ``amax / fmt.max`` to within one ulp (exactly with pow2).

Inputs are bf16, fp16 or fp32 and must be finite: a group holding inf or NaN gets
``scale = inf`` or NaN, which marks it instead of hiding it. Layouts: every quantizer returns
``q`` contiguous, in the layout stated in its docstring, and fp32 scales.
"""

from __future__ import annotations

import einops
import torch

from ..checks import check_offsets, check_offsets_values, check_tensor
from .formats import Float8Format, resolve_format

__all__ = [
    "EPS",
    "HIGH_PRECISION_DTYPES",
    "amax_to_scales",
    "cast_to_fp8",
    "quantize_tensorwise",
    "quantize_rowwise",
    "quantize_expert_tensorwise",
    "quantize_expert_colwise",
    "expert_amax",
    "group_amax",
    "quantize_group_colwise",
    "quantize_blockwise",
    "dequantize",
]

EPS = 1e-12
HIGH_PRECISION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_EXPONENT_MASK = 0x7F800000


def amax_to_scales(amax: torch.Tensor, fmt: Float8Format, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inv_scale, scale)`` in fp32 for an amax tensor of any shape (see the module docstring)."""
    amax = amax.float().clamp_min(EPS)
    inv_scale = torch.full_like(amax, fmt.max) / amax
    if pow2:
        # Floor to a power of two: keep the exponent bits (inv_scale is positive and normal).
        inv_scale = (inv_scale.view(torch.int32) & _EXPONENT_MASK).view(torch.float32)
    scale = torch.ones_like(inv_scale) / inv_scale
    return inv_scale, scale


def cast_to_fp8(x: torch.Tensor, inv_scale: torch.Tensor, fmt: Float8Format) -> torch.Tensor:
    """``clamp(x * inv_scale, +-max).to(fp8)`` with ``inv_scale`` broadcast against ``x``."""
    return (x.float() * inv_scale).clamp(-fmt.max, fmt.max).to(fmt.torch_dtype).contiguous()


def _check_input(name: str, x, ndim) -> None:
    check_tensor(name, x, dtypes=HIGH_PRECISION_DTYPES, ndim=ndim)


def quantize_tensorwise(
    x: torch.Tensor, fmt=None, *, pow2: bool = False, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor.

    Args:
        x: any shape, bf16/fp16/fp32.
        rows: optional int32 ``(n,)``: its first element counts the leading rows of ``x`` (along
            dim 0) that the amax covers; the others are cast with the same scale (no host sync).
    Returns:
        ``q`` (same shape, fp8, contiguous), ``scale`` (0-d fp32).
    """
    _check_input("x", x, None)
    fmt = resolve_format(fmt, x.device)
    a = x.abs()
    if rows is not None:
        row = torch.arange(x.shape[0], device=x.device).view(-1, *([1] * (x.dim() - 1)))
        a = torch.where(row < rows[0], a, a.new_zeros(()))
    amax = a.amax() if x.numel() else x.new_zeros(())
    inv, scale = amax_to_scales(amax, fmt, pow2)
    return cast_to_fp8(x, inv, fmt), scale


def quantize_rowwise(x: torch.Tensor, fmt=None, *, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row (amax over the last dim): activations and grad_output.

    Args:
        x: ``(M, K)``, bf16/fp16/fp32.
    Returns:
        ``q`` ``(M, K)`` row-major fp8, ``scale`` ``(M,)`` fp32.
    """
    _check_input("x", x, 2)
    fmt = resolve_format(fmt, x.device)
    amax = x.abs().amax(dim=1) if x.shape[1] else x.new_zeros(x.shape[0])
    inv, scale = amax_to_scales(amax, fmt, pow2)
    return cast_to_fp8(x, inv[:, None], fmt), scale


def quantize_expert_tensorwise(w: torch.Tensor, fmt=None, *, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per expert.

    Args:
        w: ``(E, N, K)``, bf16/fp16/fp32.
    Returns:
        ``q`` ``(E, N, K)`` contiguous fp8, ``scale`` ``(E,)`` fp32.
    """
    _check_input("w", w, 3)
    fmt = resolve_format(fmt, w.device)
    amax = w.abs().amax(dim=(1, 2)) if w.numel() else w.new_zeros(w.shape[0])
    inv, scale = amax_to_scales(amax, fmt, pow2)
    return cast_to_fp8(w, inv[:, None, None], fmt), scale


def quantize_expert_colwise(
    w: torch.Tensor, fmt=None, *, pow2: bool = False, transposed: bool = False, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert, per-output-column scales of 3D expert weights in ``nn.Linear`` layout.

    Args:
        w: ``(E, N, K)`` (expert ``e`` computes ``x @ w[e].T``), bf16/fp16/fp32.
        transposed: ``False`` gives the forward layout, ``True`` the dgrad layout.
        amax: the amax the scales come from, shaped like ``scale``; ``None`` computes it from
            ``w`` (``expert_amax``). Given, it is trusted: other values give other scales.
    Returns:
        forward: ``q`` ``(E, N, K)`` contiguous, ``scale`` ``(E, N)`` (amax over K).
        dgrad (``transposed=True``): ``q`` ``(E, K, N)`` contiguous (= ``w.transpose(1, 2)``
        quantized), ``scale`` ``(E, K)`` (amax over N).
    """
    _check_input("w", w, 3)
    fmt = resolve_format(fmt, w.device)
    E, N, K = w.shape
    if amax is None:
        amax = expert_amax(w, transposed=transposed)
    check_tensor("amax", amax, shape=(E, K) if transposed else (E, N))
    if transposed:
        w = w.transpose(1, 2)
    inv, scale = amax_to_scales(amax, fmt, pow2)
    return cast_to_fp8(w, inv[:, :, None], fmt), scale


def expert_amax(w: torch.Tensor, *, transposed: bool = False) -> torch.Tensor:
    """The amax of ``quantize_expert_colwise``'s scales, fp32: ``(E, N)`` over K, or with
    ``transposed`` ``(E, K)`` over N (0 where the reduced axis is empty)."""
    _check_input("w", w, 3)
    dim = 1 if transposed else 2
    if w.shape[dim] == 0:
        return w.new_zeros(w.shape[0], w.shape[3 - dim], dtype=torch.float32)
    return w.abs().amax(dim=dim).float()


def group_amax(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``(E, K)`` fp32: the amax of each column of ``x (M, K)`` over each group's rows (0 for an
    empty group), the groups as in :func:`quantize_group_colwise`."""
    _check_input("x", x, 2)
    check_offsets(offs, device=x.device)
    check_offsets_values(offs, x.shape[0])
    return _group_amax(x, offs)[: offs.numel()]


def _group_amax(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``(E + 1, K)``: :func:`group_amax` and, last, the amax of the rows past ``offs[-1]``."""
    M, K = x.shape
    amax = torch.zeros(offs.numel() + 1, K, device=x.device, dtype=torch.float32)
    amax.scatter_reduce_(0, _row_groups(x, offs)[:, None].expand(M, K), x.abs().float(), "amax", include_self=True)
    return amax


def _row_groups(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The group of every row of ``x`` (``E`` for rows past ``offs[-1]``)."""
    rows = torch.arange(x.shape[0], device=x.device, dtype=torch.int32)
    return torch.searchsorted(offs.contiguous(), rows, right=True)


def quantize_group_colwise(
    x: torch.Tensor, offs: torch.Tensor, fmt=None, *, pow2: bool = False, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group, per-column scales over jagged row groups: the wgrad operands.

    Group ``g`` holds rows ``[offs[g-1], offs[g])`` (``offs[-1]`` is 0). Each column of each group
    gets its own scale (amax over that group's rows). Empty groups get ``scale = EPS / max``
    (their inverse is never used); rows at or past ``offs[-1]`` belong to no group and are 0.

    Args:
        x: ``(M, K)``, bf16/fp16/fp32.
        offs: ``(E,)`` int32 cumulative end offsets, non-decreasing, ``offs[-1] <= M``.
        amax: ``(E, K)``, the amax the scales come from; ``None`` computes it (:func:`group_amax`).
            Given, it is trusted: other values give other scales.
    Returns:
        ``q`` ``(M, K)`` row-major fp8, ``scale`` ``(E, K)`` fp32 (flattened, this is the
        ``(E*K,)`` layout of ``torch._scaled_grouped_mm``'s 2D x 2D form).
    """
    _check_input("x", x, 2)
    check_offsets(offs, device=x.device)
    check_offsets_values(offs, x.shape[0])
    fmt = resolve_format(fmt, x.device)
    K = x.shape[1]
    if amax is None:
        amax = _group_amax(x, offs)[: offs.numel()]
    inv, scale = amax_to_scales(amax, fmt, pow2)
    inv_rows = torch.cat([inv, inv.new_zeros(1, K)])[_row_groups(x, offs)]  # rows past the end -> 0
    return cast_to_fp8(x, inv_rows, fmt), scale


def quantize_blockwise(
    x: torch.Tensor, fmt=None, *, block: tuple[int, int] = (1, 128), pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block scales over the last two dims (DeepSeek-V3 style).

    ``block=(1, 128)`` for activations (one scale per row and 128 columns), ``(128, 128)`` for
    weights. Edge blocks may be partial.

    Args:
        x: ``(..., R, C)`` with at least 2 dims, bf16/fp16/fp32.
    Returns:
        ``q`` (same shape, contiguous fp8), ``scale`` ``(..., ceil(R/br), ceil(C/bc))`` fp32.
    """
    _check_input("x", x, (2, 3))
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"block: expected two positive sizes, got {block}")
    fmt = resolve_format(fmt, x.device)
    br, bc = block
    R, C = x.shape[-2:]
    pr, pc = -R % br, -C % bc
    padded = x.new_zeros(*x.shape[:-2], R + pr, C + pc, dtype=torch.float32)  # (torch 2.9's pad rejects empty dims)
    padded[..., :R, :C] = x.abs()
    amax = einops.reduce(padded, "... (r br) (c bc) -> ... r c", "max", br=br, bc=bc)
    inv, scale = amax_to_scales(amax, fmt, pow2)
    inv_full = inv.repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)[..., :R, :C]
    return cast_to_fp8(x, inv_full, fmt), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, *, block: tuple[int, int] | None = None) -> torch.Tensor:
    """``q.float() * scale`` in fp32, with ``scale`` broadcast the way the quantizers produced it.

    ``scale`` may be 0-d (tensorwise), have one fewer dim than ``q`` (rowwise / colwise:
    a trailing unit dim is added), or, with ``block``, hold block scales.
    """
    if block is not None:
        br, bc = block
        R, C = q.shape[-2:]
        scale = scale.repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)[..., :R, :C]
    elif scale.dim() == q.dim() - 1:
        scale = scale.unsqueeze(-1)
    elif scale.dim() == 1 and q.dim() == 3:
        scale = scale[:, None, None]
    return q.float() * scale
