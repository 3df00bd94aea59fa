"""``SharedInput``: ``FP8Linear`` layers that read one input tensor, run as one ``fp8_linears_shared_input`` call.

A model calls attention's ``q_proj``, ``k_proj`` and ``v_proj`` (an MLP's ``gate_proj`` and ``up_proj``)
one after another on the same tensor. Alone, each ``FP8Linear`` quantizes that tensor itself: its
rows for the forward GEMM and, in the backward, ``x.T`` for its weight gradient. Joined in a
``SharedInput``, the first member called computes every member's output in one
``fp8_linears_shared_input`` call (x quantized once each way, one autograd node whose input
gradients add up) and keeps the other outputs on the tensor; each other member called with the same
tensor object (eagerly: at the same version) takes its output from there; a member called on another
tensor, or again, runs the group on it. Weights that are not plain tensors on the input's device
(FSDP's sharded parameters) and inference tensors (which keep no version counter) run the member
alone, as without the group: the values are the same either way. Outputs no member takes go with
the tensor. Members called on different tensors (cross-attention) would compute every output for
each, so the converters join the siblings of the model classes known to call them on one tensor
(``PARENTS``).

Under ``torch.compile`` the group's Python runs at trace time: the outputs are handed over inside
the traced graph (tensor identity is traced, version counters are not read), with
``fullgraph=True`` and inside activation-checkpointed regions too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .fp8_linear import FP8Linear, fp8_linears_shared_input

__all__ = ["PARENTS", "SIBLINGS", "SharedInput", "join_siblings", "own_input", "sibling_linears"]


#: The attribute of an input tensor that holds the outputs its groups' members have not taken yet:
#: ``{id(group): (x's version, {id(member): output})}``.
KEPT_OUTPUTS = "_moe_fp8_kept_outputs"


class SharedInput:
    """The members (two or more ``FP8Linear`` of the same ``in_features``, recipe and format) of one
    input. ``FP8Linear.forward`` asks :meth:`output`; ``SharedInput(members)`` sets each member's
    ``shared_input``. The outputs waiting for their members ride on the input tensor itself (its
    attribute ``KEPT_OUTPUTS``), so the group holds no state of its own and the outputs go when the
    input does. ``parent``: the module whose forward calls the members; a forward pre-hook
    (:func:`own_input`) hands it its input as a view made in that call, so that under
    ``torch.compile`` the handover writes to a tensor of the traced region only (Dynamo refuses
    writes to anything from outside an activation-checkpointed region)."""

    def __init__(self, members: Sequence[FP8Linear], parent: torch.nn.Module | None = None) -> None:
        members = tuple(members)
        if len(members) < 2 or len({id(m) for m in members}) != len(members):
            raise ValueError(f"members: expected two or more distinct FP8Linear, got {len(members)}")
        first = members[0]
        for m in members:
            if not isinstance(m, FP8Linear):
                raise TypeError(f"members: expected FP8Linear, got {type(m).__name__}")
            if (m.in_features, m.recipe, m.fmt) != (first.in_features, first.recipe, first.fmt):
                raise ValueError("members: expected one in_features, recipe and fmt; got "
                                 f"{[(x.in_features, x.recipe.name, x.fmt and x.fmt.name) for x in members]}")
            if m.shared_input is not None:
                raise ValueError("members: an FP8Linear belongs to one SharedInput at most")
        self.members = members
        for m in members:
            m.shared_input = self
        if parent is not None and own_input not in parent._forward_pre_hooks.values():
            parent.register_forward_pre_hook(own_input, with_kwargs=True)

    def output(self, member: FP8Linear, x: torch.Tensor) -> torch.Tensor | None:
        """``member``'s output for ``x``: kept from the member that ran the group on this very tensor,
        or computed now with every member's (the others kept on ``x``); ``None`` where ``member`` must
        run alone."""
        compiling = torch.compiler.is_compiling()
        if not compiling and x.is_inference():  # no version counter to tell an in-place write
            return None
        kept = getattr(x, KEPT_OUTPUTS, None)
        mine = kept.get(id(self)) if kept else None
        if mine is not None and id(member) in mine[1] and (compiling or mine[0] == x._version):
            out = mine[1].pop(id(member))
            if not mine[1]:
                kept.pop(id(self))
            return out
        x_in = member.input_operand(x)
        if not all(_plain_on(p, x.device) for m in self.members for p in m.parameters()):
            return None
        operands = [m.weight_operand(x_in.dtype) for m in self.members]
        outs = fp8_linears_shared_input(x_in, [w for w, _ in operands], [m.bias for m in self.members],
                                        recipe=member.recipe, fmt=member.fmt, weight_caches=[c for _, c in operands])
        others = {id(m): out for m, out in zip(self.members, outs) if m is not member}
        if kept is None:
            kept = {}
            setattr(x, KEPT_OUTPUTS, kept)
        kept[id(self)] = (None if compiling else x._version, others)
        return outs[self.members.index(member)]


def own_input(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of a ``SharedInput``'s parent: its input tensor (the first positional
    argument, else ``hidden_states``) replaced by a view of it, made in this call."""
    if args and isinstance(args[0], torch.Tensor):
        return (args[0].view_as(args[0]), *args[1:]), kwargs
    x = kwargs.get("hidden_states")
    if isinstance(x, torch.Tensor):
        return args, {**kwargs, "hidden_states": x.view_as(x)}
    return args, kwargs


