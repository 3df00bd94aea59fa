"""``FP8GroupedExperts``: the routed SwiGLU experts of an MoE block, on FP8 grouped GEMMs.

Forward for tokens ``x (T, H)`` routed to ``topk_ids (T, k)``:

1. dispatch plan on the device (no host sync);
2. permute the token rows into expert order (bf16, kept for the weight gradient) and, in FP8
   recipes with row scales, their rowwise quantization, both from one read of the token rows;
3. ``h = x_perm @ W_gate_up[e].T``: FP8 grouped GEMM ``(M, 2I)``;
4. fused ``a = silu(gate) * up`` + rowwise quantization of ``a``;
5. ``y = a @ W_down[e].T``: FP8 grouped GEMM ``(M, H)``;
6. combine: un-permute and sum each token's k rows weighted by the router (deterministic).

Backward, with row scales, the combine's backward and the SwiGLU's also write their gradients'
rowwise FP8, which the GEMMs' dgrads take (``grouped_gemm.with_neighbors``).

Parameters use the Hugging Face transformers 5.x names and layouts, so a converted model shares
them: ``gate_up_proj (E, 2I, H)`` (gate rows first, then up) and ``down_proj (E, H, I)``
(``nn.Linear`` layout), or with ``in_out_layout=True`` Llama 4's ``(E, H, 2I)`` / ``(E, I, H)``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..checks import check_multiple_of, check_tensor
from ..grouped_gemm import Fp8WeightCache, QuantizedExpertWeight, compiled_weight_cache, fp8_grouped_mm, select_backend
from ..quant import formats, quantize_rowwise
from ..grouped_gemm.grad_accumulation import accumulation_target
from ..grouped_gemm.library import weight_layouts_nbytes
from ..grouped_gemm.with_neighbors import fp8_grouped_mm_combine, fp8_grouped_mm_swiglu
from ..quant.recipes import get_recipe
from ..quant.swiglu import SwiGLUQuantize
from ..routing import (DispatchPlan, combine, make_dispatch_plan, permute, permute_quantize, permute_stand_in,
                       permute_with_fp8)
from .param_checks import check_parameters

__all__ = ["FP8GroupedExperts"]


class FP8GroupedExperts(nn.Module):
    """Routed SwiGLU experts whose matmuls run as FP8 grouped GEMMs.

    Args:
        num_experts: ``E``.
        hidden_size: ``H`` (multiple of 16).
        expert_hidden_size: ``I`` (multiple of 16).
        recipe: ``"rowwise"`` (default), ``"rowwise_gw_hp"``, ``"tensorwise"``, ``"blockwise"`` or
            ``"bf16"`` (the BF16 baseline of the same module, for A/B runs).
        backend: grouped-GEMM backend (``None``: the platform's best; see ``fp8_grouped_mm``).
        fmt: FP8 format (``None``: detected per device).
        in_out_layout: store the weights as Llama 4 does, ``(E, H, 2I)`` and ``(E, I, H)``.
        cache_weights: reuse the FP8 copies of the weights while they are unchanged (across
            gradient-accumulation micro-batches; keyed on the parameters and invalidated by their
            version counters, never stale). fp32 parameters cast to bf16 (under autocast) hit
            too: the cast happens with the quantization, on a miss only. Off by default: under
            gradient accumulation it holds one BF16-sized copy of the weights from the first
            micro-batch to the optimizer step, which lifts the step's peak above the unconverted
            model's at DeepSeek-V3 sizes (docs/conversion.md: what it saves and costs). Under
            ``torch.compile`` the GEMMs read the process-wide compiled cache (weights in the
            activations' dtype only); off while a CUDA graph is captured or replayed (a captured
            step quantizes the weights on every replay, so it sees weight updates) and for weights
            FSDP gathers without ``parallelize``'s keys. Off, the same caches keep the weights'
            amaxes only (4 bytes per row and column, under the same rules): under gradient
            accumulation, where the groups are small enough for the backend to quantize the weights
            inside its GEMMs (``rowwise``, e.g. Qwen3-30B-A3B's experts), both GEMMs then read the
            BF16 weights with those scales and no FP8 copy of a weight is written.
        fp8_saved_input: the first GEMM keeps its input's rowwise FP8 rows for the backward, not
            the BF16 rows (recipes with row scales): the BF16 permuted rows are then never written
            (without input scales), and the saved activation is half the bytes. The gate/up weight
            gradient reads those rows dequantized, so it sees the input quantized twice (as
            DeepSeek-V3's FP8 training does); outputs and the other gradients are unchanged.
        fused_grad_accumulation: once the weights hold a ``.grad`` (from the second micro-batch of
            gradient accumulation on, or always with ``zero_grad(set_to_none=False)``), the weight
            gradient GEMMs add their results to it in place instead of autograd adding them in
            a kernel of its own (``grouped_gemm.grad_accumulation``: its contract). Not for weights
            FSDP2 manages, ``DTensor`` weights (expert parallelism), a ``DistributedDataParallel``
            forward or, eagerly, weights with gradient hooks: those keep autograd's path.

    ``global_num_experts``: the count of experts its ``top_k_index`` ids index (``E`` here; the
    expert-parallel subclass holds a shard of them).
    """

    #: With row scales, the SwiGLU backward and the combine backward also write their gradients' FP8
    #: rows where the GEMMs' dgrads take them (no group amax wanted from the dgrad's own row
    #: quantization): one launch and one read of each gradient fewer, the same bits. ``False``
    #: quantizes them in separate kernels (for side-by-side measurements).
    fused_grad_quant: bool = True

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        expert_hidden_size: int,
        *,
        recipe="rowwise",
        backend: str | None = None,
        fmt=None,
        in_out_layout: bool = False,
        cache_weights: bool = False,
        fp8_saved_input: bool = False,
        fused_grad_accumulation: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        check_multiple_of("hidden_size", hidden_size, 16)
        check_multiple_of("expert_hidden_size", expert_hidden_size, 16)
        if num_experts < 1:
            raise ValueError(f"num_experts: expected >= 1, got {num_experts}")
        E, H, I = num_experts, hidden_size, expert_hidden_size
        self.num_experts, self.hidden_size, self.expert_hidden_size = E, H, I
        self.global_num_experts = E
        self.recipe = get_recipe(recipe)
        if fp8_saved_input and self.recipe.scaling != "rowwise":
            raise ValueError(f"fp8_saved_input: needs a recipe with row scales (rowwise, rowwise_gw_hp), "
                             f"got recipe {self.recipe.name!r}")
        self.fp8_saved_input = fp8_saved_input
        self.fused_grad_accumulation = fused_grad_accumulation
        self.backend = backend
        self.fmt = None if fmt is None else formats.resolve_format(fmt)
        self.in_out_layout = in_out_layout
        kw = dict(device=device, dtype=dtype)
        up_shape, down_shape = ((E, H, 2 * I), (E, I, H)) if in_out_layout else ((E, 2 * I, H), (E, H, I))
        self.gate_up_proj = nn.Parameter(torch.empty(up_shape, **kw))
        self.down_proj = nn.Parameter(torch.empty(down_shape, **kw))
        self.reset_parameters()
        self._caches = _weight_caches(cache_weights)

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default init, per expert (uniform in +-1/sqrt(fan_in))."""
        for p, fan_in in ((self.gate_up_proj, self.hidden_size), (self.down_proj, self.expert_hidden_size)):
            nn.init.uniform_(p, -(fan_in**-0.5), fan_in**-0.5)

    @property
    def weight_cache_nbytes(self) -> int:
        """Device bytes held by the weight caches now, the compiled cache's entries of these weights
        included: memory on top of the parameters, about one BF16-sized copy of the weights once
        filled with FP8 copies (the amaxes alone: 4 bytes per row and column)."""
        weights = [_local(p) for p in (self.gate_up_proj, self.down_proj)]
        return sum(c.nbytes for c in self._caches) + compiled_weight_cache().nbytes_of(weights)

    @property
    def weight_layouts_nbytes(self) -> int:
        """Device bytes of both FP8 layouts of both weights and their scales, cached or not: what the
        cache holds once gradient accumulation fills it (0 with the BF16 recipe)."""
        if not self.recipe.is_fp8:
            return 0
        return sum(weight_layouts_nbytes(tuple(w.shape), self.recipe.scaling) for w in self._weights())

    @property
    def cache_weights(self) -> bool:
        """Whether the FP8 copies of the weights are cached (settable; turning it off drops them)."""
        return self._caches[0].copies

    @cache_weights.setter
    def cache_weights(self, enabled: bool) -> None:
        if enabled != self.cache_weights:
            self._caches = _weight_caches(enabled)

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(E, 2I, H)`` and ``(E, H, I)`` views in ``nn.Linear`` layout; a ``DTensor`` parameter (the
        experts sharded over an expert-parallel mesh dim) gives its local experts."""
        w1, w2 = (_local(p) for p in (self.gate_up_proj, self.down_proj))
        return (w1.transpose(1, 2), w2.transpose(1, 2)) if self.in_out_layout else (w1, w2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor | None,
        *,
        input_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Routed experts output.

        Args:
            hidden_states: ``(T, H)``.
            top_k_index: ``(T, k)`` integer expert ids (ids outside ``[0, E)`` are dropped).
            top_k_weights: ``(T, k)`` combine weights, or ``None`` for unit weights.
            input_scales: ``(T, k)`` factors applied to each expert's INPUT row (Llama 4), or ``None``.
        Returns:
            ``(T, H)`` in ``hidden_states``' dtype (the autocast dtype under autocast); the
            GEMMs themselves write bf16. The GEMMs run on ``hidden_states`` (weights cast to
            match), or on bf16 copies where the backend takes bf16 only (``cuda``, ``hybrid``,
            ``rocm``: fp32 modules without autocast).
        """
        x, out_dtype = self.gemm_input(hidden_states, top_k_index, input_scales)
        # an expert without tokens keeps a zero row for its weight gradient (plan.wgrad_offsets): the
        # grouped GEMM then computes its zero gradient, no separate zeroing writes it again
        plan = make_dispatch_plan(top_k_index, self.num_experts, empty_group_rows=True)
        x_perm, x_fp8 = self.permuted_rows(x, plan, input_scales, stand_in=self.fp8_saved_input)
        return self.grouped_mlp(x_perm, plan, top_k_weights, x_fp8, save_x_fp8=self.fp8_saved_input).to(out_dtype)

    def gemm_input(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   input_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.dtype]:
        """``(x, out_dtype)``: the token rows in the dtype the GEMMs take (the autocast dtype under
        autocast; bf16 where the backend takes bf16 only) and the dtype the output returns in, after
        checking the arguments of :meth:`forward`."""
        check_tensor("hidden_states", hidden_states, ndim=2, shape=(None, self.hidden_size))
        check_tensor("top_k_index", top_k_index, ndim=2, shape=(hidden_states.shape[0], None))
        if input_scales is not None:
            check_tensor("input_scales", input_scales, shape=tuple(top_k_index.shape))
        check_parameters(self, hidden_states, "hidden_states")
        x = hidden_states
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        out_dtype = x.dtype
        if x.dtype not in select_backend(self.backend, x.device).out_dtypes:  # cuda: bf16 only
            x = x.to(torch.bfloat16)
        return x, out_dtype

    def gemm_weight_dtype(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """The dtype weight ``name`` (``"gate_up_proj"`` or ``"down_proj"``) enters its grouped GEMM in
        (is cast to, and quantized from) for tokens of ``dtype`` without autocast: the first GEMM's
        (:meth:`gemm_input`: ``dtype``, or bf16 where the backend takes bf16 only); the second GEMM
        runs on the first's output, which the GEMMs write in bf16."""
        if name == "down_proj":
            return torch.bfloat16
        return dtype if dtype in select_backend(self.backend, device).out_dtypes else torch.bfloat16

    def permuted_rows(self, x: torch.Tensor, plan, input_scales: torch.Tensor | None = None,
                      quantize: bool = True, stand_in: bool = False
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """``(x_perm (M, H), x_fp8)``: the expert-sorted rows of ``x (T, H)`` (scaled by ``input_scales``
        when given) and, when ``quantize`` and the recipe has row scales, their rowwise FP8
        ``(q (M, H), scale (M,))`` (written with the permuted rows by one launch without input
        scales), else ``None``.
        ``stand_in`` (with FP8 rows, without input scales): ``x_perm`` is a zero-stride stand-in
        (``permute_stand_in``) for a first GEMM that saves the FP8 rows."""
        fp8_rows = quantize and self.recipe.scaling == "rowwise"
        fmt = formats.resolve_format(self.fmt, x.device)
        pow2 = self.recipe.pow2_scales
        if stand_in and fp8_rows and input_scales is None:
            return permute_stand_in(x, plan), permute_quantize(x, plan, fmt, pow2=pow2)
        if fp8_rows and input_scales is None:  # both from one read of x
            return permute_with_fp8(x, plan, fmt, pow2=pow2)
        x_perm = permute(x, plan)
        if input_scales is not None:
            row_scale = _row_scales(input_scales, plan).to(x_perm.dtype)
            x_perm = x_perm * row_scale[:, None]
            return x_perm, quantize_rowwise(x_perm.detach(), fmt, pow2=pow2) if fp8_rows else None
        return x_perm, None

    def grouped_mlp(self, x_perm: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor | None,
                    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None, save_x_fp8: bool = False) -> torch.Tensor:
        """``combine(down(silu(gate) * up), plan, weights)``: each expert's SwiGLU MLP on its rows of
        ``x_perm (M, H)`` (in ``plan``'s row layout, grouped by ``plan.offsets``), combined into
        tokens with the ``(T, k)`` router ``weights`` (``None``: unit weights). ``x_fp8``: the rows'
        rowwise FP8 ``(q, scale)``, or ``None`` (quantized in the GEMM); ``save_x_fp8``: the first
        GEMM saves ``x_fp8``, not ``x_perm`` (which it then never reads). Returns ``(T, H)`` bf16
        (the GEMMs' dtype). With row scales (and ``fused_grad_quant``) the SwiGLU backward and the
        combine backward write the gradients' FP8 rows where the GEMMs' dgrads take them
        (``grouped_gemm.with_neighbors``, which runs the separate ops elsewhere)."""
        recipe, fp8_rows = self.recipe, self.recipe.scaling == "rowwise"
        gemm = dict(recipe=recipe, backend=self.backend, wgrad_offs=plan.wgrad_offsets)
        w1, w2 = self._weights()
        cache = self._caches if self._reads_cache(w1, x_perm) else (None, None)
        w1 = _cast(w1, x_perm.dtype, cache[0])
        into1 = self._grad_target(self.gate_up_proj, w1)
        offsets, save = plan.offsets, save_x_fp8 and x_fp8 is not None
        if fp8_rows and self.fused_grad_quant:
            a, a_q, a_scale = fp8_grouped_mm_swiglu(x_perm, w1, offsets, weight_cache=cache[0], x_fp8=x_fp8,
                                                    save_x_fp8=save, grad_into=into1, **gemm)
            w2 = _cast(w2, a.dtype, cache[1])
            return fp8_grouped_mm_combine(a, w2, offsets, plan, weights, weight_cache=cache[1], x_fp8=(a_q, a_scale),
                                          grad_into=self._grad_target(self.down_proj, w2), **gemm)
        h = fp8_grouped_mm(x_perm, w1, offsets, weight_cache=cache[0], x_fp8=x_fp8, save_x_fp8=save,
                           grad_into=into1, **gemm)
        if fp8_rows:
            a, a_q, a_scale = SwiGLUQuantize.apply(h, formats.resolve_format(self.fmt, x_perm.device),
                                                   recipe.pow2_scales)
            a_fp8 = (a_q, a_scale)
        else:
            gate, up = h.chunk(2, dim=-1)
            a, a_fp8 = nn.functional.silu(gate) * up, None
        # The grouped GEMMs write bf16; fp32 modules (no autocast) get their dtype back at the end.
        w2 = _cast(w2, a.dtype, cache[1])
        into2 = self._grad_target(self.down_proj, w2)
        return combine(fp8_grouped_mm(a, w2, offsets, weight_cache=cache[1], x_fp8=a_fp8, grad_into=into2, **gemm),
                       plan, weights)

    def _grad_target(self, param: nn.Parameter, w: torch.Tensor) -> torch.Tensor | None:
        """What the GEMM of weight ``w`` (``param``'s ``(E, N, K)`` view) adds its weight gradient to
        (``fused_grad_accumulation``), or ``None``: autograd's path, also for weights FSDP2 gathers
        (its unsharded parameters are plain tensors whose gradients it reduces)."""
        if not self.fused_grad_accumulation or getattr(self, "_is_fsdp_managed_module", False):
            return None
        return accumulation_target(param, w, self.in_out_layout)

    def _reads_cache(self, w1: torch.Tensor, x_perm: torch.Tensor) -> bool:
        """Whether the GEMMs read the weights through the caches (FP8 recipes only; eagerly a weight
        cast happens there, on a miss). Not for weights that come quantized (FSDP's FP8 all-gather),
        nor while a CUDA graph is captured (the step then quantizes them), nor for weights FSDP
        gathers unless ``parallelize`` keys the caches on the sharded state: the gathered tensor keeps
        its identity and version counter across optimizer steps. Under ``torch.compile``: weights in
        the activations' dtype, read from the compiled cache (``fp8_grouped_mm``)."""
        if not self.recipe.is_fp8 or isinstance(w1, QuantizedExpertWeight):
            return False
        fsdp = getattr(self, "_is_fsdp_managed_module", False)
        if torch.compiler.is_compiling():
            return not fsdp and w1.dtype == x_perm.dtype
        return not Fp8WeightCache.bypassed(x_perm) and not (fsdp and self._caches[0].source_stamp is None)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, expert_hidden={self.expert_hidden_size}, "
                f"recipe={self.recipe.name}, in_out_layout={self.in_out_layout}, "
                f"fp8_saved_input={self.fp8_saved_input}, fused_grad_accumulation={self.fused_grad_accumulation}")


def _weight_caches(copies: bool) -> tuple[Fp8WeightCache, Fp8WeightCache]:
    """The caches of the gate/up and down weights: of FP8 copies, or (``copies=False``) of amaxes only."""
    return Fp8WeightCache(copies), Fp8WeightCache(copies)


def _local(p: torch.Tensor) -> torch.Tensor:
    """``p``, or for a ``DTensor`` its local shard (differentiable)."""
    return p.to_local() if isinstance(p, DTensor) else p


def _cast(w: torch.Tensor, dtype: torch.dtype, cache: Fp8WeightCache | None) -> torch.Tensor:
    """Weight ``w`` (``(E, N, K)``, any float dtype) for a grouped GEMM on ``dtype`` activations:
    ``w`` itself if it has ``dtype``; else the cache's stand-in (cast inside the quantization, on a
    miss only), or without a cache ``w.to(dtype)``."""
    if w.dtype == dtype:
        return w
    return w.to(dtype) if cache is None else cache.stand_in(w, dtype)


def _row_scales(input_scales: torch.Tensor, plan) -> torch.Tensor:
    """Per permuted row, the input scale of the (token, slot) pair it holds; 0 on padding rows."""
    pair = plan.row_to_pair.long()
    flat = input_scales.reshape(-1)
    return torch.where(pair >= 0, flat[pair.clamp(min=0)], flat.new_zeros(()))
