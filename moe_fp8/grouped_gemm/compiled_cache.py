"""``mm_2d3d_cached_weight``: a compiled graph's grouped GEMM on a weight quantized once per change.

Under ``torch.compile`` an FP8 copy of a weight cannot be a value of the graph that outlives one
call: Inductor owns every buffer an op returns and reuses its memory once the graph is done with
it. So the cache lookup and the GEMM are one opaque op, and the FP8 copy never leaves it. The op
takes the parameter itself (at run time the real tensor, whose identity and version counter tell
an optimizer step apart, exactly as in eager mode), serves both layouts from the process-wide
:func:`compiled_weight_cache` (quantizing on a miss, with the settings of the eager cache), and runs
``mm_2d3d`` on the forward layout (``dgrad=False``) or the dgrad layout (``dgrad=True``). The
forward's call keeps the layouts where ``Fp8WeightCache.serve``'s rules say they will be read again
(``training``: the traced forward runs with gradients, a static argument since the op itself runs
with them off); where it keeps nothing it quantizes the forward layout and leaves the dgrad layout's
amax in the cache's record, and the backward's call quantizes the dgrad layout from it, the bytes
of the uncached path.

A weight stored transposed (Llama 4's ``(E, K, N)``) is passed as the parameter with
``transposed=True``, never as a view: a view reaches an Inductor graph's ops as a new alias whose
version counter does not follow the parameter's.

The cache is read and filled only on a CUDA device's default stream (and on the CPU): elsewhere
the op quantizes the one layout its GEMM reads and stores nothing (the bytes of that half of
``quantize_weight``). Inductor's CUDA graphs (``mode="reduce-overhead"``) warm up and capture on a
stream of their own, with every allocation in their private memory pool, whose blocks they hand
out again; a captured graph quantizes on every replay, as without a cache.
:func:`moe_fp8.optim.quantize_after_step` refreshes this cache's stale entries too.

With an amax-only cache (``Fp8WeightCache(copies=False)``) the op keeps no layout. Where
``Fp8WeightCache.serve``'s rules keep the weight's amaxes over K and over N
(:func:`cached_weight_amax`, one read of the weight per weight state), both GEMMs quantize the BF16
weight's tiles as they read them, the forward on the weight's transposed view with the row amax,
the dgrad with the column amax; where they keep nothing, the forward quantizes its layout and
leaves the column amax for the dgrad, as without a cache.
"""

# No ``from __future__ import annotations``: torch.library infers the op's schema from the annotations.
from collections.abc import Callable, Hashable
from typing import NamedTuple

import torch
from torch import Tensor

from ..kernel_backend import eager_or_custom_op
from ..quant.formats import resolve_format
from . import library as lib
from . import quant_seam
from .weight_cache import Fp8WeightCache

__all__ = ["WeightAmax", "WeightQuantizers", "cached_weight_amax", "cached_weight_layouts", "compiled_layout",
           "compiled_weight_cache", "mm_2d3d_cached_weight", "off_default_stream"]

_CACHE = Fp8WeightCache()


def compiled_weight_cache() -> Fp8WeightCache:
    """The ``Fp8WeightCache`` every compiled graph's cached GEMMs read (one per process)."""
    return _CACHE


class WeightQuantizers(NamedTuple):
    """How a compiled cached GEMM quantizes its weight ``w`` (detached): ``both(w)`` gives the four
    layouts ``(q_fwd, s_fwd, q_bwd, s_bwd)`` an entry keeps; ``forward(w, with_amax)`` the forward
    layout and, where asked and the recipe has one, the dgrad layout's amax (else ``None``);
    ``dgrad(w, amax)`` the dgrad layout, from that amax or (``None``) on its own. The same bytes
    every way."""

    both: Callable[[Tensor], tuple[Tensor, ...]]
    forward: Callable[[Tensor, bool], tuple[Tensor, Tensor, Tensor | None]]
    dgrad: Callable[[Tensor, Tensor | None], tuple[Tensor, Tensor]]


