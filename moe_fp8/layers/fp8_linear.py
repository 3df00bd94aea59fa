"""Dense FP8 linear layer: ``y = x @ W.T (+ b)`` with the three GEMMs through ``torch._scaled_mm``.

Recipes (see ``moe_fp8.quant.recipes``):

* ``rowwise``: x per row, W per output row (forward); grad_out per row, W per input column
  (dgrad); grad_out per output column, x per input column (wgrad). All three GEMMs in FP8.
* ``rowwise_gw_hp``: as ``rowwise`` with the weight-gradient GEMM in BF16 (AMD's published best
  dense training recipe).
* ``tensorwise``: one scale per tensor in all three GEMMs.

Saved for backward: the high-precision input and weight (like TorchAO's ``Float8Linear``), and in
the rowwise recipes their column amaxes. Each operand is quantized in the layout its GEMM needs:

* Rows (x, W, grad_out): the row kernel. In the rowwise recipes it also reduces every column's
  amax from the same read, so the per-column layouts (W.T for dgrad; grad_out.T and x.T for
  wgrad, both in one launch) are written without a reduction of their own, as ``fp8_grouped_mm``
  does for one group of rows. Rows over 16384 elements (``col_amax_fits``), a gradient format of
  its own, an empty batch, tensors Triton does not run on and traces of interpreted kernels take
  the column-wise kernel instead (the same bytes).
* The backward's W.T takes grad_out's scales as an argument its launch never reads
  (``order_token``): a layout of W alone would otherwise be computed by torch.compile in the
  forward and kept until the backward.
* ``torch._scaled_mm`` wants the first operand row-major and the second column-major, every
  dimension a multiple of 16 except the first operand's rows: the token count, which wgrad
  contracts over, is zero-padded to a multiple of 16 there (zero rows add nothing).
* ``tensorwise``: operands a GEMM takes transposed are quantized as they are and transposed in
  FP8 (one scale either way, so grad_out is quantized once for dgrad and wgrad); nothing is
  copied transposed in high precision.
* Several weights of one input (``fp8_linears_shared_input``, ``SharedInput``): one autograd node
  quantizes x once for all of them, its rows in the forward and ``x.T`` in the backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import check_multiple_of
from ..grouped_gemm import Fp8WeightCache, compiled_weight_cache, quant_seam
from ..grouped_gemm.library import weight_layouts_nbytes
from ..kernel_backend import triton_runs_on
from ..launch import interpreted_trace, kernel_input
from ..quant import formats
from ..quant.kernels.rowwise import col_amax_fits
from ..quant.recipes import Float8Recipe, get_recipe
from .dense_quant import ALIGN, quantize_cols_t, quantize_rows, transposed_padded, weight_dgrad_layout, \
    weight_forward_layout
from .dense_weight_cache import cached_dense_layouts, dense_mm_cached_weight
from .param_checks import check_parameters
from .scaled_mm import scaled_mm

__all__ = ["FP8Linear", "DENSE_RECIPES", "fp8_linear", "fp8_linears_shared_input"]

# Recipes a dense layer takes; "bf16" runs plain F.linear (the A/B baseline).

DENSE_RECIPES = ("rowwise", "rowwise_gw_hp", "tensorwise")


def _one_group(rows: int, device: torch.device) -> torch.Tensor:
    """``(1,)`` int32 end offset ``[rows]``: the token rows as the one group of the group-amax kernels
    (filled in place: the compiled graph merges equal ``torch.full`` calls into one buffer)."""
    return torch.empty((1,), dtype=torch.int32, device=device).fill_(rows)


def _padded_rows(m: int, device: torch.device) -> tuple[torch.Tensor | None, int | None]:
    """``(padded_offs, padded_rows)`` of the wgrad operands of ``m`` token rows: ``(None, None)`` where
    ``m`` is a multiple of 16, else the one group's end ``m_pad`` and ``m_pad``."""
    pad = -m % ALIGN
    return (_one_group(m + pad, device), m + pad) if pad else (None, None)


