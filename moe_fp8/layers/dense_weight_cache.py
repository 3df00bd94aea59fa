"""A dense weight's FP8 layouts read from an ``Fp8WeightCache``, eagerly and under ``torch.compile``.

Under gradient accumulation ``FP8Linear`` quantizes the same ``W (N, K)`` in every micro-batch; with
``cache_weights=True`` both layouts (``dense_quant.weight_layouts``) are made once per change of
``W`` and kept where they will be read again (``Fp8WeightCache.serve``: from the second micro-batch
of an optimizer step on, or the first where the previous step had two or more): the cache's entry
is keyed on the weight's identity and version counter, so an optimizer step or any in-place write
misses. Memory: both FP8 layouts, as many bytes as a BF16 copy of the weight, while kept; a forward
that keeps nothing runs as without a cache (compiled: its column amax is left in the cache's record
for the backward's dgrad layout).

Eagerly, :func:`cached_dense_layouts` looks the layouts up in the module's cache. Under
``torch.compile`` an FP8 copy cannot outlive one call of a compiled graph (``compiled_cache``), so
the lookup and the GEMM are one opaque op, :func:`dense_mm_cached_weight`
(``moe_fp8::dense_mm_cached_weight``), on the process-wide compiled cache; it takes the parameter
itself (its identity and version counter at run time tell an optimizer step apart). On a CUDA
device's side stream (CUDA-graph capture under ``mode="reduce-overhead"``) the op quantizes the one
layout its GEMM reads and stores nothing.
"""

# No ``from __future__ import annotations``: torch.library infers the op's schema from the annotations.
import torch
from torch import Tensor

from ..grouped_gemm import Fp8WeightCache
from ..grouped_gemm.compiled_cache import WeightQuantizers, compiled_layout
from ..kernel_backend import eager_or_custom_op
from ..quant.formats import Float8Format, resolve_format
from .dense_quant import weight_dgrad_layout, weight_forward_layout, weight_layouts
from .scaled_mm import scaled_mm

__all__ = ["cached_dense_layouts", "dense_mm_cached_weight"]


def cached_dense_layouts(cache: Fp8WeightCache, weight: Tensor, scaling: str, fmt: Float8Format, pow2: bool,
                         kernels: bool, training: bool) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """``weight_layouts(weight, ...)`` from ``cache`` for a forward (``training``: with gradients), or
    ``None`` where the cache keeps nothing for it (``Fp8WeightCache.serve``): the caller quantizes
    ``weight`` itself. ``weight`` is ``(N, K)``, the parameter or its ``cache.stand_in``."""
    return cache.serve(weight, _key(scaling, fmt.name, pow2, kernels), _quantizers(scaling, fmt, pow2, kernels).both,
                       training)


def _key(scaling: str, fmt: str, pow2: bool, kernels: bool) -> tuple:
    return "dense", scaling, fmt, pow2, kernels


def _quantizers(scaling: str, fmt: Float8Format, pow2: bool, kernels: bool) -> WeightQuantizers:
    return WeightQuantizers(
        lambda w: weight_layouts(w, scaling, fmt, pow2, kernels),
        lambda w, with_amax: weight_forward_layout(w, scaling, fmt, pow2, kernels, with_amax=with_amax),
        lambda w, amax: weight_dgrad_layout(w, scaling, fmt, pow2, kernels, amax),
    )


def _dense_mm_cached_weight(a: Tensor, scale_a: Tensor, param: Tensor, dgrad: bool, scaling: str, fmt: str,
                            pow2: bool, kernels: bool, out_dtype: torch.dtype, fast_accum: bool,
                            training: bool) -> Tensor:
    quantizers = _quantizers(scaling, resolve_format(fmt), pow2, kernels)
    q, s = compiled_layout(param, _key(scaling, fmt, pow2, kernels), dgrad, training, quantizers)
    return scaled_mm(a, scale_a, q, s, out_dtype, fast_accum)


_op = torch.library.custom_op("moe_fp8::dense_mm_cached_weight", _dense_mm_cached_weight, mutates_args=())


@_op.register_fake
def _(a, scale_a, param, dgrad, scaling, fmt, pow2, kernels, out_dtype, fast_accum, training):
    return a.new_empty(a.shape[0], param.shape[1] if dgrad else param.shape[0], dtype=out_dtype)


dense_mm_cached_weight = eager_or_custom_op(_op, _dense_mm_cached_weight)
dense_mm_cached_weight.__doc__ = """``(M, N)`` forward (``a (M, K)`` FP8 rows) or ``(M, K)`` dgrad (``a (M, N)``)
GEMM with the FP8 layouts of ``param (N, K)`` (in the activations' dtype) from the process-wide
:func:`compiled_weight_cache`; ``fmt`` by name; ``training``: the forward runs with gradients. The
custom op under torch.compile."""
