"""Triton building blocks shared by every quantization kernel.

``fp8_scales`` turns an amax into ``(inv_scale, scale)`` and ``fp8_round`` rounds
``x * inv_scale`` onto the FP8 grid in fp32, so the final ``.to(fp8)`` cast is exact. Together
they reproduce :mod:`moe_fp8.quant.reference` bit for bit, on the GPU and in the CPU interpreter,
whose own fp32 -> fp8 cast is wrong in triton 3.6-3.9 (it drops the rounding carry: 31.9 -> 16;
ties go away from zero).

Rounding (round to nearest, ties to even, as torch's cast):

* normal range: add ``2**(S-1) - 1 + lsb`` to the fp32 bit pattern and clear its low ``S = 23 -
  mantissa_bits`` bits; a carry out of the mantissa moves into the exponent, as it should;
* subnormal range (``|x| < 2**min_normal_exp``): round ``|x| * 2**Q`` to an integer with the
  ``1.5 * 2**23`` trick and scale back; the sign is put back afterwards so that negative values
  that underflow give ``-0`` like torch (``+0`` for fnuz formats, which have no negative zero).

Kernels take the format as constexprs: ``**fp8_constexprs(fmt)`` fills them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .formats import Float8Format
from .reference import EPS

__all__ = ["fp8_constexprs", "fp8_scales", "fp8_round", "fp8_quantize"]

# Globals a @triton.jit function reads must be tl.constexpr (the interpreter would take a plain
# float; the GPU compiler does not).
_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: adding it rounds |v| < 2**22 to an integer (ties even)
_EPS = tl.constexpr(EPS)


def fp8_constexprs(fmt: Float8Format) -> dict:
    """The constexpr kernel arguments that describe ``fmt`` (pass as ``**fp8_constexprs(fmt)``)."""
    return dict(
        FP8_MAX=fmt.max,
        FP8_MANT=fmt.mantissa_bits,
        FP8_MIN_NORMAL=2.0**fmt.min_normal_exp,
        FP8_SUB_SCALE=2.0**fmt.subnormal_quantum_exp,
        FP8_NEG_ZERO=not fmt.is_fnuz,
    )


@triton.jit
def fp8_scales(amax, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """``(inv_scale, scale)`` from an fp32 amax (any shape): see ``reference.amax_to_scales``."""
    amax = tl.maximum(amax.to(tl.float32), _EPS)
    inv_scale = tl.math.div_rn(tl.zeros_like(amax) + FP8_MAX, amax)
    if POW2:
        inv_scale = (inv_scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    scale = tl.math.div_rn(tl.zeros_like(inv_scale) + 1.0, inv_scale)
    return inv_scale, scale


@triton.jit
def fp8_round(
    y,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):
    """Clamp fp32 ``y`` to +-max and round it to the FP8 grid; the result is still fp32."""
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    bits = y.to(tl.uint32, bitcast=True)
    SHIFT: tl.constexpr = 23 - FP8_MANT
    lsb = (bits >> SHIFT) & 1
    bits = (bits + ((1 << (SHIFT - 1)) - 1) + lsb) & (0xFFFFFFFF - ((1 << SHIFT) - 1))
    normal = bits.to(tl.float32, bitcast=True)
    mag = tl.abs(y)
    sub = ((mag * FP8_SUB_SCALE + _ROUND_MAGIC) - _ROUND_MAGIC) * (1.0 / FP8_SUB_SCALE)
    # Put the sign back with a bit OR: Triton's unary minus is `0 - x`, which turns -0 into +0.
    signed_sub = (sub.to(tl.uint32, bitcast=True) | (y.to(tl.uint32, bitcast=True) & 0x80000000)).to(
        tl.float32, bitcast=True
    )
    if FP8_NEG_ZERO:
        sub = signed_sub
    else:
        sub = tl.where(sub == 0.0, sub, signed_sub)
    out = tl.where(mag < FP8_MIN_NORMAL, sub, normal)
    return tl.minimum(tl.maximum(out, -FP8_MAX), FP8_MAX)


@triton.jit
def fp8_quantize(
    x,
    inv_scale,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUB_SCALE: tl.constexpr,
    FP8_NEG_ZERO: tl.constexpr,
):
    """``x * inv_scale`` (fp32) rounded onto the FP8 grid; store it with ``.to(fp8 dtype)``."""
    return fp8_round(x.to(tl.float32) * inv_scale, FP8_MAX, FP8_MANT, FP8_MIN_NORMAL, FP8_SUB_SCALE, FP8_NEG_ZERO)