def _wgrad_from_amaxes(grad_out: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, g_amax: torch.Tensor,
                       x_amax: torch.Tensor, fmt, pow2: bool):
    """Both rowwise wgrad operands, written by one launch from their column amaxes ``(1, N)`` and
    ``(1, K)``: ``grad_out.T (N, M_pad)`` and ``x.T (K, M_pad)`` row-major (token rows zero-padded
    to 16) with scales ``(N, 1)`` and ``(K, 1)``."""
    p_offs, rows = _padded_rows(x.shape[0], x.device)
    qa, sa, qb, sb = quant_seam.quantize_wgrad_operands(grad_out, x, offs, fmt, pow2, True, padded_offs=p_offs,
                                                        padded_rows=rows, a_amax=g_amax, b_amax=x_amax)
    return qa.t(), sa[0][:, None], qb.t(), sb[0][:, None]


def _wgrad_operand_from_amax(t: torch.Tensor, offs: torch.Tensor, amax: torch.Tensor, fmt, pow2: bool):
    """One of :func:`_wgrad_from_amaxes`' operands alone: ``t.T (C, M_pad)`` row-major, scale ``(C, 1)``."""
    p_offs, rows = _padded_rows(t.shape[0], t.device)
    q, s = quant_seam.quantize_wgrad_operand(t, offs, fmt, pow2, True, padded_offs=p_offs, padded_rows=rows,
                                             a_amax=amax)
    return q.t(), s[0][:, None]


