"""``torch._scaled_mm`` for the dense FP8 GEMMs, with a CPU stand-in for older torch.

The CPU kernel of ``torch._scaled_mm`` takes only per-tensor scales in torch 2.9.1 and 2.11.0
(measured here: an internal assert on ``(M, 1)`` / ``(1, N)`` scales); torch 2.13 takes row and
column scales. Where it does not, CPU tensors with row scales go through the same arithmetic in
plain torch: both operands dequantized to fp32, one fp32 matmul, rounded to bf16 (what torch's own
CPU kernel does, its ``_scaled_mm_out_cpu_emulated``). GPU tensors always take ``torch._scaled_mm``.
"""

from __future__ import annotations

import functools

import torch

from ..autograd_outputs import same_or_cast

__all__ = ["cpu_kernel_takes_row_scales", "scaled_mm"]


@functools.lru_cache(maxsize=None)
def _probe_cpu_row_scales() -> bool:
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@torch.compiler.assume_constant_result
def cpu_kernel_takes_row_scales() -> bool:
    """Whether this torch's CPU ``torch._scaled_mm`` accepts row / column scales (probed once;
    a constant to ``torch.compile``)."""
    return _probe_cpu_row_scales()


def scaled_mm(a_q: torch.Tensor, a_s: torch.Tensor, b_q_t: torch.Tensor, b_s_t: torch.Tensor,
              out_dtype: torch.dtype, fast_accum: bool = True) -> torch.Tensor:
    """``a (M, K) @ b (K, N)`` in ``out_dtype``, where ``a_q (M, K)`` and ``b_q_t (N, K)`` (``b.T``) are
    FP8 row-major with scales ``a_s (M, 1)`` / ``b_s_t (N, 1)``, or ``()`` each (tensorwise).
    ``fast_accum``: ``torch._scaled_mm``'s ``use_fast_accum`` (Hopper; other kernels ignore it).

    The FP8 GEMM writes bf16 (the only output every rowwise backend takes), then casts. An empty
    reduction (``K = 0``) gives zeros here, not from the library (torch 2.13's CPU kernel returns
    uninitialised memory for it).
    """
    if a_q.shape[1] == 0:
        return a_q.new_zeros(a_q.shape[0], b_q_t.shape[0], dtype=out_dtype)
    b_scale = b_s_t if b_s_t.dim() == 0 else b_s_t.reshape(1, -1)
    if a_q.device.type == "cpu" and b_s_t.dim() != 0 and not cpu_kernel_takes_row_scales():
        out = ((a_q.float() * a_s) @ (b_q_t.float() * b_s_t).t()).to(torch.bfloat16)
    else:
        out = torch._scaled_mm(a_q, b_q_t.t(), a_s, b_scale, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
    return same_or_cast(out, out_dtype)  # the forward's return: no alias (see autograd_outputs)
