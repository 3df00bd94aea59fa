"""Exact CPU reference of the FP8 grouped GEMM, in the two forms MoE training uses.

* 2D x 3D (forward and dgrad): ``out[rows of g] = a[rows of g] @ b[g].T`` for each group ``g``.
* 2D x 2D (wgrad): ``out[g] = a[rows of g].T @ b[rows of g]``.

Both compute from the FP8 values and fp32 scales: products of FP8 values are exact in fp32, sums
accumulate in fp32 (one ``torch.mm`` per group), scales are applied in the epilogue as the CUDA
kernel does (``scale_b * (scale_a * acc)``), and the result is rounded once to ``out_dtype``.
Rows at or past ``offs[-1]`` are zero, and so are the outputs of empty groups.

Scale shapes decide the granularity:

| form    | scale_a                     | scale_b                              | recipe     |
|---------|-----------------------------|--------------------------------------|------------|
| 2D x 3D | ``(M,)``                      | ``(E, N)``                             | rowwise    |
| 2D x 3D | ``()``                        | ``(E,)``                               | tensorwise |
| 2D x 3D | ``(M, ceil(K/128))``          | ``(E, ceil(N/128), ceil(K/128))``      | blockwise  |
| 2D x 2D | ``(E, N)`` per group, column  | ``(E, K)`` per group, column           | rowwise    |
| 2D x 2D | ``()``                        | ``()``                                 | tensorwise |
| 2D x 2D | ``None`` (bf16 / fp16 operands) | ``None``                             | BF16 wgrad |
"""

from __future__ import annotations

import torch

from ..checks import check_offsets, check_offsets_values, check_tensor

__all__ = ["BLOCK", "FP8_DTYPES", "emulated_grouped_mm_2d3d", "emulated_grouped_mm_2d2d"]

BLOCK = 128  # block edge of the blockwise recipe's scales
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _group_bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends))


def _check_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype: expected one of {_OUT_DTYPES}, got {out_dtype}")


def _blockwise_group(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """``a (m, K) @ b (N, K).T`` with 1xB scales ``sa (m, KB)`` and BxB scales ``sb (NB, KB)``, B = 128."""
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32)
    for kb in range(sa.shape[1]):
        ks = slice(kb * BLOCK, (kb + 1) * BLOCK)
        partial = a[:, ks].float() @ b[:, ks].float().T
        col_scale = sb[:, kb].repeat_interleave(BLOCK)[: b.shape[0]]
        acc += col_scale * (sa[:, kb : kb + 1] * partial)
    return acc


