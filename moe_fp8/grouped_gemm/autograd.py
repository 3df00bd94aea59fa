"""``FP8GroupedMM``: the autograd function behind ``fp8_grouped_mm``.

``out[rows of g] = x[rows of g] @ w[g].T``. Per recipe:

| recipe          | forward                    | dgrad ``dx = dout @ w[g]``     | wgrad ``dw[g] = dout_g^T x_g``   |
|-----------------|----------------------------|--------------------------------|----------------------------------|
| rowwise         | x rows, w (expert, N) cols | dout rows, w (expert, K) cols  | FP8, per-group column scales     |
| rowwise_gw_hp   | as rowwise                 | as rowwise                     | BF16 ``torch._grouped_mm``       |
| tensorwise      | x tensor, w per expert     | dout tensor, w per expert      | FP8, one scale per operand       |
| blockwise       | x 1x128, w 128x128         | dout 1x128, w^T 128x128        | BF16                             |
| bf16            | ``torch._grouped_mm``      | ``torch._grouped_mm``          | ``torch._grouped_mm``            |

The weights are quantized once per call in both layouts (or come from an ``Fp8WeightCache``)
and only their FP8 copies are saved for backward, with ``x`` (the wgrad operand; in FP8 for the
``tensorwise`` FP8 wgrad, whose operands are the forward's FP8 ``x`` and the dgrad's FP8 grad_out,
laid out again, not quantized again) and ``offs``;
except (``save_w``) when no cache serves a ``rowwise`` weight that the caller keeps alive anyway
(a parameter or a view of one): then the forward quantizes the forward layout and takes the dgrad
layout's amax (over N) from the same read, ``w`` itself and that ``(E, K)`` amax are saved, and
the backward's dgrad quantizes ``w``'s tiles with those scales as its GEMM reads them (our Triton
kernel, where the backend's ``quantizes_w_in_gemm`` says so: small groups) or quantizes the dgrad
layout from them first (the same bytes, one read and one write of ``w``), so no FP8 weight copy
lives from forward to backward;
and except (``WeightAmax``) when an amax-only cache holds the weight's amaxes over K and over N:
then both GEMMs quantize ``w``'s tiles as they read them (the forward on ``w.transpose(1, 2)``
with the row amax), and ``w`` and the column amax are saved;
and except (``cached``) under torch.compile with a cache: the forward and dgrad GEMMs read the
weight's FP8 layouts (or, amax-only, its amaxes) inside one opaque op each (``compiled_cache``),
and only the parameter is saved.
With ``rowwise`` FP8 wgrad and both gradients wanted, the forward's row quantization of ``x`` (or,
when ``x`` comes quantized from upstream and its groups average at least
``UPSTREAM_AMAX_MIN_ROWS_PER_GROUP`` rows, a read of ``x`` alone) and the dgrad's of grad_out also
reduce their per-group column amaxes, from which the wgrad writes both operands without a
reduction of its own (fused kernels and rows of at most 16384 elements; otherwise the wgrad
reduces them).
Nothing here syncs with the host; the backends say which layouts they take. Rows at or past
``offs[-1]`` belong to no group and never reach a result: with one scale per tensor
(``tensorwise``) the amax leaves them out (they may hold anything, even NaN).
"""

from __future__ import annotations

import torch

from .. import valid_offsets
from ..autograd_outputs import same_or_cast
from ..quant.kernels.rowwise import col_amax_fits
from ..quant.reference import dequantize
from . import library as lib
from .backends import get_backend
from .compiled_cache import WeightAmax, mm_2d3d_cached_weight
from .grad_accumulation import adds_in_place
from .padding import padded_offsets, padded_rows
from .quantized_weight import QuantizedExpertWeight

__all__ = ["FP8GroupedMM", "dequantize_rows", "grouped_mm_backward", "grouped_mm_forward", "takes_grad_rows"]

NONE_GRADS = (None,) * 14  # gradients of the arguments of ``apply`` after ``x`` and ``w``
_DEQUANTIZE_ELEMENTS = 1 << 26  # elements per chunk of dequantize_rows (its fp32 temporary: 256 MB)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(q.float() * scale[:, None]).to(dtype)``: rowwise FP8 ``q (M, K)`` with fp32 ``scale (M,)``
    back to ``(M, K)`` in ``dtype`` (one rounding), in row chunks that bound the fp32 temporary."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    step = max(1, _DEQUANTIZE_ELEMENTS // max(q.shape[1], 1))
    for i in range(0, q.shape[0], step):
        out[i : i + step] = dequantize(q[i : i + step], scale[i : i + step])
    return out