def compiled_layout(w: Tensor, key: Hashable, dgrad: bool, training: bool,
                    quantizers: WeightQuantizers) -> tuple[Tensor, Tensor]:
    """The forward (or, ``dgrad``, the dgrad) layout ``(q, s)`` of ``w`` for a compiled graph's GEMM,
    from :func:`compiled_weight_cache` under settings ``key``. The forward's call keeps both layouts
    where ``Fp8WeightCache.serve`` says (``training``: the traced forward runs with gradients); where
    it keeps nothing it leaves the dgrad layout's amax in the record, from which the backward's
    call quantizes. Off the default stream the cache is neither read nor filled."""
    wd = w.detach()
    if off_default_stream(w):
        return quantizers.dgrad(wd, None) if dgrad else quantizers.forward(wd, False)[:2]
    if dgrad:  # what the forward kept, or the amax it left, or nothing
        value, aux = _CACHE.held(w, key)
        return value[2:] if value else quantizers.dgrad(wd, aux[0] if aux else None)
    value = _CACHE.serve(w, key, quantizers.both, training)
    if value:
        return value[:2]
    q, s, amax = quantizers.forward(wd, True)
    if amax is not None:
        _CACHE.leave(w, key, (amax,))
    return q, s


_AMAX_KEY = ("amax",)  # an amax-only entry's settings: this, then ``fused``


class WeightAmax(NamedTuple):
    """A weight ``w (E, N, K)``'s amaxes, fp32: ``row (E, N)`` over K (the forward layout's scales)
    and ``col (E, K)`` over N (the dgrad layout's), kept by an amax-only ``Fp8WeightCache``."""

    row: Tensor
    col: Tensor


def cached_weight_amax(cache: Fp8WeightCache, w: Tensor, fused: bool, training: bool) -> WeightAmax | None:
    """``w``'s :class:`WeightAmax` from the amax-only ``cache`` for a forward (``training``: with
    gradients), where ``Fp8WeightCache.serve``'s rules keep it (a later micro-batch of the same
    weight state reads it: one read of ``w`` per state), else ``None``: the caller quantizes ``w``'s
    layouts as without a cache (the amax kernel's read would not be repaid)."""
    value = cache.serve(w, _AMAX_KEY + (fused,), lambda t: quant_seam.weight_amax(t, fused), training)
    return None if value is None else WeightAmax(*value)


def cached_weight_layouts(cache: Fp8WeightCache, w: Tensor, scaling: str, fmt: str, pow2: bool, fused: bool,
                          training: bool) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """``quantize_weight``'s ``(q_fwd, s_fwd, q_bwd, s_bwd)`` of ``w (E, N, K)`` from ``cache``, keyed on
    these settings, for a forward (``training``: with gradients); ``None`` where the cache keeps
    nothing for it (``Fp8WeightCache.serve``): the caller quantizes ``w`` itself."""
    return cache.serve(w, (scaling, fmt, pow2, fused), _quantizers(scaling, fmt, pow2, fused).both, training)


def _quantizers(scaling: str, fmt: str, pow2: bool, fused: bool) -> WeightQuantizers:
    f = resolve_format(fmt)

    def forward(w: Tensor, with_amax: bool) -> tuple[Tensor, Tensor, Tensor | None]:
        if with_amax and scaling == "rowwise":
            return quant_seam.quantize_weight_forward_layout(w, f, pow2, fused)
        return (*quant_seam.quantize_weight_layout(w, scaling, f, pow2, fused, False), None)

    def dgrad(w: Tensor, amax: Tensor | None) -> tuple[Tensor, Tensor]:
        if amax is not None:
            return quant_seam.quantize_weight_dgrad_layout(w, amax, f, pow2, fused)
        return quant_seam.quantize_weight_layout(w, scaling, f, pow2, fused, True)

    return WeightQuantizers(lambda w: lib.quantize_weight(w, scaling, fmt, pow2, fused), forward, dgrad)