def emulated_grouped_mm_2d3d(
    a: torch.Tensor,
    scale_a: torch.Tensor,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Grouped ``a @ b[g].T`` over row groups (forward / dgrad form).

    Args:
        a: ``(M, K)`` fp8, the permuted activations (rows of group ``g``:
            ``[offs[g-1], offs[g])``).
        scale_a: fp32, ``(M,)`` / ``()`` / ``(M, ceil(K/128))`` (see the module table).
        b: ``(E, N, K)`` fp8 expert weights in ``nn.Linear`` layout (for dgrad: the transposed
            weights ``(E, K_in, N_out)`` quantized along their last dim).
        scale_b: fp32, ``(E, N)`` / ``(E,)`` / ``(E, ceil(N/128), ceil(K/128))``.
        offs: ``(E,)`` int32 cumulative end offsets.
    Returns:
        ``(M, N)`` in ``out_dtype``; rows at or past ``offs[-1]`` are zero.
    """
    check_tensor("a", a, dtypes=FP8_DTYPES, ndim=2)
    check_tensor("b", b, dtypes=FP8_DTYPES, ndim=3, shape=(None, None, a.shape[1]))
    E, N, K = b.shape
    M = a.shape[0]
    check_offsets(offs, num_groups=E, device=a.device)
    check_offsets_values(offs, M)
    _check_out_dtype(out_dtype)
    check_tensor("scale_a", scale_a, dtypes=(torch.float32,), ndim=(0, 1, 2))
    blockwise = scale_a.dim() == 2
    if scale_a.dim() == 0:
        check_tensor("scale_b", scale_b, dtypes=(torch.float32,), shape=(E,))
    elif scale_a.dim() == 1:
        check_tensor("scale_a", scale_a, shape=(M,))
        check_tensor("scale_b", scale_b, dtypes=(torch.float32,), shape=(E, N))
    else:
        kb = -(-K // BLOCK)
        check_tensor("scale_a", scale_a, shape=(M, kb))
        check_tensor("scale_b", scale_b, dtypes=(torch.float32,), shape=(E, -(-N // BLOCK), kb))
    a, b, scale_a, scale_b = (t.cpu() for t in (a, b, scale_a, scale_b))
    out = torch.zeros(M, N, dtype=torch.float32)
    for g, (start, end) in enumerate(_group_bounds(offs)):
        if end == start:
            continue
        rows = slice(start, end)
        if blockwise:
            out[rows] = _blockwise_group(a[rows], scale_a[rows], b[g], scale_b[g])
            continue
        acc = a[rows].float() @ b[g].float().T
        sa = scale_a if scale_a.dim() == 0 else scale_a[rows, None]
        out[rows] = scale_b[g] * (sa * acc)
    return out.to(out_dtype).to(offs.device)


def emulated_grouped_mm_2d2d(
    a: torch.Tensor,
    scale_a: torch.Tensor,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Grouped ``a[rows of g].T @ b[rows of g]`` (wgrad form: ``dW_g = dy_g.T @ x_g``).

    Args:
        a: ``(M, N)`` fp8 (grad_output, quantized per group and column); bf16 / fp16 without scales.
        scale_a: fp32 ``(E, N)`` (per group and column), ``()``, or ``None`` (unscaled operands).
        b: ``(M, K)``, ``a``'s dtype (activations, quantized the same way).
        scale_b: fp32 ``(E, K)``, ``()``, or ``None`` with ``scale_a``.
        offs: ``(E,)`` int32 cumulative end offsets over the ``M`` rows.
    Returns:
        ``(E, N, K)`` in ``out_dtype``; empty groups give zeros.
    """
    scaled = scale_a is not None
    operand_dtypes = FP8_DTYPES if scaled else (torch.bfloat16, torch.float16)
    check_tensor("a", a, dtypes=operand_dtypes, ndim=2)
    check_tensor("b", b, dtypes=operand_dtypes, ndim=2, shape=(a.shape[0], None))
    M, N = a.shape
    K = b.shape[1]
    check_offsets(offs, device=a.device)
    check_offsets_values(offs, M)
    E = offs.numel()
    _check_out_dtype(out_dtype)
    if not scaled:
        if scale_b is not None:
            raise ValueError("scale_b: expected None when scale_a is None")
        scale_a = scale_b = torch.ones(())
    check_tensor("scale_a", scale_a, dtypes=(torch.float32,), ndim=(0, 2))
    if scale_a.dim() == 0:
        check_tensor("scale_b", scale_b, dtypes=(torch.float32,), ndim=0)
    else:
        check_tensor("scale_a", scale_a, shape=(E, N))
        check_tensor("scale_b", scale_b, dtypes=(torch.float32,), shape=(E, K))
    a, b, scale_a, scale_b = (t.cpu() for t in (a, b, scale_a, scale_b))
    out = torch.zeros(E, N, K, dtype=torch.float32)
    for g, (start, end) in enumerate(_group_bounds(offs)):
        if end == start:
            continue
        acc = a[start:end].float().T @ b[start:end].float()
        if not scaled:
            out[g] = acc
        elif scale_a.dim() == 0:
            out[g] = scale_b * (scale_a * acc)
        else:
            out[g] = scale_b[g][None, :] * (scale_a[g][:, None] * acc)
    return out.to(out_dtype).to(offs.device)