class _FP8LinearsFn(torch.autograd.Function):
    """``apply(x (M, K), recipe, fmt, grad_fmt, caches, *weights (N_i, K))`` -> a tuple of ``(M, N_i)``,
    one per weight, in x's dtype: the linears that read one input, x quantized once for all of them
    (its rows in the forward, ``x.T`` for every weight gradient in the backward); their input
    gradients add up.

    ``caches[i]``: ``None`` (W_i quantized here, its dgrad layout in the backward from the saved W_i),
    W_i's four layouts (``weight_layouts``, from an ``Fp8WeightCache``, eagerly), or a bool: the GEMMs
    read them through ``dense_mm_cached_weight`` (under torch.compile), whose ``training`` it is."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recipe: Float8Recipe, fmt, grad_fmt, caches, *weights: torch.Tensor):
        # the one-read kernels where Triton runs (the reference quantizers give the same bytes)
        kernels, pow2 = triton_runs_on(x), recipe.pow2_scales
        (m, k), need_dw = x.shape, ctx.needs_input_grad[5:]
        # the wgrad operands' column amaxes from the row quantizations of x and of each grad_out
        amax_ok = (recipe.scaling == "rowwise" and kernels and recipe.fp8_wgrad and grad_fmt == fmt and m > 0
                   and ctx.needs_input_grad[0] and col_amax_fits(k)
                   and not interpreted_trace(x))  # there x would count as written by the wgrad's launch
        ctx.g_amax = tuple(amax_ok and dw and col_amax_fits(w.shape[0]) for w, dw in zip(weights, need_dw))
        offs = x_amax = None
        if any(ctx.g_amax):
            offs = _one_group(m, x.device)
            x_q, x_s, x_amax = quant_seam.quantize_activation_group_amax(kernel_input(x), offs, fmt, pow2, True)
            x_s = x_s[:, None]
        else:
            x_q, x_s = quantize_rows(kernel_input(x), recipe.scaling, fmt, pow2)
        ctx.recipe, ctx.fmt, ctx.grad_fmt, ctx.kernels = recipe, fmt, grad_fmt, kernels
        ctx.x_dtype, ctx.w_dtypes = x.dtype, tuple(w.dtype for w in weights)
        ctx.caches = tuple(c if isinstance(c, bool) else None for c in caches)
        ctx.w_dgrads, outs, w_amaxes = [], [], []
        for weight, cache in zip(weights, caches):
            w_amax = w_dgrad = None
            if isinstance(cache, bool):
                out = dense_mm_cached_weight(x_q, x_s, weight, False, recipe.scaling, fmt.name, pow2, kernels,
                                             x.dtype, True, cache)
            else:
                if cache is not None:  # the dgrad layout rides on ctx: the cache holds it anyway
                    w_q, w_s, *w_dgrad = cache
                else:  # W's column amax for the dgrad from the same read, where a dgrad follows
                    w_q, w_s, w_amax = weight_forward_layout(weight, recipe.scaling, fmt, pow2, kernels,
                                                             with_amax=ctx.needs_input_grad[0])
                out = scaled_mm(x_q, x_s, w_q, w_s, x.dtype)
            ctx.w_dgrads.append(w_dgrad)
            outs.append(out)
            w_amaxes.append(w_amax)
        ctx.save_for_backward(x, offs, x_amax, *weights, *w_amaxes)
        ctx.set_materialize_grads(False)  # an output without a gradient adds nothing
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        x, offs, x_amax, *rest = ctx.saved_tensors
        weights, w_amaxes = rest[:len(grads)], rest[len(grads):]
        need_dx = ctx.needs_input_grad[0]
        shared = _SharedXT()
        grad_x, grad_ws = None, []
        for i, grad_out in enumerate(grads):
            need_dw = ctx.needs_input_grad[5 + i]
            if grad_out is None or not (need_dx or need_dw):
                grad_ws.append(None)
                continue
            # read by the dgrad's and the wgrad's quantization
            grad_out = kernel_input(grad_out.contiguous())
            g, g_amax = _quantized_grad_rows(ctx, i, grad_out, offs, x_amax, need_dx, need_dw)
            if need_dx:
                grad_x_i = _dgrad(ctx, i, g, weights[i], w_amaxes[i])
                grad_x = grad_x_i if grad_x is None else grad_x + grad_x_i
            if not (need_dw and ctx.recipe.fp8_wgrad and ctx.recipe.scaling == "tensorwise"):
                g = None  # freed before the wgrad's operands are made
            grad_ws.append(_wgrad(ctx, i, grad_out, x, offs, g, g_amax, x_amax, shared) if need_dw else None)
        return grad_x, None, None, None, None, *grad_ws


def _quantized_grad_rows(ctx, i: int, grad_out: torch.Tensor, offs: torch.Tensor | None,
                         x_amax: torch.Tensor | None, need_dx: bool, need_dw: bool):
    """``(g, g_amax)``: grad_out's FP8 rows ``(q, s (M, 1))`` for the dgrad (tensorwise: for the wgrad
    too), and its column amax ``(1, N)`` for the wgrad where the forward took x's; ``None`` for what
    nothing reads."""
    recipe = ctx.recipe
    if x_amax is not None and ctx.g_amax[i]:  # per row of grad_out, and its column amax for the wgrad
        g_q, g_s, g_amax = quant_seam.quantize_activation_group_amax(grad_out, offs, ctx.grad_fmt,
                                                                     recipe.pow2_scales, True)
        return (g_q, g_s[:, None]), g_amax
    if need_dx or (need_dw and recipe.fp8_wgrad and recipe.scaling == "tensorwise"):
        return quantize_rows(grad_out, recipe.scaling, ctx.grad_fmt, recipe.pow2_scales), None
    return None, None


def _dgrad(ctx, i: int, g: tuple[torch.Tensor, torch.Tensor], weight: torch.Tensor,
           w_amax: torch.Tensor | None) -> torch.Tensor:
    """``grad_x (M, K) = grad_out_i @ W_i`` from grad_out's FP8 rows ``g``; W's dgrad layout from the
    cache, or quantized per input column (over N) here, after grad_out's scales (``order_token``),
    and freed on return."""
    recipe, fmt, pow2 = ctx.recipe, ctx.fmt, ctx.recipe.pow2_scales
    g_q, g_s = g
    if ctx.caches[i] is not None:
        return dense_mm_cached_weight(g_q, g_s, weight, True, recipe.scaling, fmt.name, pow2, ctx.kernels,
                                      ctx.x_dtype, recipe.fast_accum_grads, ctx.caches[i])
    if ctx.w_dgrads[i] is not None:
        wt_q, wt_s = ctx.w_dgrads[i]
    else:
        after = g_s if g_s.numel() else None
        wt_q, wt_s = weight_dgrad_layout(weight, recipe.scaling, fmt, pow2, ctx.kernels, w_amax, after)
    return scaled_mm(g_q, g_s, wt_q, wt_s, ctx.x_dtype, recipe.fast_accum_grads)


class _SharedXT:
    """``x.T``'s FP8 operand ``(q (K, M_pad), s)``, made by the first weight gradient of a backward and
    read by the others."""

    def __init__(self) -> None:
        self.value: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self, make) -> tuple[torch.Tensor, torch.Tensor]:
        if self.value is None:
            self.value = make()
        return self.value


def _wgrad(ctx, i: int, grad_out: torch.Tensor, x: torch.Tensor, offs: torch.Tensor | None,
           g: tuple[torch.Tensor, torch.Tensor] | None, g_amax: torch.Tensor | None,
           x_amax: torch.Tensor | None, xt: _SharedXT) -> torch.Tensor:
    """``grad_w (N, K) = grad_out.T @ x`` in the weight's dtype: FP8 (tensorwise: from grad_out's FP8
    ``g`` of the dgrad, transposed; rowwise: both operands per column, from their amaxes where the
    forward and the dgrad made them) or BF16 (``rowwise_gw_hp``). ``x.T``'s operand comes from ``xt``
    where another weight gradient of the same backward made it."""
    recipe, fmt, grad_fmt, pow2 = ctx.recipe, ctx.fmt, ctx.grad_fmt, ctx.recipe.pow2_scales
    w_dtype = ctx.w_dtypes[i]
    if not recipe.fp8_wgrad:
        if x.shape[0] == 0:  # an empty reduction: zeros by construction, not from the library
            return x.new_zeros(grad_out.shape[1], x.shape[1], dtype=w_dtype)
        return (grad_out.t() @ x.to(grad_out.dtype)).to(w_dtype)
    if recipe.scaling == "tensorwise":  # one scale either way: transpose the codes made for dgrad
        gt_q, gt_s = transposed_padded(g[0]), g[1]  # (N, M_pad)
    elif g_amax is not None and xt.value is None:  # both operands in one launch
        gt_q, gt_s, xt_q, xt_s = _wgrad_from_amaxes(grad_out, x, offs, g_amax, x_amax, fmt, pow2)
        xt.value = xt_q, xt_s
    elif g_amax is not None:
        gt_q, gt_s = _wgrad_operand_from_amax(grad_out, offs, g_amax, grad_fmt, pow2)
    else:
        gt_q, gt_s = quantize_cols_t(grad_out, recipe.scaling, grad_fmt, pow2)  # (N, M_pad)
    xt_q, xt_s = xt.get(lambda: quantize_cols_t(x, recipe.scaling, fmt, pow2) if x_amax is None  # (K, M_pad)
                        else _wgrad_operand_from_amax(x, offs, x_amax, fmt, pow2))  # no second reduction of x
    return scaled_mm(gt_q, gt_s, xt_q, xt_s, w_dtype, recipe.fast_accum_grads)


def _check_dense_recipe(recipe) -> Float8Recipe:
    recipe = get_recipe(recipe)
    if recipe.scaling == "blockwise":
        raise ValueError(f"recipe: expected one of {DENSE_RECIPES} or 'bf16' for a dense layer, got {recipe.name!r}")
    return recipe


def _weight_and_cache(x: torch.Tensor, weight: torch.Tensor, recipe: Float8Recipe, fmt,
                      weight_cache: Fp8WeightCache | None):
    """Check ``weight`` against ``x``; return it (or the cache's values of a stand-in) and the
    ``cache`` argument of ``_FP8LinearsFn`` for it."""
    stand_in = hasattr(weight, "_fp8_cache_source")
    check_multiple_of("weight.shape[1] (in_features)", weight.shape[1], ALIGN)
    check_multiple_of("weight.shape[0] (out_features)", weight.shape[0], ALIGN)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x: expected last dim {weight.shape[1]} (in_features), got shape {tuple(x.shape)}")
    cache = weight_cache
    if cache is not None and torch.compiler.is_compiling():
        if stand_in:
            raise ValueError("weight: under torch.compile pass the parameter itself in x's dtype, not a stand-in")
        cache = torch.is_grad_enabled()
    elif cache is not None:
        cache = cached_dense_layouts(cache, weight, recipe.scaling, fmt, recipe.pow2_scales, triton_runs_on(x),
                                     torch.is_grad_enabled())
        if cache is None:  # kept nothing (or a CUDA graph is being captured): as without a cache
            weight = weight_cache.values(weight)
    return weight, cache


def fp8_linears_shared_input(
    x: torch.Tensor, weights, biases=None, *, recipe="rowwise", fmt=None, weight_caches=None,
) -> list[torch.Tensor]:
    """Several FP8 linears of one input: ``[x (..., K) @ w (N_i, K).T + b_i]``, each ``(..., N_i)`` in
    x's dtype, with x quantized once for all of them (its rows for the forward GEMMs, ``x.T`` for
    the weight gradients) and one autograd node; the same values as one :func:`fp8_linear` per
    weight. ``biases`` and ``weight_caches``: ``None`` or one entry (or ``None``) per weight, as
    :func:`fp8_linear` takes them. ``recipe="bf16"`` is plain ``F.linear`` per weight.
    """
    weights = list(weights)
    if not weights:
        raise ValueError("weights: expected at least one weight")
    biases = [None] * len(weights) if biases is None else list(biases)
    caches = [None] * len(weights) if weight_caches is None else list(weight_caches)
    for name, items in (("biases", biases), ("weight_caches", caches)):
        if len(items) != len(weights):
            raise ValueError(f"{name}: expected {len(weights)} entries (one per weight), got {len(items)}")
    recipe = _check_dense_recipe(recipe)
    for w, c in zip(weights, caches):
        if c is not None and not isinstance(c, Fp8WeightCache):
            raise TypeError(f"weight_cache: expected Fp8WeightCache or None, got {type(c).__name__}")
        if hasattr(w, "_fp8_cache_source") and (c is None or not recipe.is_fp8):
            raise ValueError("weight: a Fp8WeightCache.stand_in holds no values; pass it only with weight_cache and an "
                             "FP8 recipe (the weight is then read through the cache)")
    if not recipe.is_fp8:
        return [F.linear(x, w, b) for w, b in zip(weights, biases)]
    fmt = formats.resolve_format(fmt, x.device)
    grad_fmt = formats.resolve_format(recipe.grad_format) if recipe.grad_format else fmt
    pairs = [_weight_and_cache(x, w, recipe, fmt, c) for w, c in zip(weights, caches)]
    lead = x.shape[:-1]
    outs = _FP8LinearsFn.apply(x.reshape(-1, x.shape[-1]), recipe, fmt, grad_fmt, tuple(c for _, c in pairs),
                               *(w for w, _ in pairs))
    outs = [out.reshape(*lead, w.shape[0]) for out, w in zip(outs, weights)]
    return [out if b is None else out + b.to(out.dtype) for out, b in zip(outs, biases)]


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, recipe="rowwise", fmt=None,
    weight_cache: Fp8WeightCache | None = None,
) -> torch.Tensor:
    """Functional FP8 linear: ``x (..., K) @ weight (N, K).T + bias`` -> ``(..., N)`` in x's dtype.

    x and weight are bf16 (or fp16/fp32: the FP8 GEMMs write bf16, then cast to x's dtype); K and N
    must be multiples of 16. Differentiable in x, weight and bias. ``recipe="bf16"`` is plain
    ``F.linear`` (the baseline of the same call).

    ``weight_cache``: an ``Fp8WeightCache`` keeping both FP8 layouts of ``weight`` while it is unchanged,
    where they will be read again (``moe_fp8.layers.dense_weight_cache``); ``weight`` is then the
    parameter itself or the cache's ``stand_in`` of it. Under ``torch.compile`` the process-wide
    compiled cache is read instead (pass the parameter itself, in x's dtype); while a CUDA graph is
    captured, no cache is read.
    """
    return fp8_linears_shared_input(x, [weight], [bias], recipe=recipe, fmt=fmt, weight_caches=[weight_cache])[0]


class FP8Linear(nn.Linear):
    """``nn.Linear`` whose three GEMMs run in FP8 (see the module docstring for the recipes).

    Parameters and ``state_dict`` are those of ``nn.Linear``, so checkpoints load either way.
    Under ``torch.autocast`` the input and weight are cast to the autocast dtype first.
    ``in_features`` and ``out_features`` must be multiples of 16. Weights still on the meta device,
    or on another device than the input, raise ``ValueError``.

    ``cache_weights``: keep both FP8 layouts of the weight while it is unchanged, so that gradient
    accumulation quantizes it once per optimizer step, not once per micro-batch (keyed on the
    parameter's identity and version counter: never stale). Costs one BF16-sized copy of the
    weight from the first forward on, which is why it is off by default. Under ``torch.compile``
    the process-wide compiled cache is read (weights in the activations' dtype only); no cache is
    read while a CUDA graph is captured, nor for weights FSDP manages.

    ``shared_input``: the ``SharedInput`` this layer runs with (its siblings that read the same
    input, which it quantizes once for all of them), or ``None``; set by ``SharedInput``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe="rowwise",
                 fmt=None, cache_weights: bool = False, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._configure(recipe, fmt, cache_weights)

    def _configure(self, recipe, fmt, cache_weights: bool) -> None:
        check_multiple_of("in_features", self.in_features, ALIGN)
        check_multiple_of("out_features", self.out_features, ALIGN)
        self.recipe = _check_dense_recipe(recipe)
        self.fmt = None if fmt is None else formats.resolve_format(fmt)
        self._cache = Fp8WeightCache() if cache_weights else None
        self.shared_input = None  # a ``SharedInput`` this layer runs with, set by it

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, recipe="rowwise", fmt=None, cache_weights: bool = False) -> "FP8Linear":
        """A new ``FP8Linear`` sharing ``linear``'s parameters (no copy)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new._configure(recipe, fmt, cache_weights)
        return new

    @property
    def cache_weights(self) -> bool:
        """Whether the FP8 layouts of the weight are cached (settable; turning it off drops them)."""
        return self._cache is not None

    @cache_weights.setter
    def cache_weights(self, enabled: bool) -> None:
        if enabled != self.cache_weights:
            self._cache = Fp8WeightCache() if enabled else None

    @property
    def weight_cache_nbytes(self) -> int:
        """Device bytes the weight's cached FP8 layouts hold now (0 without a cache), the compiled
        cache's entries of this weight included."""
        if self._cache is None:
            return 0
        return self._cache.nbytes + compiled_weight_cache().nbytes_of([self.weight])

    @property
    def weight_layouts_nbytes(self) -> int:
        """Device bytes of the weight's two FP8 layouts and their scales, cached or not: what
        :attr:`weight_cache_nbytes` reaches under gradient accumulation (0 with the BF16 recipe)."""
        if not self.recipe.is_fp8:
            return 0
        return weight_layouts_nbytes((1, self.out_features, self.in_features), self.recipe.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared_input is not None:  # run with the layers that read the same x (``SharedInput``)
            out = self.shared_input.output(self, x)
            if out is not None:
                return out
        x = self.input_operand(x)
        weight, cache = self.weight_operand(x.dtype)
        return fp8_linear(x, weight, self.bias, recipe=self.recipe, fmt=self.fmt, weight_cache=cache)

    def input_operand(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` checked against the parameters and cast to the GEMMs' dtype (the autocast dtype under
        ``torch.autocast``, else ``x``'s own: then ``x`` itself)."""
        check_parameters(self, x)
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        return x if dtype == x.dtype else x.to(dtype)

    def weight_operand(self, dtype: torch.dtype) -> tuple[torch.Tensor, Fp8WeightCache | None]:
        """``(weight, weight_cache)`` for GEMMs in ``dtype``: the weight in ``dtype`` (or the cache's
        stand-in of it) and the cache the GEMMs read, if any."""
        weight = self.weight
        cache = self._cache if self._reads_cache(weight, dtype) else None
        if weight.dtype != dtype:
            weight = weight.to(dtype) if cache is None else cache.stand_in(weight, dtype)
        return weight, cache

    def _reads_cache(self, weight: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether the GEMMs read the weight through the cache: FP8 recipes, not for weights FSDP
        gathers (the gathered tensor keeps its identity and version counter across optimizer steps).
        Under ``torch.compile``: a weight in the GEMMs' dtype. (``fp8_linear`` leaves the cache alone
        while a CUDA graph is captured.)"""
        if self._cache is None or not self.recipe.is_fp8 or getattr(self, "_is_fsdp_managed_module", False):
            return False
        return weight.dtype == dtype or not torch.compiler.is_compiling()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}, cache_weights={self.cache_weights}"