def _plain_on(param: torch.Tensor, device: torch.device) -> bool:
    """A parameter ``fp8_linears_shared_input`` can read here: a plain tensor (not FSDP's sharded ``DTensor``), on
    ``device`` (not on the meta device)."""
    return type(param) in (torch.Tensor, torch.nn.Parameter) and param.device == device


#: Children of one module that the Hugging Face models call on the same input: attention's
#: projections, an MLP's gate and up projections, MLA's query and key-value down projections.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa"))
#: The transformers classes (self-attention and MLPs, by class name) whose forward calls each
#: ``SIBLINGS`` set on one tensor, and the library's own MLP.
PARENTS = frozenset(f"{family}{kind}" for family in (
    "Llama", "Mistral", "Mixtral", "Qwen2", "Qwen2Moe", "Qwen3", "Qwen3Moe", "DeepseekV3", "Llama4Text", "Olmoe",
) for kind in ("Attention", "MLP")) | {"SwiGLUMLP"}


def sibling_linears(parent: torch.nn.Module) -> list[list[tuple[str, torch.nn.Linear]]]:
    """Per ``SIBLINGS`` set, the children of those names of a ``PARENTS`` module that are ``nn.Linear``
    (``FP8Linear`` included) of one ``in_features``, as ``(name, module)``; sets of fewer than two
    left out."""
    if type(parent).__name__ not in PARENTS:
        return []
    found = []
    for names in SIBLINGS:
        children = [(n, getattr(parent, n, None)) for n in names]
        children = [(n, c) for n, c in children if isinstance(c, torch.nn.Linear)]
        if len(children) > 1 and len({c.in_features for _, c in children}) == 1:
            found.append(children)
    return found


def join_siblings(parent: torch.nn.Module) -> list[tuple[list[str], SharedInput]]:
    """A ``SharedInput`` for each set of ``parent``'s sibling ``FP8Linear`` (``sibling_linears``) with
    one recipe and format, two or more of them and none in a group yet: ``(names, group)`` each."""
    joined = []
    for children in sibling_linears(parent):
        fp8 = [(n, c) for n, c in children if isinstance(c, FP8Linear) and c.recipe.is_fp8 and c.shared_input is None]
        if len(fp8) > 1 and len({(c.recipe, c.fmt) for _, c in fp8}) == 1:
            joined.append(([n for n, _ in fp8], SharedInput([c for _, c in fp8], parent)))
    return joined