def _mm_2d3d_cached_weight(backend: str, a: Tensor, scale_a: Tensor, param: Tensor, transposed: bool, offs: Tensor,
                           out_dtype: torch.dtype, dgrad: bool, scaling: str, fmt: str, pow2: bool,
                           fused: bool, training: bool, copies: bool = True) -> Tensor:
    w = param.transpose(1, 2) if transposed else param
    if not copies:
        return _amax_only_gemm(backend, a, scale_a, w, offs, out_dtype, dgrad, fmt, pow2, fused, training)
    q, s = compiled_layout(w, (scaling, fmt, pow2, fused), dgrad, training, _quantizers(scaling, fmt, pow2, fused))
    return lib.mm_2d3d(backend, a, scale_a, q, s, offs, out_dtype)


def _amax_only_gemm(backend: str, a: Tensor, scale_a: Tensor, w: Tensor, offs: Tensor, out_dtype: torch.dtype,
                    dgrad: bool, fmt: str, pow2: bool, fused: bool, training: bool) -> Tensor:
    """The compiled GEMM of ``w`` with an amax-only cache (``rowwise``, small groups): where the cache
    keeps ``w``'s amaxes, the GEMM quantizes ``w``'s tiles with their scales as it reads them (the
    forward on ``w.transpose(1, 2)``); where it keeps nothing, the forward quantizes its layout and
    leaves the column amax for the dgrad, which quantizes in its GEMM from it. Off the default stream
    the cache is neither read nor filled."""
    wd, off = w.detach(), off_default_stream(w)
    key = _AMAX_KEY + (fused,)
    if dgrad:
        value, aux = ((), ()) if off else _CACHE.held(w, key)
        col = value[1] if value else aux[0] if aux else quant_seam.weight_amax(wd, fused)[1]
        return lib.mm_dgrad_quantize_w(backend, a, scale_a, wd, col, offs, out_dtype, fmt, pow2)
    amax = None if off else cached_weight_amax(_CACHE, w, fused, training)
    if amax is not None:
        return lib.mm_dgrad_quantize_w(backend, a, scale_a, wd.transpose(1, 2), amax.row, offs, out_dtype, fmt, pow2)
    q, s, col = quant_seam.quantize_weight_forward_layout(wd, resolve_format(fmt), pow2, fused)
    if not off:
        _CACHE.leave(w, key, (col,))
    return lib.mm_2d3d(backend, a, scale_a, q, s, offs, out_dtype)


def off_default_stream(w: Tensor) -> bool:
    """Whether ``w`` is on a CUDA device whose current stream is not its default one."""
    return w.is_cuda and torch.cuda.current_stream(w.device) != torch.cuda.default_stream(w.device)


_op = torch.library.custom_op("moe_fp8::gg_mm_2d3d_cached_weight", _mm_2d3d_cached_weight, mutates_args=())


@_op.register_fake
def _(backend, a, scale_a, param, transposed, offs, out_dtype, dgrad, scaling, fmt, pow2, fused, training, copies=True):
    E, N, K = (param.shape[0], param.shape[2], param.shape[1]) if transposed else param.shape
    return a.new_empty(a.shape[0], K if dgrad else N, dtype=out_dtype)


mm_2d3d_cached_weight = eager_or_custom_op(_op, _mm_2d3d_cached_weight)
mm_2d3d_cached_weight.__doc__ = """``(M, N)`` forward (``a (M, K)`` FP8 rows) or ``(M, K)`` dgrad (``a (M, N)``)
grouped GEMM with ``param``'s FP8 copy from :func:`compiled_weight_cache`; ``param`` is ``(E, N, K)``
(``(E, K, N)`` with ``transposed``) in the activations' dtype; ``training``: the forward runs with
gradients; ``copies=False``: an amax-only cache (``rowwise``, groups the backend quantizes the weight
inside the GEMM for: ``quantizes_w_in_gemm``), whose kept amaxes give both GEMMs their scales. The custom
op under torch.compile."""
