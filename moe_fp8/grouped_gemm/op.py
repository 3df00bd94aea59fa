"""``fp8_grouped_mm``: the public FP8 grouped GEMM of MoE experts (differentiable)."""

from __future__ import annotations

import os

import torch

from .. import valid_offsets
from ..checks import check_multiple_of, check_offsets, check_offsets_values, check_same_device, check_tensor
from ..quant.formats import resolve_format
from ..quant.recipes import Float8Recipe, get_recipe
from .autograd import FP8GroupedMM, transposed_layout
from .backends import select_backend
from .compiled_cache import cached_weight_amax, cached_weight_layouts
from .quantized_weight import QuantizedExpertWeight
from .weight_cache import Fp8WeightCache

__all__ = ["CHECK_OFFSETS_ENV_VAR", "fp8_grouped_mm", "grouped_mm_arguments"]

#: set to 1 to check GPU offsets' values (non-decreasing, <= M) at the cost of a host sync per call.
CHECK_OFFSETS_ENV_VAR = "MOE_FP8_CHECK_OFFSETS"
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fp8_grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    *,
    recipe: str | Float8Recipe = "rowwise",
    backend: str | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    weight_cache: Fp8WeightCache | None = None,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
    save_x_fp8: bool = False,
    wgrad_offs: torch.Tensor | None = None,
    grad_into: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped ``x @ w[g].T`` over the token groups of ``offs``, with FP8 GEMMs.

    ``out[offs[g-1]:offs[g]] = x[offs[g-1]:offs[g]] @ w[g].T`` (``offs[-1]`` taken as 0), the
    MoE expert matmul on tokens permuted by expert. Differentiable in ``x`` and ``w``.

    Args:
        x: ``(M, K)`` activations, bf16 (fp16/fp32 too on the triton and emulated backends).
        w: ``(E, N, K)`` expert weights in ``nn.Linear`` layout, same dtype as ``x``; or a
            ``QuantizedExpertWeight`` (recipes with row scales): its FP8 operands, forward layout
            in forward and dgrad layout in backward, are used as they are (``weight_cache`` is not
            read).
        offs: ``(E,)`` int32 cumulative END offsets of the experts' rows on ``x``'s device;
            empty experts are legal, ``offs[-1] <= M``.
        recipe: ``"rowwise"`` (default), ``"rowwise_gw_hp"``, ``"tensorwise"``, ``"blockwise"``
            or ``"bf16"`` (``torch._grouped_mm``, the baseline), or a :class:`Float8Recipe`.
            Forward and dgrad run in FP8 in every FP8 recipe; wgrad in FP8 for rowwise and
            tensorwise, in BF16 for rowwise_gw_hp and blockwise.
        backend: ``"cuda_auto"``, ``"cuda"``, ``"hybrid"``, ``"rocm"``, ``"triton"``,
            ``"emulated"``, or ``None`` for the ``MOE_FP8_BACKEND`` environment variable, else
            the platform's best (see ``moe_fp8.grouped_gemm.backends.select``).
        out_dtype: dtype of the result (bf16 only on the cuda_auto, cuda, hybrid and rocm backends).
        weight_cache: serve the quantized weights from this cache while ``w`` is unchanged
            (same tensor, same version counter): pass it across gradient-accumulation
            micro-batches. Copies are kept only where they will be read again (from the second
            forward of a weight state on, or the first where the previous state served two:
            ``Fp8WeightCache.serve``); a call that keeps nothing runs as without a cache. Under
            ``torch.compile`` any cache given makes the GEMMs read ``w``'s FP8 layouts from the
            process-wide ``compiled_weight_cache()`` instead (``w`` a parameter or a transposed
            view of one, in ``x``'s dtype; see ``compiled_cache``); bypassed while a CUDA graph is
            captured (the graph then quantizes ``w`` on every replay, as without a cache: see
            ``Fp8WeightCache``). An amax-only cache (``Fp8WeightCache(copies=False)``) keeps
            weight states' amaxes instead, by the same rules: where the backend quantizes the
            weight inside its GEMMs (``rowwise``, small groups: ``quantizes_w_in_gemm``) and the
            amaxes are kept, both GEMMs read the BF16 weight with the scales they give; otherwise
            the call runs as without a cache. Without a cache, a
            ``rowwise`` weight that is a parameter (or a view of one) is saved as is and its dgrad
            layout quantized in backward, so no FP8 copy of it lives from forward to backward.
        x_fp8: ``(q (M, K) fp8, scale (M,) fp32)``, the rowwise quantization of ``x`` in this
            call's format and ``pow2`` setting, made by a kernel that already touched ``x`` (the
            fused permute + quantize, the fused SwiGLU + quantize): the forward GEMM uses it
            instead of quantizing ``x`` again. Only with row scales (``rowwise``,
            ``rowwise_gw_hp``). It must equal ``quantize_rowwise(x)``; that is not checked.
        save_x_fp8: with ``x_fp8``, keep ``x_fp8`` for the backward instead of ``x`` (half the
            bytes): the weight gradient reads ``x`` dequantized from it (``q * scale`` rounded to
            ``x``'s dtype), so it sees ``x`` quantized twice (rows here, then columns for an FP8
            wgrad). ``x`` itself is never read then: any tensor of its shape and dtype will do
            (e.g. a zero-stride stand-in that carries the gradient path).
        wgrad_offs: ``(E,)`` int32 end offsets of the weight gradient's groups over the same rows,
            or ``None`` (``offs``). Rows whose group differs between ``offs`` and ``wgrad_offs``
            (rows past ``offs[-1]`` included) must be zero in ``x`` and in the output's gradient;
            that is not checked. ``make_dispatch_plan(..., empty_group_rows=True)`` lays rows out
            so: its ``wgrad_offsets`` leave no expert empty, so a library GEMM computes the empty
            experts' zero gradients itself (an empty reduction's result is never trusted: it is
            zeroed again after the GEMM).
        grad_into: ``None``, or the ``.grad`` of ``w``'s parameter, shaped and typed like ``w``
            (bf16 / fp16; a transposed view where ``w`` is one): the backward adds the weight
            gradient to it in place, in fp32 and rounded once, and returns none for ``w``
            (``grad_accumulation``: gradient accumulation without autograd's separate add).
    Returns:
        ``(M, N)`` in ``out_dtype``; rows at or past ``offs[-1]`` are zero.

    K and N must be multiples of 16. Argument errors raise ``TypeError``/``ValueError`` before
    anything runs on the device. No host sync on the GPU: the VALUES of GPU ``offs`` are not
    checked (set ``MOE_FP8_CHECK_OFFSETS=1`` to check them with a sync); they are clamped to a
    non-decreasing sequence in ``[0, M]`` on the device, so bad offsets give wrong rows, never
    a device-side assert or an out-of-bounds access. CPU offsets are checked (in eager mode).
    A dispatch plan's offsets (``make_dispatch_plan``), valid by construction, are taken as they are.
    """
    return FP8GroupedMM.apply(*grouped_mm_arguments(
        x, w, offs, recipe=recipe, backend=backend, out_dtype=out_dtype, weight_cache=weight_cache, x_fp8=x_fp8,
        save_x_fp8=save_x_fp8, wgrad_offs=wgrad_offs, grad_into=grad_into,
    ))


def grouped_mm_arguments(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    *,
    recipe: str | Float8Recipe = "rowwise",
    backend: str | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    weight_cache: Fp8WeightCache | None = None,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
    save_x_fp8: bool = False,
    wgrad_offs: torch.Tensor | None = None,
    grad_into: torch.Tensor | None = None,
) -> tuple:
    """:func:`fp8_grouped_mm`'s arguments checked and resolved into the 16 inputs of
    ``FP8GroupedMM.apply`` (``x, w, offs, w_quant, x_fp8, scaling, fp8_wgrad, backend, fmt, pow2,
    out_dtype, save_w, save_x_fp8, cached, wgrad_offs, grad_into``), which any Function built on
    ``grouped_mm_forward`` takes first."""
    rec = get_recipe(recipe)
    if rec.grad_format is not None:
        raise ValueError(f"recipe: grad_format={rec.grad_format!r} is not supported by fp8_grouped_mm (use None)")
    check_tensor("x", x, dtypes=_FLOAT_DTYPES, ndim=2)
    check_tensor("w", w, dtypes=(x.dtype,), ndim=3)
    M, K = x.shape
    E, N, _ = w.shape
    check_tensor("w", w, shape=(None, None, K))
    if E < 1:
        raise ValueError("w: expected at least one expert, got shape (0, ...)")
    check_same_device(x=x, w=w)
    check_offsets(offs, num_groups=E, device=x.device)
    if wgrad_offs is offs:  # the forward's groups (a plan without empty_group_rows): checked once
        wgrad_offs = None
    if wgrad_offs is not None:
        check_offsets(wgrad_offs, num_groups=E, device=x.device, name="wgrad_offs")
    check_multiple_of("K (x.shape[1])", K, 16)
    check_multiple_of("N (w.shape[1])", N, 16)
    if weight_cache is not None and not isinstance(weight_cache, Fp8WeightCache):
        raise TypeError(f"weight_cache: expected Fp8WeightCache or None, got {type(weight_cache).__name__}")
    if hasattr(w, "_fp8_cache_source") and (weight_cache is None or not rec.is_fp8):
        raise ValueError("w: a Fp8WeightCache.stand_in holds no values; pass it only with weight_cache and an "
                         "FP8 recipe (the weights are then read through the cache)")
    quantized = isinstance(w, QuantizedExpertWeight)
    if grad_into is not None:
        check_tensor("grad_into", grad_into, dtypes=(torch.bfloat16, torch.float16), shape=tuple(w.shape))
        if grad_into.dtype != w.dtype or quantized or hasattr(w, "_fp8_cache_source"):
            raise TypeError("grad_into: takes a weight that is its parameter (or a view of it) in the GEMMs' dtype")
        check_same_device(w=w, grad_into=grad_into)
    if quantized and rec.scaling != "rowwise":
        raise ValueError(f"w: a QuantizedExpertWeight holds row-scaled FP8 operands; recipe {rec.name!r} takes others")
    be = select_backend(backend, x.device)
    dtypes = be.out_dtypes if rec.is_fp8 else _FLOAT_DTYPES
    if out_dtype not in dtypes:
        raise TypeError(f"out_dtype: the {be.name} backend expects one of {dtypes}, got {out_dtype}")
    if rec.is_fp8 and x.dtype not in be.out_dtypes:
        raise TypeError(f"x: the {be.name} backend expects dtype in {be.out_dtypes}, got {x.dtype}")
    if be.max_groups is not None and E > be.max_groups:
        raise ValueError(f"w: the {be.name} backend takes at most {be.max_groups} experts, got {E}")
    offs = _safe_offsets(offs, M, "offs")
    if wgrad_offs is not None:
        wgrad_offs = _safe_offsets(wgrad_offs, M, "wgrad_offs")

    fmt = be.fp8_format(x.device).name if rec.is_fp8 else ""
    w_quant, cached = None, None
    if quantized:  # FP8GroupedMM reads its layouts when it needs them
        weight_cache = None
    if weight_cache is not None and rec.is_fp8 and torch.compiler.is_compiling():
        if hasattr(w, "_fp8_cache_source"):
            raise ValueError("w: under torch.compile pass the weight itself in x's dtype, not a stand-in")
        if weight_cache.copies or _amax_serves(rec, be, w, M, E):
            cached = transposed_layout(w), torch.is_grad_enabled(), weight_cache.copies
        weight_cache = None
    if weight_cache is not None and rec.is_fp8 and not weight_cache.copies:
        if _amax_serves(rec, be, w, M, E):  # None where the cache keeps nothing: as without a cache
            w_quant = cached_weight_amax(weight_cache, w, be.fused_quant, torch.is_grad_enabled())
        w, weight_cache = weight_cache.values(w), None
    if weight_cache is not None and rec.is_fp8:
        w_quant = cached_weight_layouts(weight_cache, w, rec.scaling, fmt, rec.pow2_scales, be.fused_quant,
                                        torch.is_grad_enabled())
        if w_quant is None:  # kept nothing (or a CUDA graph is being captured): as without a cache
            w = weight_cache.values(w)
    if x_fp8 is not None:
        _check_x_fp8(x_fp8, rec, fmt, x)
    elif save_x_fp8:
        raise ValueError("save_x_fp8: needs x_fp8 (the FP8 rows to keep for the backward)")
    x, w_mat = (x if save_x_fp8 else x.contiguous()), _matrix_layout(w)
    save_w = (not quantized and w_quant is None and cached is None and rec.scaling == "rowwise" and w_mat is w
              and (torch.compiler.is_compiling() or _kept_alive(w)))
    return (x, w_mat, offs, w_quant, x_fp8, rec.scaling, rec.fp8_wgrad, be.name, fmt, rec.pow2_scales, out_dtype, save_w,
            bool(save_x_fp8), cached, wgrad_offs, grad_into)


def _amax_serves(rec: Float8Recipe, be, w: torch.Tensor, m: int, groups: int) -> bool:
    """Whether an amax-only weight cache serves ``w (E, N, K)``'s GEMMs over ``m`` rows: ``rowwise``,
    groups small enough for the backend to quantize the weight inside its GEMMs, and ``w`` the weight
    itself (not a stand-in, which holds no values) in either matrix layout."""
    return (rec.scaling == "rowwise" and be.quantizes_w_in_gemm(m, groups) and not hasattr(w, "_fp8_cache_source")
            and transposed_layout(w) is not None)


def _safe_offsets(offs: torch.Tensor, num_rows: int, name: str) -> torch.Tensor:
    """``offs`` as every kernel may take it: a dispatch plan's as it is (valid by construction); CPU
    offsets (or with ``MOE_FP8_CHECK_OFFSETS``) checked; others clamped on the device to a
    non-decreasing sequence in ``[0, num_rows]`` (no host sync)."""
    check_values = offs.device.type == "cpu" or os.environ.get(CHECK_OFFSETS_ENV_VAR, "0") not in ("", "0")
    if valid_offsets.is_valid(offs, num_rows):
        return offs
    if check_values and not torch.compiler.is_compiling():
        check_offsets_values(offs, num_rows, name)
        return offs
    return torch.cummax(offs.clamp(0, num_rows), 0).values


def _kept_alive(w: torch.Tensor) -> bool:
    """``w`` is a leaf (a parameter) or a view of one: saving it for backward costs no memory, so
    the uncached backward quantizes its dgrad layout there instead of keeping an FP8 copy from the
    forward (a computed ``w``, e.g. ``param.to(bf16)``, would cost more saved than that copy).
    Traced, every ``w`` is a functional tensor, never a leaf, and the compiler's partitioner picks
    what to save (a parameter, or a cast it recomputes), so the backward quantizes it there too."""
    return w.is_leaf or (w._base is not None and w._base.is_leaf)


def _matrix_layout(w: torch.Tensor) -> torch.Tensor:
    """``w (E, N, K)`` itself when every expert matrix is row-major (``nn.Linear``) or column-major
    (a transposed view of ``(E, K, N)`` weights: Llama 4's layout), else a contiguous copy.

    Every quantizer takes any strides and ``torch._grouped_mm`` takes both layouts, so the
    transposed view of a parameter is never copied (nor is its gradient copied back).
    """
    return w if transposed_layout(w) is not None else w.contiguous()


def _check_x_fp8(x_fp8, rec: Float8Recipe, fmt: str, x: torch.Tensor) -> None:
    if rec.scaling != "rowwise":
        raise ValueError(f"x_fp8: only for recipes with row scales, got recipe {rec.name!r}")
    if not isinstance(x_fp8, tuple) or len(x_fp8) != 2:
        raise TypeError(f"x_fp8: expected a (q, scale) tuple, got {type(x_fp8).__name__}")
    q, scale = x_fp8
    check_tensor("x_fp8[0]", q, dtypes=(resolve_format(fmt).torch_dtype,), shape=tuple(x.shape))
    check_tensor("x_fp8[1]", scale, dtypes=(torch.float32,), shape=(x.shape[0],))
    check_same_device(x=x, q=q, scale=scale)
