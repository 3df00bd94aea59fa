"""Weight gradients added to ``.grad`` by the GEMM that makes them.

With gradient accumulation, autograd adds each micro-batch's weight gradient to the parameter's
``.grad`` in a separate kernel: per weight element a read of both and a write (6 bytes in bf16).
A grouped weight-gradient GEMM handed that ``.grad`` (``fp8_grouped_mm(..., grad_into=...)``) adds
its result in its epilogue instead (a read and a write of the gradient, 4 bytes, and no launch),
and returns no gradient for the weight, so autograd adds nothing. Empty experts' slices are not
touched at all.

The contract: the gradient is added to the tensor that was the parameter's ``.grad`` when the
forward ran. Zero gradients in place (``zero_grad(set_to_none=False)``), or set them to ``None``
between a backward and the next forward (the usual training loop). A compiled graph holds to it
whatever happens: setting ``.grad`` to ``None`` between its forward and its backward drops that
backward's weight gradient, and ``torch.autograd.grad`` adds to ``.grad`` too. Eagerly the
backward checks: where the parameter holds another ``.grad`` now, has tensor hooks or
post-accumulate-grad hooks (which expect each backward's gradient from autograd), or the backward
does not accumulate into ``.grad`` (``torch.autograd.grad``, ``backward(inputs=...)`` without the
weight), the gradient takes autograd's path. Inside a ``DistributedDataParallel`` forward (whose
reducer's hooks reduce what autograd accumulates) it takes autograd's path too. A compiled graph
checks no hooks: where its GEMMs add, the weight's tensor hooks are called with ``None``.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

__all__ = ["accumulation_target", "adds_in_place"]

_DTYPES = (torch.bfloat16, torch.float16)  # what the kernel adds to
_OWNER = "_moe_fp8_grad_of"  # eagerly, the tensor handed to the GEMM names its parameter


def accumulation_target(param: nn.Parameter, w: torch.Tensor, transposed: bool) -> torch.Tensor | None:
    """``param.grad`` laid out as the GEMM's weight ``w`` (``(E, N, K)``; ``transposed``: ``w`` is
    ``param.transpose(1, 2)``), or ``None`` where the gradient must go through autograd: no
    gradient yet (the first micro-batch), grad mode off, ``param`` a ``DTensor`` (sharded over an
    expert-parallel or FSDP mesh, whose reductions take what autograd hands them), a
    ``DistributedDataParallel`` forward running (its reducer takes what autograd hands it), a ``.grad`` of
    another shape or strides than ``param``, of another dtype than ``w`` (a weight cast for the
    GEMM), or not bf16 / fp16."""
    grad = param.grad
    if grad is None or not torch.is_grad_enabled() or not param.requires_grad:
        return None
    if isinstance(param, DTensor) or _in_ddp_forward():
        return None
    if grad.dtype != w.dtype or grad.dtype not in _DTYPES:
        return None
    if grad.shape != param.shape or grad.stride() != param.stride():
        return None
    target = grad.transpose(1, 2) if transposed else grad
    if not torch.compiler.is_compiling():
        setattr(target, _OWNER, weakref.ref(param))
    return target


def _in_ddp_forward() -> bool:
    """Whether a ``DistributedDataParallel`` forward is running (DDP marks it for TorchDynamo)."""
    return getattr(DistributedDataParallel, "_active_ddp_module", None) is not None


def adds_in_place(target: torch.Tensor) -> bool:
    """In the backward: whether to add to ``target``. Eagerly, ``False`` (the gradient then goes
    through autograd) where the parameter holds another ``.grad`` now, has hooks that expect the
    gradient, or this backward does not accumulate into it (``torch.autograd.grad``,
    ``backward(inputs=...)`` without it); ``True`` in a compiled graph, which cannot check."""
    ref = getattr(target, _OWNER, None)
    param = ref() if ref is not None else None
    if param is None:
        return True
    grad = param.grad
    if grad is None or grad.untyped_storage().data_ptr() != target.untyped_storage().data_ptr():
        return False
    return not _hooked(param) and _accumulates(param)


def _hooked(param: nn.Parameter) -> bool:
    """Whether ``param`` has tensor hooks (``register_hook``) or post-accumulate-grad hooks."""
    return bool(param._backward_hooks) or bool(param._post_accumulate_grad_hooks)


def _accumulates(param: nn.Parameter) -> bool:
    """Whether the running backward will accumulate into ``param.grad`` (its AccumulateGrad node runs)."""
    node = torch.autograd.graph.get_gradient_edge(param).node
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # torch.autograd.grad with param among its inputs: captured, not accumulated
        return False
