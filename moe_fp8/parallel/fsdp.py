"""``parallelize``: a model on a ``DeviceMesh`` with FSDP2 for every parameter and expert
parallelism for the routed experts (torchtitan's layout).

The mesh's data-parallel dims are ``dp_replicate`` (optional: HSDP), ``dp_shard`` and ``ep``; every
rank of all three holds its own batch (data-parallel size ``D = R * S * EP``). Routed experts are
split whole over ``ep`` (a ``DTensor``, ``Shard(0)``: rank ``e`` holds experts
``[e * E / EP, (e + 1) * E / EP)``) and ``fully_shard``-ed again over ``dp_shard`` (HSDP with
``dp_replicate``); every other parameter is ``fully_shard``-ed over ``dp_shard x ep`` (HSDP with
``dp_replicate``), one FSDP unit per decoder block and one for the rest.

Gradient scale: each rank's loss is the mean over its own batch, and FSDP averages a gradient over
the ranks it reduces over. A replicated parameter is reduced over all ``D`` ranks: the mean of the
per-rank gradients, i.e. the gradient of the loss averaged over the global batch. An expert's
gradient on its ep rank already SUMS the contributions of the ``EP`` ranks whose tokens it received
(the token exchange's backward), and FSDP averages it over the other ``D / EP`` ranks only: the
expert layers scale their weight gradients by ``1 / EP`` (``ExpertParallelExperts.weight_grad_scale``,
exact for a power-of-two ``EP``), so they too are the mean over all ``D`` ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from ..layers.experts import FP8GroupedExperts
from .. import optimizer_steps  # noqa: F401  (the step pre-hook the stamps rely on)
from .experts import DISPATCH_MODES, ExpertParallelExperts
from .fp8_all_gather import check_experts, enable_fp8_all_gather
from .shard import grouped_experts_of

__all__ = ["MESH_DIMS", "ParallelLayout", "parallelize"]

#: the data-parallel mesh dim names ``parallelize`` reads (``dp_replicate`` optional)
MESH_DIMS = ("dp_replicate", "dp_shard", "ep")


class ParallelLayout:
    """The sizes and sub-meshes of a data-parallel mesh with an expert-parallel dim.

    Attributes:
        replicate, shard, ep: sizes of ``dp_replicate`` (1 when absent), ``dp_shard``, ``ep``.
        dp: ``replicate * shard * ep``, the ranks whose batches make the global batch.
        dense_mesh: FSDP mesh of every parameter but the routed experts: ``dp_shard x ep`` flattened
            (1-D), or ``(dp_replicate, dp_shard x ep)`` (HSDP).
        expert_mesh: FSDP mesh of the routed experts: ``dp_shard`` or ``(dp_replicate, dp_shard)``.
        ep_mesh: the ``ep`` dim (1-D).
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh: expected a DeviceMesh, got {type(mesh).__name__}")
        names = tuple(mesh.mesh_dim_names or ())
        if not {"dp_shard", "ep"} <= set(names) or not set(names) <= set(MESH_DIMS) or len(set(names)) != len(names):
            raise ValueError(f"mesh: expected dims named {MESH_DIMS} ('dp_replicate' optional; size 1 is legal), got "
                             f"{names or 'unnamed dims'}")
        order = [d for d in MESH_DIMS if d in names]
        if list(names) != order:
            raise ValueError(f"mesh: expected its dims in the order {tuple(order)}, got {names}")
        size = dict(zip(names, mesh.mesh.shape))
        self.replicate, self.shard, self.ep = size.get("dp_replicate", 1), size["dp_shard"], size["ep"]
        self.dp = self.replicate * self.shard * self.ep
        hsdp = "dp_replicate" in names
        self.ep_mesh = mesh["ep"]
        self.expert_mesh = mesh["dp_replicate", "dp_shard"] if hsdp else mesh["dp_shard"]
        flat = mesh["dp_shard", "ep"]._flatten("dp_shard_ep")
        self.dense_mesh = mesh["dp_replicate", "dp_shard_ep"] if hsdp else flat

    def __repr__(self) -> str:
        return f"ParallelLayout(dp_replicate={self.replicate}, dp_shard={self.shard}, ep={self.ep})"


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    dispatch: str = "bf16",
    sync_free: bool = False,
    blocks: Sequence[nn.Module] | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    activation_checkpoint: bool = False,
    compile: bool | dict = False,
    cache_weights: bool = False,
    fp8_all_gather: bool = False,
) -> nn.Module:
    """Shard ``model`` over ``mesh`` in place: experts over ``ep``, FSDP2 everywhere; return ``model``.

    Args:
        model: a model holding ``FP8GroupedExperts`` (a Hugging Face model converted by
            ``moe_fp8.hf.convert``, any supported family and layout, or a model built from ``FP8MoE``
            / ``FP8Linear``), in its single-process form (all experts), on the device of ``mesh`` or
            on the meta device (then ``to_empty`` and load a checkpoint afterwards). Every rank
            passes the same state.
        mesh: a ``DeviceMesh`` with dims ``("dp_shard", "ep")`` or ``("dp_replicate", "dp_shard",
            "ep")`` (see :class:`ParallelLayout`); every dim may have size 1. The expert count of
            every MoE layer must be a multiple of the ``ep`` size.
        dispatch, sync_free: the token exchange of the expert-parallel layers
            (:class:`ExpertParallelExperts`); without effect at ``ep == 1``.
        blocks: the decoder blocks, each its own FSDP unit (and its own activation checkpoint and
            compiled region); ``None``: the members of the model's ``nn.ModuleList`` s of layers.
        reshard_after_forward, mp_policy, offload_policy: passed to every ``fully_shard``.
        activation_checkpoint: recompute each block in backward (torch's ``checkpoint_wrapper``,
            non-reentrant). A Hugging Face model's ``config.use_cache`` is set to ``False``: the
            recompute would append each block's keys and values to the KV cache a second time.
        compile: ``torch.compile`` each block with ``fullgraph=True`` (``True``, or a dict of
            ``torch.compile`` keyword arguments such as ``{"backend": "aot_eager"}``). The default
            expert-parallel dispatch waits on the host for its split sizes, which a full graph
            cannot hold: compile needs ``ep == 1`` or ``sync_free=True``.
        cache_weights: give the experts an FP8 weight cache (one FP8 copy of every layer's
            all-gathered local experts, held between steps: memory that the sharding saves
            otherwise; it pays with gradient accumulation), whatever the converted module had.
            Off by default. Its copies are keyed on the sharded parameters' version counters and
            on the count of ``torch.optim`` steps (any optimizer's): an optimizer outside
            ``torch.optim`` that writes the weights must call ``Fp8WeightCache.invalidate`` on the
            experts' caches. Off, the experts keep each weight state's amaxes alone (4 bytes per
            row and column, keyed the same way), which spares the GEMMs that quantize the weight
            themselves a read of it per micro-batch.
        fp8_all_gather: FSDP all-gathers the routed experts' weights as rowwise FP8 (each shard
            quantized before the gather, in the layout the grouped GEMMs of that pass take) instead
            of in their dtype; bitwise the same training (``moe_fp8.parallel.fp8_all_gather``).
            Needs recipes with row scales, ``dp_shard`` dividing each ep rank's experts (shards of
            whole experts), ``reshard_after_forward=True`` (the backward gathers the dgrad layout
            anew), every MoE layer inside a block, no ``compile`` and no ``cache_weights``; raises
            ``ValueError`` / ``NotImplementedError`` otherwise. With ``activation_checkpoint`` every
            gather carries both layouts. The gathers' sizes: ``fp8_all_gather.all_gather_bytes``.

    Returns ``model``: build the optimizer after this call. Each rank then feeds its own batch and
    takes the mean loss over it; every gradient is the data-parallel mean (module docstring).
    Checkpoint with ``torch.distributed.checkpoint`` (see ``moe_fp8.parallel.checkpoint``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if dispatch not in DISPATCH_MODES:
        raise ValueError(f"dispatch: expected one of {DISPATCH_MODES}, got {dispatch!r}")
    layout = ParallelLayout(mesh)
    compile_kw = _compile_kwargs(compile)
    if compile_kw is not None and layout.ep > 1 and not sync_free:
        raise ValueError("compile: the expert-parallel dispatch waits on the host for its split sizes, which a full "
                         "graph cannot hold; pass sync_free=True (or use ep == 1)")
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("model: already sharded with fully_shard")
    found = grouped_experts_of(model)
    blocks = _blocks_of(model) if blocks is None else list(blocks)
    nested = layout.ep > 1 and bool(found) and _placement_api() is None
    if fp8_all_gather:
        _check_fp8_all_gather([e for _, _, e in found], blocks, layout, nested, reshard_after_forward,
                              compile_kw is not None, cache_weights)
    fsdp = dict(reshard_after_forward=reshard_after_forward)
    if mp_policy is not None:
        fsdp["mp_policy"] = mp_policy
    if offload_policy is not None:
        fsdp["offload_policy"] = offload_policy

    experts = []
    for parent, name, full in found:
        local = _shard_over_ep(full, layout, dispatch, sync_free)
        local.cache_weights = cache_weights
        if fp8_all_gather:
            enable_fp8_all_gather(local, both_layouts=activation_checkpoint)
        setattr(parent, name, local)
        experts.append(local)
    placement = _expert_placement(experts, layout)
    if nested and compile_kw is not None:
        raise ValueError("compile: a full graph of a block cannot hold the FSDP hooks of its experts' own FSDP unit; "
                         "with ep > 1 compile needs torch >= 2.13 (one FSDP unit per block with a mesh per parameter)")
    if activation_checkpoint and getattr(getattr(model, "config", None), "use_cache", False):
        model.config.use_cache = False
    unclaimed = list(experts)
    if nested:  # torch < 2.13: one FSDP mesh per unit, so the experts are units of their own
        for local in experts:
            _shard(local, layout.expert_mesh, [local], fsdp)
        unclaimed = []
    for block in blocks:
        parent, name = _parent_of(model, block)
        inside = {id(m) for m in block.modules()}
        mine = [e for e in unclaimed if id(e) in inside]
        unclaimed = [e for e in unclaimed if id(e) not in inside]
        if activation_checkpoint:
            block = _checkpointed(block)
        if compile_kw is not None:
            block.compile(**compile_kw)
        _shard(block, layout.dense_mesh, mine, fsdp, placement)
        setattr(parent, name, block)
    _shard(model, layout.dense_mesh, unclaimed, fsdp, placement)
    model.parallel_layout = layout
    return model


def _shard(unit: nn.Module, mesh: DeviceMesh, experts: list[FP8GroupedExperts], fsdp: dict, placement=None) -> None:
    """``fully_shard`` ``unit``; key the weight caches (FP8 copies, or amaxes only) of the FP8
    ``experts`` whose parameters it gathers on their sharded state (a forward pre-hook that runs
    before FSDP's)."""
    fully_shard(unit, mesh=mesh, shard_placement_fn=placement, **fsdp)
    fp8 = [e for e in experts if e.recipe.is_fp8]
    if fp8:
        unit.register_forward_pre_hook(functools.partial(_stamp_caches, fp8), prepend=True)


def _expert_placement(experts: list[FP8GroupedExperts], layout: ParallelLayout):
    """A ``shard_placement_fn`` putting the experts' parameters on the expert mesh (torch >= 2.13:
    one FSDP unit holds parameters of several meshes), or ``None`` where not needed or not
    available."""
    api = _placement_api()
    if layout.ep == 1 or not experts or api is None:
        return None
    FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult = api
    mesh = layout.expert_mesh
    info = (FSDPMeshInfo(mesh, shard_mesh_dim=0) if mesh.ndim == 1
            else HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0))
    params = {id(p) for e in experts for p in e.parameters()}
    return lambda p: ShardPlacementResult(Shard(0), info) if id(p) in params else None


