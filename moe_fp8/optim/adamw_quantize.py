"""``adamw_quantize``: one AdamW step of a 3D expert weight that also writes its FP8 copies.

The Triton kernel (:mod:`.adamw_kernel`) updates ``p`` and its states and, from the same pass,
writes the forward layout of the new weight and its amax over N; the dgrad layout then comes from
``triton_quantize_expert_colwise_from_amax`` (one read and one write of the new weight). Where
Triton does not run, :func:`adamw_quantize_reference` gives the same results (the update in
fp32, the reference quantizers): the FP8 bytes and scales equal ``quant_seam.quantize_weight``'s
``rowwise`` pair of the updated weight byte for byte.
"""

from __future__ import annotations

import torch

from ..checks import check_same_device, check_tensor
from ..kernel_backend import triton_runs_on
from ..launch import zeroed
from ..quant import ops
from ..quant import reference as ref
from ..quant.formats import resolve_format
from .adamw_kernel import adamw_fits, launch_adamw_quantize

__all__ = ["adamw_hyper", "adamw_quantize", "adamw_quantize_reference", "adamw_update_reference"]

PARAM_DTYPES = (torch.bfloat16, torch.float32)
STATE_DTYPES = (torch.float32, torch.bfloat16)
Quantized = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def adamw_hyper(*, step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> dict:
    """The kernel's scalars, computed in double as torch's single-tensor AdamW does (``step`` >= 1:
    the count after this update)."""
    if step < 1:
        raise ValueError(f"step: expected the step count after this update (>= 1), got {step}")
    beta1, beta2 = float(betas[0]), float(betas[1])
    lr = float(lr)
    return dict(decay=1.0 - lr * float(weight_decay), beta1=beta1, one_minus_beta1=1.0 - beta1, beta2=beta2,
                one_minus_beta2=1.0 - beta2, step_size=lr / (1.0 - beta1**step),
                bc2_sqrt=(1.0 - beta2**step) ** 0.5, eps=float(eps))


def _check(p, grad, exp_avg, exp_avg_sq, quant_dtype) -> None:
    check_tensor("p", p, dtypes=PARAM_DTYPES, ndim=3)
    shape = tuple(p.shape)
    check_tensor("grad", grad, dtypes=(p.dtype,), shape=shape)
    check_tensor("exp_avg", exp_avg, dtypes=STATE_DTYPES, shape=shape)
    check_tensor("exp_avg_sq", exp_avg_sq, dtypes=(exp_avg.dtype,), shape=shape)
    check_same_device(p=p, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    for name, t in (("p", p), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
    if quant_dtype not in PARAM_DTYPES:
        raise TypeError(f"quant_dtype: expected one of {PARAM_DTYPES}, got {quant_dtype}")
    if not adamw_fits(p.shape[2]):
        raise ValueError(f"p: rows of K = {p.shape[2]} do not fit the kernel (K <= 16384)")


@torch.no_grad()
def adamw_quantize(
    p: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: dict,
    *,
    fmt=None,
    pow2: bool = False,
    quant_dtype: torch.dtype | None = None,
    quantize: bool = True,
    hw_cast: bool | None = None,
    config: dict | None = None,
) -> Quantized | None:
    """AdamW-update ``p`` in place and return the ``rowwise`` FP8 copies of the new weight.

    Args:
        p: ``(E, N, K)`` contiguous expert weight (``nn.Linear`` layout), bf16 or fp32, updated in place.
        grad: like ``p``; exp_avg, exp_avg_sq: like ``p`` in fp32 (or both bf16: the update still
            runs in fp32, the moments are rounded once), updated in place.
        hyper: :func:`adamw_hyper` of this step.
        fmt: FP8 format (``None``: detected for ``p``'s device); pow2: power-of-two scales.
        quant_dtype: what the GEMMs cast the weight to before quantizing (``None``: ``p``'s dtype).
        quantize: ``False``: the update alone, returns ``None``.
        hw_cast, config: the kernel's FP8 cast (``None``: the hardware cast where it is exact) and
            launch config (``adamw_kernel.DEFAULT_CONFIG``'s keys); neither changes a result.
    Returns:
        ``(q_fwd (E, N, K), s_fwd (E, N), q_bwd (E, K, N), s_bwd (E, K))``: equal byte for byte to
        ``quantize_weight(p.to(quant_dtype), "rowwise", fmt, pow2, ...)`` of the updated ``p``.
    """
    quant_dtype = p.dtype if quant_dtype is None else quant_dtype
    _check(p, grad, exp_avg, exp_avg_sq, quant_dtype)
    f = resolve_format(fmt, p.device)
    if not triton_runs_on(p):
        return adamw_quantize_reference(p, grad, exp_avg, exp_avg_sq, hyper, fmt=f, pow2=pow2,
                                        quant_dtype=quant_dtype, quantize=quantize)
    E, N, K = p.shape
    out = None
    if quantize:
        # the amax as int32 bits, viewed as fp32 only after the launch (the kernel mutates what it is given)
        out = (torch.empty((E, N, K), dtype=f.torch_dtype, device=p.device),
               torch.empty((E, N), dtype=torch.float32, device=p.device),
               zeroed((E, K), torch.int32, p.device))
    launch_adamw_quantize(p, grad, exp_avg, exp_avg_sq, hyper, out, f, pow2, quant_dtype, hw_cast, config)
    if not quantize:
        return None
    w = p if quant_dtype == p.dtype else p.to(quant_dtype)
    return out[0], out[1], *ops.triton_quantize_expert_colwise_from_amax(w, out[2].view(torch.float32), f, pow2)


@torch.no_grad()
def adamw_update_reference(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                           hyper: dict) -> None:
    """The update of :func:`adamw_quantize` in pure torch (fp32 math; ``p`` and the moments rounded
    once to their dtypes)."""
    h = hyper
    g = grad.float()
    w = p.float() * h["decay"]
    m, v = exp_avg.float(), exp_avg_sq.float()
    m = m + h["one_minus_beta1"] * (g - m)
    v = v * h["beta2"] + h["one_minus_beta2"] * g * g
    denom = v.sqrt() / h["bc2_sqrt"] + h["eps"]
    p.copy_(w - h["step_size"] * (m / denom))
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)


@torch.no_grad()
def adamw_quantize_reference(
    p: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: dict,
    *,
    fmt=None,
    pow2: bool = False,
    quant_dtype: torch.dtype | None = None,
    quantize: bool = True,
) -> Quantized | None:
    """:func:`adamw_quantize` in pure torch: :func:`adamw_update_reference`, then the reference
    ``quantize_expert_colwise`` of the new weight in both layouts."""
    quant_dtype = p.dtype if quant_dtype is None else quant_dtype
    _check(p, grad, exp_avg, exp_avg_sq, quant_dtype)
    adamw_update_reference(p, grad, exp_avg, exp_avg_sq, hyper)
    if not quantize:
        return None
    f = resolve_format(fmt, p.device)
    w = p.to(quant_dtype)
    return (*ref.quantize_expert_colwise(w, f, pow2=pow2),
            *ref.quantize_expert_colwise(w, f, pow2=pow2, transposed=True))
