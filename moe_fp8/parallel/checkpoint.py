"""Distributed checkpoints of parallelized models: ``torch.distributed.checkpoint`` (DCP) of the
model's (and optimizer's) state dict, in the single-process model's keys.

A parallelized model's state dict holds its parameters as ``DTensor`` s of their global shapes
(experts ``(E, ...)`` over ``ep`` and the FSDP dims), its buffers, and nothing else: no FP8 weight
copy (the cache lives outside the module's state), no wrapper in the keys. DCP reshards on load,
so any layout (other ep and dp sizes, another world size) loads any other's checkpoint, and so
does a single-process model (:func:`load` without a process group); the keys are the unconverted
Hugging Face model's for a model converted by ``moe_fp8.hf.convert`` in
the transformers 5.x layout (its experts share the original parameters).
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = ["load", "save"]


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Save ``model`` (and ``optimizer``'s state) to the DCP directory ``path``; every rank calls it."""
    dcp.save(_state(model, optimizer), checkpoint_id=path)


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load ``path`` (written by :func:`save` from any layout) into ``model`` (and ``optimizer``, built
    over ``model``'s parameters) in place: a parallelized model on every rank, or a single-process
    one (no process group needed), converted or not (the keys of the model it is given)."""
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state