def _placement_api() -> tuple | None:
    """``(FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult)``: what a ``shard_placement_fn`` with a
    mesh of its own returns (torch >= 2.13), or ``None``."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import (  # noqa: PLC0415
            FSDPMeshInfo,
            HSDPMeshInfo,
            ShardPlacementResult,
        )
    except ImportError:
        return None
    return FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult


def _check_fp8_all_gather(experts: list[FP8GroupedExperts], blocks: list[nn.Module], layout: ParallelLayout,
                          nested: bool, reshard_after_forward: bool | int, compiled: bool,
                          cache_weights: bool) -> None:
    """Raise where ``fp8_all_gather`` could not train bitwise as without it (or is not built)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam  # noqa: PLC0415

    if not hasattr(FSDPParam, "_init_extensions"):
        raise NotImplementedError("fp8_all_gather: this torch's FSDP2 has no all-gather extensions "
                                  "(fsdp_pre_all_gather / fsdp_post_all_gather)")
    if reshard_after_forward is not True:
        raise ValueError(f"fp8_all_gather: needs reshard_after_forward=True (got {reshard_after_forward!r}): the "
                         "forward gathers the forward layout only and the backward must gather the dgrad layout anew")
    if compiled:
        raise NotImplementedError("fp8_all_gather: not built for compile (the gathered weights are tensor subclasses "
                                  "that the compiled blocks would have to trace)")
    if cache_weights:
        raise ValueError("fp8_all_gather: the weights arrive quantized at every gather; cache_weights has nothing to "
                         "keep (pass cache_weights=False)")
    for e in experts:
        check_experts(e, layout.ep, layout.shard)
    inside = {id(m) for b in blocks for m in b.modules()}
    if not nested and any(id(e) not in inside for e in experts):
        raise ValueError("fp8_all_gather: an MoE layer outside every block would be in the root FSDP unit, which "
                         "FSDP may keep unsharded from forward to backward (no dgrad-layout gather); pass blocks= "
                         "that hold every MoE layer")