def _routed_rows(offs: torch.Tensor, scaling: str | None) -> torch.Tensor | None:
    """For a ``tensorwise`` amax, the rows it covers: ``offs[-1:]`` (read on the device; the rows
    past ``offs[-1]`` may hold anything, even NaN, and enter no GEMM); ``None`` for the other
    recipes (their scales are per row or group)."""
    return offs[-1:] if scaling == "tensorwise" else None


def _rows_give_group_amax(fused: bool, k: int, n: int) -> bool:
    """Whether the row quantizations of ``x (M, k)`` and grad_out ``(M, n)`` can also reduce their
    per-group column amaxes from the same read: the fused kernels (``fused``), rows of at most
    16384 elements (``col_amax_fits``). Otherwise the wgrad's dual reduces them, as it would anyway
    (another reduction here would cost a pass, and the torch one syncs with the host)."""
    return fused and col_amax_fits(k) and col_amax_fits(n)


# With x quantized upstream, its group amax costs one more read of x and one more launch (76 µs of
# host time per call on the H200's host). Uncached FP8MoE step at 4096 tokens on one H200
# (2026-11-30, ``benchmarks/results/layer_upstream_amax_ab.md``): DeepSeek-V3 E=8 (4096 rows per
# group) 10.42-10.45 -> 10.17 ms in CUDA graphs, 11.54-11.61 -> 11.36-11.46 eager; Qwen3-30B-A3B
# (256 rows per group) 4.16 -> 4.15 ms in graphs but 5.08-6.57 -> 5.47-6.99 eager (host-bound).
# The threshold lies between the two measured points; it was not swept.
UPSTREAM_AMAX_MIN_ROWS_PER_GROUP = 1024


def _upstream_amax_pays(m: int, groups: int) -> bool:
    """Whether to read an upstream-quantized ``x (m, K)`` once more for its group amax: at least
    ``UPSTREAM_AMAX_MIN_ROWS_PER_GROUP`` rows per group on average (static shapes only)."""
    return m >= UPSTREAM_AMAX_MIN_ROWS_PER_GROUP * groups


class FP8GroupedMM(torch.autograd.Function):
    """``apply(x, w, offs, w_quant, x_quant, scaling, fp8_wgrad, backend, fmt, pow2, out_dtype, save_w,
    save_x_fp8, cached, wgrad_offs)``.

    ``scaling`` is ``None`` for the BF16 recipe; ``w_quant`` is the 4-tuple of
    ``quant_seam.quantize_weight`` (from a cache), a ``WeightAmax`` of ``w`` (``rowwise``, an
    amax-only cache, groups the backend's ``quantizes_w_in_gemm`` takes), or ``None`` to quantize
    here; ``x_quant`` is
    ``x``'s rowwise ``(q, scale)`` made upstream, or ``None`` to quantize here. A
    ``QuantizedExpertWeight`` ``w`` gives its forward layout in forward and its dgrad layout in
    backward (read then: its owner gathers it again in between). ``save_x_fp8``
    (with ``x_quant``): save ``x_quant``, not ``x``, and give the wgrad ``x_quant`` dequantized
    (:func:`dequantize_rows`); ``x`` is then never read. ``save_w`` (only
    with ``scaling="rowwise"`` and ``w_quant=None``): save ``w`` (and its amax over N) and quantize
    its dgrad layout in backward instead of saving that layout from forward. ``cached`` (FP8
    recipes, ``w_quant=None``, a plain ``w``): ``None``, or ``(transposed, training, copies)``: whether
    ``w`` is the transposed view of the parameter whose FP8 layouts (``copies=False``: amaxes)
    :func:`.compiled_cache.mm_2d3d_cached_weight` reads, and whether the forward runs with gradients.
    ``wgrad_offs``: the weight gradient's group end offsets over the same rows, or ``None``
    (``offs``); rows whose group differs between the two are zero in ``x`` and in the output's
    gradient (``fp8_grouped_mm``). ``grad_into``: ``None``, or a tensor shaped like ``w`` (its
    parameter's ``.grad``) that the backward adds the weight gradient to in place, returning no
    gradient for ``w``.
    """

    @staticmethod
    def forward(ctx, x, w, offs, w_quant, x_quant, scaling, fp8_wgrad, backend, fmt, pow2, out_dtype, save_w,
                save_x_fp8=False, cached=None, wgrad_offs=None, grad_into=None):
        out, saved = grouped_mm_forward(ctx, x, w, offs, w_quant, x_quant, scaling, fp8_wgrad, backend, fmt, pow2,
                                        out_dtype, save_w, save_x_fp8, cached, wgrad_offs, grad_into)
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return (*grouped_mm_backward(ctx, ctx.saved_tensors, grad_out), *NONE_GRADS)


