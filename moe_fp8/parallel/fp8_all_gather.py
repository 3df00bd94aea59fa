"""FP8 all-gather of the routed experts' weights under FSDP2: ``parallelize(..., fp8_all_gather=True)``.

FSDP2 shards an expert weight ``(E, A, B)`` on dim 0 into ``S`` shards of ``E / S`` WHOLE experts.
The rowwise FP8 layouts the grouped GEMM takes are per expert: forward ``q (E, N, K)`` with a
scale per expert and output row (amax over K), dgrad ``q (E, K, N)`` with a scale per expert and
input column (amax over N). So a shard quantized alone gives exactly the bytes and scales of the
same experts quantized after the gather, and the all-gather can move those instead of the weights.

Each expert weight's sharded local tensor is an :class:`Fp8AllGatherWeight` around the
high-precision shard (the parameter's values, what the optimizer updates and checkpoints hold).
FSDP2 calls its ``fsdp_pre_all_gather`` before each all-gather: the shard is cast to the dtype the
layer's GEMM takes that weight in (``FP8GroupedExperts.gemm_weight_dtype``) and quantized by the
quantizers of the layer's own uncached GEMM (``moe_fp8.grouped_gemm.library``) into

* for a gather before the forward: the forward layout, ``q_fwd (E/S, N, K)`` FP8 + ``s_fwd`` fp32;
* for a gather before the backward (FSDP gathers again before each block's backward, the weights
  being resharded after forward): the dgrad layout, ``q_bwd (E/S, K, N)`` FP8 + ``s_bwd`` fp32;
* with activation checkpointing, both layouts in every gather (the forward recomputed in backward
  needs the forward layout, the dgrad its own; FSDP2 fixes each parameter's all-gather sizes at
  its first gather, so the forward gather carries both too).

A gather is one before the backward when it runs inside the autograd engine
(``torch._C._current_graph_task_id() != -1``: FSDP2's pre-backward hooks and backward prefetches
run there). The one-layout gathers pad the fp32 scales to ``(E/S, max(N, K))``: the same sizes
either way. ``fsdp_post_all_gather`` makes the unsharded parameter a
``moe_fp8.grouped_gemm.QuantizedExpertWeight`` over the gathered bytes, from which
``fp8_grouped_mm`` reads its FP8 operands (and raises, never guesses, when a layout it needs was
not gathered). Its gradient is an ordinary gradient of the unsharded parameter, reduce-scattered
as always. On a one-rank shard mesh FSDP2 (torch 2.13) copies only the first all-gather input, so
there the inputs travel packed in one uint8 tensor.

State dicts (and so DCP checkpoints) hold the plain high-precision shards: a state-dict hook
unwraps them; loading copies into them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map_only

from ..grouped_gemm import QuantizedExpertWeight, WeightOperands, select_backend
from ..grouped_gemm import library as lib
from ..layers.experts import FP8GroupedExperts
from ..quant.reference import expert_amax

__all__ = ["Fp8AllGatherWeight", "all_gather_bytes", "check_experts", "enable_fp8_all_gather", "gathered_bytes"]

_aten = torch.ops.aten
#: ops that FSDP2, DTensor and ``nn.Parameter`` run on a sharded weight to lay it out: their results stay
#: ``Fp8AllGatherWeight`` s (so the shard FSDP keeps has the hooks); every other op sees the plain shard
_KEEPS_HOOKS = {
    _aten.detach.default, _aten.alias.default, _aten.view.default, _aten.as_strided.default, _aten.slice.Tensor,
    _aten.split.Tensor, _aten.split_with_sizes.default, _aten.new_zeros.default, _aten.new_empty.default,
    _aten.empty_like.default, _aten._to_copy.default, _aten._pin_memory.default,
}
_WEIGHTS = ("gate_up_proj", "down_proj")


class Fp8AllGatherWeight(torch.Tensor):
    """The local shard of an expert weight, ``(E/S, A, B)`` in the parameter's dtype and layout,
    that FSDP2 all-gathers as rowwise FP8 (see the module docstring).

    Args:
        tensor: the high-precision shard (its values; every op but the layout ops of FSDP2 runs on it).
        name: the weight's name in ``FP8GroupedExperts`` (``"gate_up_proj"``, ``"down_proj"``).
        in_out_layout: the parameter is stored ``(E, K, N)`` (Llama 4's layout; the GEMM's weight is
            its ``transpose(1, 2)``).
        both_layouts: every gather carries both layouts (activation checkpointing).
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, name: str, in_out_layout: bool, both_layouts: bool) -> Fp8AllGatherWeight:
        return torch.Tensor._make_wrapper_subclass(cls, tensor.shape, strides=tensor.stride(),
                                                   storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
                                                   device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, name: str, in_out_layout: bool, both_layouts: bool) -> None:
        self._tensor = tensor
        self.weight_name = name
        self.in_out_layout = in_out_layout
        self.both_layouts = both_layouts

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        plain_args, plain_kwargs = tree_map_only(Fp8AllGatherWeight, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*plain_args, **plain_kwargs)
        first = func._schema.arguments[0].alias_info
        if first is not None and first.is_write and isinstance(args[0], Fp8AllGatherWeight):
            return args[0]  # an in-place op: its (updated) first argument
        if func in _KEEPS_HOOKS:
            like = next(t for t in tree_leaves((args, kwargs)) if isinstance(t, Fp8AllGatherWeight))
            return tree_map_only(torch.Tensor, lambda t: Fp8AllGatherWeight(t, like.weight_name, like.in_out_layout,
                                                                            like.both_layouts), out)
        return out

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"Fp8AllGatherWeight({self._tensor!r}, name={self.weight_name!r}, in_out_layout={self.in_out_layout})"

    def fsdp_pre_all_gather(self, mesh: DeviceMesh, outer_size: torch.Size, outer_stride: tuple[int, ...],
                            module: FP8GroupedExperts, mp_policy: MixedPrecisionPolicy
                            ) -> tuple[tuple[torch.Tensor, ...], tuple]:
        """The all-gather inputs of this shard: ``(q, s)`` of the layout this gather is for, ``s`` padded
        to ``(E/S, max(N, K))``, or ``(q_fwd, s_fwd, q_bwd, s_bwd)`` (on a one-rank mesh their bytes
        packed in one uint8 tensor); and the metadata ``(layouts, dtype, fmt, pow2, specs)`` of
        :func:`fsdp_post_all_gather` (``specs``: the inputs' shapes and dtypes)."""
        w = self._tensor
        backend = select_backend(module.backend, w.device)
        # the tokens come in the dtype FSDP gathers the parameters in (its param_dtype casts them too)
        dtype = module.gemm_weight_dtype(self.weight_name, mp_policy.param_dtype or w.dtype, w.device)
        w = w.to(dtype)
        if self.in_out_layout:
            w = w.transpose(1, 2)
        fmt, pow2, fused = backend.fp8_format(w.device).name, module.recipe.pow2_scales, backend.fused_quant
        if self.both_layouts:
            layouts = ("forward", "dgrad")
        else:
            layouts = ("dgrad",) if torch._C._current_graph_task_id() != -1 else ("forward",)
        # the quantizers of the layer's uncached rowwise GEMM: the forward layout with the dgrad layout's
        # amax over N, then the dgrad layout from that amax (alone, the same amax: a max, exact in any order)
        pairs = []
        if "forward" in layouts:
            q_fwd, s_fwd, col_amax = lib.quantize_weight_forward_layout(w, fmt, pow2, fused)
            pairs.append((q_fwd, s_fwd))
        else:
            col_amax = expert_amax(w, transposed=True)
        if "dgrad" in layouts:
            pairs.append(lib.quantize_weight_dgrad_layout(w, col_amax, fmt, pow2, fused))
        if len(pairs) == 1:  # the scales padded to one size for both layouts
            q, s = pairs[0]
            padded = s.new_zeros(s.shape[0], max(w.shape[1], w.shape[2]))
            padded[:, : s.shape[1]] = s
            pairs = [(q, padded)]
        inputs = tuple(t for pair in pairs for t in pair)
        specs = tuple((t.shape, t.dtype) for t in inputs)
        if mesh.size() == 1:  # FSDP2 "gathers" over one rank by copying the first input alone: one packed buffer
            inputs = (torch.cat([t.reshape(-1).view(torch.uint8) for t in inputs]),)
        return inputs, (layouts, dtype, fmt, pow2, specs)

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: tuple,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None
                             ) -> tuple[QuantizedExpertWeight, tuple[torch.Tensor, ...]] | None:
        """The unsharded parameter: a ``QuantizedExpertWeight`` of the parameter's shape and
        ``param_dtype`` over the gathered layouts, and the gathered tensors (FSDP frees and refills
        them); with ``out`` (that parameter, from an earlier gather), its layouts replaced in place."""
        layouts, dtype, fmt, pow2, specs = metadata
        outputs = all_gather_outputs
        if len(outputs) < len(specs):  # one packed buffer (a one-rank mesh)
            outputs = _unpacked(outputs[0], specs)
        gathered = dict(zip(layouts, _pairs(outputs)))
        if out is not None:
            operands = (out._local_tensor if isinstance(out, DTensor) else out).operands
            operands.dtype, operands.fmt, operands.pow2 = dtype, fmt, pow2
            operands.forward, operands.dgrad = gathered.get("forward"), gathered.get("dgrad")
            return None
        operands = WeightOperands(dtype, fmt, pow2, gathered.get("forward"), gathered.get("dgrad"))
        q = outputs[0]
        E, N, K = q.shape if layouts[0] == "forward" else (q.shape[0], q.shape[2], q.shape[1])
        shape = torch.Size((E, K, N) if self.in_out_layout else (E, N, K))
        stride = (shape[1] * shape[2], shape[2], 1)
        weight = QuantizedExpertWeight(operands, shape, stride, param_dtype, q.device, not self.in_out_layout)
        return weight, tuple(all_gather_outputs)