def _compile_kwargs(compile: bool | dict) -> dict | None:
    if compile is False:
        return None
    if compile is True:
        return {"fullgraph": True}
    if isinstance(compile, dict):
        return {"fullgraph": True, **compile}
    raise TypeError(f"compile: expected a bool or a dict of torch.compile arguments, got {type(compile).__name__}")


def _blocks_of(model: nn.Module) -> list[nn.Module]:
    """The members of the outermost ``nn.ModuleList`` s holding parameters (a transformer's layers)."""
    lists, inside = [], set()
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and not any(name.startswith(p + ".") for p in inside):
            lists.append(m)
            inside.add(name)
    return [b for lst in lists for b in lst if any(True for _ in b.parameters())]


def _parent_of(model: nn.Module, block: nn.Module) -> tuple[nn.Module, str]:
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is block:
                return parent, name
    raise ValueError("blocks: a block is not a submodule of model")


def _shard_over_ep(experts: FP8GroupedExperts, layout: ParallelLayout, dispatch: str,
                   sync_free: bool) -> FP8GroupedExperts:
    """This rank's experts: ``experts`` itself at ``ep == 1``; else an ``ExpertParallelExperts`` whose
    parameters are ``DTensor`` s of the global shape, ``Shard(0)`` over the ep mesh."""
    if layout.ep == 1:
        return experts
    if experts.num_experts % layout.ep:
        raise ValueError(f"mesh: the ep size {layout.ep} does not divide an MoE layer's {experts.num_experts} experts")
    local = ExpertParallelExperts.from_full(experts, layout.ep_mesh.get_group(), dispatch, sync_free=sync_free)
    local.weight_grad_scale = 1.0 / layout.ep  # the mean over the ep ranks' losses, not their sum
    for name in ("gate_up_proj", "down_proj"):
        p = getattr(local, name)
        d = DTensor.from_local(p.detach(), layout.ep_mesh, [Shard(0)], run_check=False)
        setattr(local, name, nn.Parameter(d, requires_grad=p.requires_grad))
    return local


def _stamp_caches(experts: list[FP8GroupedExperts], unit: nn.Module, args) -> None:
    """Forward pre-hook of an FSDP unit, before its all-gather: key the weight caches of
    ``experts`` on the identities and version counters of the parameters registered now: the
    sharded ones, which the optimizer step and loads bump, and which FSDP is about to gather from;
    or, where FSDP did not reshard since their last use (and so gathers nothing), the unsharded
    ones themselves."""
    if torch.compiler.is_compiling():
        return
    for e in experts:
        stamp = tuple(_state_of(p) for p in (e.gate_up_proj, e.down_proj))
        for cache in e._caches:
            cache.source_stamp = stamp


def _state_of(p: torch.Tensor) -> tuple:
    """What identifies the values ``p`` holds: ``p``'s identity and version counter (which every
    ``torch.optim`` step bumps, ``moe_fp8.optimizer_steps``: a foreach step writes a ``DTensor``'s
    shards without), and its local shard's."""
    local = p._local_tensor if isinstance(p, DTensor) else p
    return id(p), p._version, id(local), local._version


def _checkpointed(block: nn.Module) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)