def grouped_mm_forward(ctx, x, w, offs, w_quant, x_quant, scaling, fp8_wgrad, backend, fmt, pow2, out_dtype, save_w,
                       save_x_fp8=False, cached=None, wgrad_offs=None, grad_into=None) -> tuple[torch.Tensor, tuple]:
    """:class:`FP8GroupedMM`'s forward on the autograd context ``ctx`` of any Function whose first
    two inputs are ``x`` and ``w``: ``(out, tensors to save)``; the caller saves them (with its own)
    and hands them back to :func:`grouped_mm_backward`. ``grad_into`` is kept on ``ctx`` (not saved:
    other backwards add to it in between)."""
    ctx.scaling, ctx.fp8_wgrad, ctx.backend, ctx.fmt, ctx.pow2 = scaling, fp8_wgrad, backend, fmt, pow2
    ctx.w_dtype = w.dtype
    ctx.dw_transposed = transposed_layout(w) is True
    ctx.grad_into = grad_into
    ctx.empty = x.shape[0] == 0
    if ctx.empty:  # static shape: no GEMM to run, dw = 0
        return x.new_zeros(0, w.shape[1], dtype=out_dtype), (x, w)
    wgrad_offs = offs if wgrad_offs is None else wgrad_offs
    if scaling is None:
        return same_or_cast(lib.bf16_mm_2d3d(backend, x, w, offs, True), out_dtype), (x, w, offs, wgrad_offs)
    fused = get_backend(backend).fused_quant
    ctx.w_saved = save_w  # fp8_grouped_mm sets it only for rowwise without w_quant (WeightAmax sets it below)
    ctx.w_operands = None
    ctx.cached = cached
    w_amax = w_quant if isinstance(w_quant, WeightAmax) else None
    if w_amax is not None:  # both GEMMs quantize w's tiles themselves, with the scales of its kept amaxes
        ctx.w_saved = True
        q_fwd, s_fwd, q_bwd, s_bwd = w.transpose(1, 2), w_amax.row, w, w_amax.col
    elif cached is not None:  # the parameter itself: the GEMMs read its FP8 layouts from the cache
        param = w.transpose(1, 2) if cached[0] else w
        q_fwd, s_fwd, q_bwd, s_bwd = param, None, param, None
    elif ctx.w_saved:
        q_fwd, s_fwd, col_amax = lib.quantize_weight_forward_layout(w, fmt, pow2, fused)
        q_bwd, s_bwd = w, col_amax
    elif isinstance(w, QuantizedExpertWeight):  # FP8 operands made elsewhere: the dgrad layout read in backward
        q_fwd, s_fwd = w.layout("forward", fmt, pow2)
        q_bwd = s_bwd = None
        ctx.w_operands = w.operands
    else:
        if w_quant is None:
            w_quant = lib.quantize_weight(w, scaling, fmt, pow2, fused)
        q_fwd, s_fwd, q_bwd, s_bwd = w_quant
    # x's per-group column amax, so that the wgrad writes x, and grad_out (whose amax the dgrad's
    # row quantization takes alike), without a reduction of its own
    x_amax = None
    # x_quant alone is saved (save_x_fp8): x is never read, and the wgrad reduces its own amaxes
    ctx.x_deq = save_x_fp8
    want_amax = _reduces_x_group_amax(x, w.shape[1], offs.shape[0], x_quant is not None, scaling, fp8_wgrad, fused,
                                      save_x_fp8, *ctx.needs_input_grad[:2])
    if x_quant is not None:
        xq, xs = x_quant
        if want_amax:  # one more read of x
            x_amax = lib.group_amax(x, offs, fused)
    elif want_amax:  # from x's row quantization, the same read
        xq, xs, x_amax = lib.quantize_activation_group_amax(x, offs, fmt, pow2, fused)
    else:
        xq, xs = lib.quantize_activation(x, scaling, fmt, pow2, fused, _routed_rows(offs, scaling))
    if cached is not None:
        out = mm_2d3d_cached_weight(backend, xq, xs, q_fwd, cached[0], offs, out_dtype, False, scaling, fmt, pow2,
                                    fused, *cached[1:])
    elif w_amax is not None:
        out = lib.mm_dgrad_quantize_w(backend, xq, xs, q_fwd, s_fwd, offs, out_dtype, fmt, pow2)
    else:
        out = lib.mm_2d3d(backend, xq, xs, q_fwd, s_fwd, offs, out_dtype)
    ctx.x_dtype = x.dtype
    # tensorwise FP8 wgrad takes x's FP8 bytes as they are (one scale for the tensor): x is saved
    # in FP8, with its scale in the amax's place
    ctx.x_fp8 = scaling == "tensorwise" and fp8_wgrad
    keep_fp8 = ctx.x_fp8 or ctx.x_deq
    return out, (xq if keep_fp8 else x, offs, q_bwd, s_bwd, xs if keep_fp8 else x_amax, wgrad_offs)