def _unpacked(buffer: torch.Tensor, specs: tuple) -> tuple[torch.Tensor, ...]:
    """The tensors of ``specs`` (``(shape, dtype)`` each) packed one after the other in the uint8 ``buffer``
    (views)."""
    out, start = [], 0
    for shape, dtype in specs:
        size = shape.numel() * dtype.itemsize
        out.append(buffer[start : start + size].view(dtype).view(shape))
        start += size
    return tuple(out)


def _pairs(outputs: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(q, s)`` per gathered layout; a padded scale ``(E, max(N, K))`` cut to ``(E, q.shape[1])``
    (a contiguous copy when cut)."""
    pairs = []
    for q, s in zip(outputs[::2], outputs[1::2]):
        pairs.append((q, s if s.shape[1] == q.shape[1] else s[:, : q.shape[1]].contiguous()))
    return pairs


def check_experts(experts: FP8GroupedExperts, ep: int, shards: int) -> None:
    """Raise ``ValueError`` where the FP8 all-gather cannot gather ``experts``' weights exactly (split over
    ``ep`` ranks and sharded over ``shards`` FSDP ranks), ``NotImplementedError`` where it is not built."""
    recipe = experts.recipe
    if not recipe.is_fp8:
        raise ValueError(f"fp8_all_gather: recipe {recipe.name!r} runs BF16 GEMMs: there is nothing to quantize")
    if recipe.scaling != "rowwise":
        raise NotImplementedError(f"fp8_all_gather: recipe {recipe.name!r}: built for the recipes with row scales "
                                  "(rowwise, rowwise_gw_hp) only")
    local = experts.num_experts // ep
    if local % shards:
        raise ValueError(f"fp8_all_gather: the {local} experts of an ep rank do not split into {shards} FSDP shards "
                         "of whole experts (dp_shard must divide them): a shard holding part of an expert, or none, "
                         "cannot quantize its experts alone")


def enable_fp8_all_gather(experts: FP8GroupedExperts, both_layouts: bool) -> None:
    """Make ``experts``' weights (plain parameters, or ``DTensor`` s over the ep mesh) all-gather as FP8
    under the ``fully_shard`` to come: their (local) tensors become :class:`Fp8AllGatherWeight` s, and
    its state dict gives the plain tensors back. ``both_layouts``: every gather carries both
    layouts (activation checkpointing)."""
    for name in _WEIGHTS:
        p = getattr(experts, name)
        local = p._local_tensor if isinstance(p, DTensor) else p
        wrapped = Fp8AllGatherWeight(local.detach(), name, experts.in_out_layout, both_layouts)
        if isinstance(p, DTensor):
            wrapped = DTensor.from_local(wrapped, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                         stride=p.stride())
        setattr(experts, name, nn.Parameter(wrapped, requires_grad=p.requires_grad))
    experts.register_state_dict_post_hook(_plain_state)


def _plain_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """State-dict hook: the sharded expert weights (``DTensor`` s, as FSDP registers them) with their plain
    high-precision local tensors in place of the :class:`Fp8AllGatherWeight` s (aliases: loading into
    them writes the parameters)."""
    for name in _WEIGHTS:
        value = state_dict.get(prefix + name)
        if isinstance(value, DTensor) and isinstance(value._local_tensor, Fp8AllGatherWeight):
            state_dict[prefix + name] = DTensor.from_local(value._local_tensor._tensor, value.device_mesh,
                                                           value.placements, run_check=False, shape=value.shape,
                                                           stride=value.stride())


def gathered_bytes(num_experts: int, n: int, k: int, *, both_layouts: bool = False, fp8: bool = True) -> int:
    """Bytes one all-gather of an expert weight ``(num_experts, n, k)`` (the experts of an ep rank)
    produces on each rank: FP8 (one byte per element and layout, fp32 scales; one layout's scales
    padded to ``max(n, k)``), or with ``fp8=False`` BF16 (two bytes per element). Each rank
    receives ``(S - 1) / S`` of it from the ``S - 1`` others."""
    if not fp8:
        return 2 * num_experts * n * k
    if both_layouts:
        return 2 * num_experts * n * k + 4 * num_experts * (n + k)
    return num_experts * n * k + 4 * num_experts * max(n, k)


def all_gather_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes the all-gathers of ``model``'s FP8-gathered expert weights produce on each rank per
    micro-batch (one gather for the forward, one for the backward), ``{"fp8": ..., "bf16": ...}``:
    as gathered, and as the same gathers in BF16 would be. ``model``: parallelized with
    ``fp8_all_gather=True``."""
    shards = model.parallel_layout.shard
    total = {"fp8": 0, "bf16": 0}
    for p in model.parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        if isinstance(local, Fp8AllGatherWeight):
            E, A, B = local.shape
            for key, fp8 in (("fp8", True), ("bf16", False)):
                total[key] += 2 * gathered_bytes(E * shards, A, B, both_layouts=local.both_layouts, fp8=fp8)
    return total