def _reduces_x_group_amax(x: torch.Tensor, n: int, groups: int, upstream: bool, scaling: str, fp8_wgrad: bool,
                          fused: bool, save_x_fp8: bool, need_dx: bool, need_dw: bool) -> bool:
    """Whether the forward reduces ``x``'s per-group column amax for the rowwise FP8 wgrad (then the
    dgrad's row quantization of grad_out reduces grad_out's alike); ``upstream``: ``x``'s rows
    were quantized upstream (the amax costs a read of ``x`` of its own)."""
    return (scaling == "rowwise" and fp8_wgrad and need_dx and need_dw and not save_x_fp8
            and _rows_give_group_amax(fused, x.shape[1], n) and (not upstream or _upstream_amax_pays(x.shape[0], groups)))


def takes_grad_rows(args: tuple) -> bool:
    """Whether the backward of ``FP8GroupedMM.apply(*args)`` (``args``: the 16 of
    ``grouped_mm_arguments``), run now, takes grad_out's rowwise FP8 from upstream
    (:func:`grouped_mm_backward`'s ``g_fp8``): row scales, the dgrad wanted, and no per-group column
    amax of grad_out wanted from its row quantization (the FP8 wgrad with x's amax from the
    forward reduces it there). Known before the forward runs."""
    x, w, offs, _, x_quant, scaling, fp8_wgrad, backend, _, _, _, _, save_x_fp8, _, _, _ = args
    need_dx = torch.is_grad_enabled() and x.requires_grad
    need_dw = torch.is_grad_enabled() and w.requires_grad
    if x.shape[0] == 0 or scaling != "rowwise" or not need_dx:
        return False
    fused = get_backend(backend).fused_quant
    return not _reduces_x_group_amax(x, w.shape[1], offs.shape[0], x_quant is not None, scaling, fp8_wgrad, fused,
                                     save_x_fp8, need_dx, need_dw)


def grouped_mm_backward(ctx, saved: tuple, grad_out: torch.Tensor,
                        g_fp8: tuple[torch.Tensor, torch.Tensor] | None = None
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dw)`` from :func:`grouped_mm_forward`'s ``ctx`` and saved tensors; ``g_fp8``: grad_out's
    rowwise FP8 ``(q, scale)``, made upstream, for the dgrad (only where :func:`takes_grad_rows` said so).
    With ``ctx.grad_into`` the weight gradient is added to it and ``dw`` is ``None``."""
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    into = ctx.grad_into if need_dw else None
    if into is not None and not adds_in_place(into):
        into = ctx.grad_into = None  # autograd takes the gradient, here and in a retained graph's later backwards
    if ctx.empty:
        x, w = saved
        dx = torch.zeros_like(x) if need_dx else None
        dw = torch.zeros_like(w) if need_dw and into is None else None
        return dx, dw
    grad_out = grad_out.contiguous()
    if ctx.scaling is None:
        x, w, offs, w_offs = saved
        g = grad_out.to(x.dtype)
        dx = lib.bf16_mm_2d3d(ctx.backend, g, w, offs, False) if need_dx else None
        dw = _wgrad_gemm(ctx, g, None, x, None, offs if into is not None else w_offs) if need_dw else None
        return dx, dw
    x, offs, q_bwd, s_bwd, x_extra, w_offs = saved
    # groups that gain nothing leave an accumulated gradient untouched: the forward's groups, not the
    # weight gradient's (whose empty experts hold a zero row each, so that a library GEMM writes their zeros)
    w_offs = offs if into is not None else w_offs
    if ctx.x_fp8:  # tensorwise: the wgrad reuses the FP8 x of the forward and grad_out of the dgrad
        dx, g_fp8 = _dgrad(ctx, grad_out, q_bwd, s_bwd, offs, False) if need_dx else (None, None)
        dw = _wgrad_tensorwise(ctx, grad_out, g_fp8, (x, x_extra), w_offs) if need_dw else None
        return dx, dw
    if ctx.x_deq:  # the saved FP8 rows of x stand in for x: dequantized, in x's dtype
        x, x_extra = dequantize_rows(x, x_extra, ctx.x_dtype) if need_dw else x, None
    # with x's amax from the forward, the dgrad's row quantization of grad_out reduces grad_out's
    # per-group column amax too (only both together pay: BENCHMARKS.md)
    group_amax = x_extra is not None and need_dx and need_dw
    if g_fp8 is not None and group_amax:
        raise ValueError("g_fp8: this backward reduces grad_out's group amax in its own row quantization")
    dx, g_fp8 = _dgrad(ctx, grad_out, q_bwd, s_bwd, offs, group_amax, g_fp8) if need_dx else (None, None)
    g_amax = g_fp8[2] if group_amax else None
    # the group amaxes are those of the wgrad's groups too: the rows that change group are zero
    dw = _wgrad(ctx, grad_out, x, w_offs, g_amax, x_extra if group_amax else None) if need_dw else None
    return dx, dw


def _dgrad(ctx, grad_out: torch.Tensor, q_bwd: torch.Tensor, s_bwd: torch.Tensor | None, offs: torch.Tensor,
           group_amax: bool, upstream: tuple[torch.Tensor, torch.Tensor] | None = None
           ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``dx[rows of g] = grad_out[rows of g] @ w[g]``, ``(M, K)`` in x's dtype, and grad_out's FP8
    ``(q, scale)``, with ``group_amax`` also its per-group column amax ``(E, N)`` fp32. ``q_bwd,
    s_bwd``: the saved dgrad layout, or ``w`` and its amax over N (``ctx.w_saved``) to quantize it
    here (inside the GEMM where the backend can, else a layout freed on return, before the wgrad
    runs), or ``None`` to read it from the
    ``QuantizedExpertWeight``'s operands (``ctx.w_operands``), or the parameter whose dgrad layout
    the compiled cache holds (``ctx.cached``). ``upstream``: grad_out's rowwise FP8, quantized by
    the kernel that made grad_out (not quantized again here)."""
    backend = get_backend(ctx.backend)
    fused = backend.fused_quant
    if upstream is not None:
        g_fp8 = upstream
    elif group_amax:
        g_fp8 = lib.quantize_activation_group_amax(grad_out, offs, ctx.fmt, ctx.pow2, fused)
    else:
        rows = _routed_rows(offs, ctx.scaling)
        g_fp8 = lib.quantize_activation(grad_out, ctx.scaling, ctx.fmt, ctx.pow2, fused, rows)
    if ctx.w_saved and backend.quantizes_w_in_gemm(grad_out.shape[0], offs.shape[0]):
        # the GEMM quantizes w's tiles as it reads them: no FP8 dgrad layout is written
        dx = lib.mm_dgrad_quantize_w(ctx.backend, g_fp8[0], g_fp8[1], q_bwd, s_bwd, offs, ctx.x_dtype, ctx.fmt,
                                     ctx.pow2)
        return dx, g_fp8
    if ctx.w_saved:  # after grad_out's scales: made in the backward even when compiled (quant_seam)
        q_bwd, s_bwd = lib.quantize_weight_dgrad_layout(q_bwd, s_bwd, ctx.fmt, ctx.pow2, fused, g_fp8[1])
    elif ctx.w_operands is not None:
        q_bwd, s_bwd = ctx.w_operands.get("dgrad", ctx.w_dtype, ctx.fmt, ctx.pow2)
    if ctx.cached is not None:
        dx = mm_2d3d_cached_weight(ctx.backend, g_fp8[0], g_fp8[1], q_bwd, ctx.cached[0], offs, ctx.x_dtype, True,
                                   ctx.scaling, ctx.fmt, ctx.pow2, fused, *ctx.cached[1:])
        return dx, g_fp8
    return lib.mm_2d3d(ctx.backend, g_fp8[0], g_fp8[1], q_bwd, s_bwd, offs, ctx.x_dtype), g_fp8


def _wgrad_padding(backend, m: int, offs: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """The padded wgrad offsets and buffer rows the backend's wgrad GEMM takes (``None, 0``: unpadded)."""
    if backend.pads_wgrad_groups:
        return valid_offsets.padded_once(offs, padded_offsets), padded_rows(m, offs.numel())
    return None, 0


def _wgrad(ctx, grad_out: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, g_amax: torch.Tensor | None,
           x_amax: torch.Tensor | None) -> torch.Tensor:
    """``dw[g] = grad_out_g^T @ x_g``, ``(E, N, K)`` in the weights' dtype; ``g_amax``, ``x_amax``:
    grad_out's and x's per-group column amaxes (from the dgrad and the forward; ``None``: reduced
    here)."""
    if not ctx.fp8_wgrad:
        dw = _wgrad_gemm(ctx, grad_out.to(x.dtype), None, x, None, offs)
        return None if dw is None else dw.to(ctx.w_dtype)
    backend = get_backend(ctx.backend)
    p_offs, rows = _wgrad_padding(backend, x.shape[0], offs)
    qa, sa, qb, sb = lib.quantize_wgrad_operands(
        grad_out, x, offs, ctx.fmt, ctx.pow2, backend.fused_quant, p_offs, rows, g_amax, x_amax
    )
    return _wgrad_gemm(ctx, qa, sa, qb, sb, offs if p_offs is None else p_offs)


def _wgrad_gemm(ctx, a: torch.Tensor, sa: torch.Tensor | None, b: torch.Tensor, sb: torch.Tensor | None,
                offs: torch.Tensor) -> torch.Tensor | None:
    """``a_g^T @ b_g``, ``(E, N, K)``: FP8 operands with their scales (in the weights' dtype), or BF16
    ones with ``None``; or ``None`` after adding it to ``ctx.grad_into``. For a column-major ``w``
    (the transposed view of ``(E, K, N)`` weights) the GEMM computes ``b_g^T @ a_g`` and returns its
    transposed view, in ``w``'s strides: the weights' gradient then comes out in their own
    layout, which autograd keeps and adds to without a strided copy."""
    if ctx.grad_into is not None:
        lib.mm_2d2d_into(ctx.backend, ctx.grad_into, a, sa, b, sb, offs)
        return None
    if ctx.dw_transposed:
        a, sa, b, sb = b, sb, a, sa
    if sa is None:
        dw = lib.bf16_mm_2d2d(ctx.backend, a, b, offs)
    else:
        dw = lib.mm_2d2d(ctx.backend, a, sa, b, sb, offs, ctx.w_dtype)
    return dw.transpose(1, 2) if ctx.dw_transposed else dw


def transposed_layout(w: torch.Tensor) -> bool | None:
    """Whether ``w (E, N, K)`` is the transposed view of ``(E, K, N)`` weights (False: ``nn.Linear``
    layout; ``None``: neither, so ``fp8_grouped_mm`` takes a contiguous copy)."""
    E, N, K = w.shape
    if w.stride(2) == 1 and w.stride(1) == K:
        return False
    if w.stride(1) == 1 and w.stride(2) == N:
        return True
    return None


def _wgrad_tensorwise(ctx, grad_out: torch.Tensor, g_fp8: tuple[torch.Tensor, torch.Tensor] | None,
                      x_fp8: tuple[torch.Tensor, torch.Tensor], offs: torch.Tensor) -> torch.Tensor:
    """The ``tensorwise`` FP8 wgrad from the FP8 grad_out of the dgrad (``g_fp8``; ``None``:
    quantized here) and x of the forward (``x_fp8``): their bytes laid out for the wgrad GEMM."""
    backend = get_backend(ctx.backend)
    fused = backend.fused_quant
    if g_fp8 is None:
        rows = _routed_rows(offs, "tensorwise")
        g_fp8 = lib.quantize_activation(grad_out, "tensorwise", ctx.fmt, ctx.pow2, fused, rows)
    (gq, gs), (xq, xs) = g_fp8, x_fp8
    p_offs, rows = _wgrad_padding(backend, xq.shape[0], offs)
    qa = lib.wgrad_operand_layout(gq, offs, fused, p_offs, rows)
    qb = lib.wgrad_operand_layout(xq, offs, fused, p_offs, rows)
    return _wgrad_gemm(ctx, qa, gs, qb, xs, offs if p_offs is None else p_offs)
