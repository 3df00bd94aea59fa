"""``SharedInput``: ``FP8Linear`` layers that read one input tensor, run as one ``fp8_linears_shared_input`` call.

A model calls attention's ``q_proj``, ``k_proj`` and ``v_proj`` (an MLP's ``gate_proj`` and ``up_proj``)
one after another on the same tensor. Alone, each ``FP8Linear`` quantizes that tensor itself: its
rows for the forward GEMM and, in the backward, ``x.T`` for its weight gradient. Joined in a
``SharedInput``, the first member called computes every member's output in one ``fp8_linears_shared_input`` call
(x quantized once each way, one autograd node whose input gradients add up) and keeps the other
outputs; each other member called with the same tensor object (eagerly: at the same version)
takes its output from there. A member called with another input, or called again before the
others, and weights that are not plain tensors on the input's device (FSDP's sharded parameters)
and inference tensors (which keep no version counter) run the member alone, as without the group:
the values are the same either way. Outputs a member never takes are dropped at the group's next run.

Under ``torch.compile`` the group's Python runs at trace time: the outputs are handed over inside
the traced graph (tensor identity is traced, version counters are not read).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .fp8_linear import FP8Linear, fp8_linears_shared_input

__all__ = ["SharedInput"]


class SharedInput:
    """The members (two or more ``FP8Linear`` of the same ``in_features``, recipe and format) of one
    input. ``FP8Linear.forward`` asks :meth:`output`; ``SharedInput(members)`` sets each member's
    ``shared_input``."""

    def __init__(self, members: Sequence[FP8Linear]) -> None:
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
        self._x: torch.Tensor | None = None
        self._version: int | None = None
        self._pending: dict[int, torch.Tensor] = {}
        for m in members:
            m.shared_input = self

    def output(self, member: FP8Linear, x: torch.Tensor) -> torch.Tensor | None:
        """``member``'s output for ``x``: kept from the member that ran the group on this very tensor,
        or computed now with every member's (the others kept); ``None`` where ``member`` must run alone."""
        if self._holds(x) and id(member) in self._pending:
            out = self._pending.pop(id(member))
            if not self._pending:
                self._x = None
            return out
        self._x, self._pending = None, {}
        x_in = member.input_operand(x)
        if (not torch.compiler.is_compiling() and x.is_inference()) or not all(_plain_on(p, x.device) for m in self.members for p in m.parameters()):
            return None
        operands = [m.weight_operand(x_in.dtype) for m in self.members]
        outs = fp8_linears_shared_input(x_in, [w for w, _ in operands], [m.bias for m in self.members], recipe=member.recipe,
                           fmt=member.fmt, weight_caches=[c for _, c in operands])
        mine = None
        for m, out in zip(self.members, outs):
            if m is member:
                mine = out
            else:
                self._pending[id(m)] = out
        self._x = x
        self._version = None if torch.compiler.is_compiling() else x._version
        return mine

    def _holds(self, x: torch.Tensor) -> bool:
        if self._x is not x:
            return False
        return torch.compiler.is_compiling() or self._version == x._version


def _plain_on(param: torch.Tensor, device: torch.device) -> bool:
    """A parameter ``fp8_linears_shared_input`` can read here: a plain tensor (not FSDP's sharded ``DTensor``), on
    ``device`` (not on the meta device)."""
    return type(param) in (torch.Tensor, torch.nn.Parameter) and param.device == device


#: Children of one module that the Hugging Face models call on the same input: attention's
#: projections, an MLP's gate and up projections, MLA's query and key-value down projections.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa"))


def sibling_linears(parent: torch.nn.Module) -> list[list[tuple[str, torch.nn.Linear]]]:
    """Per ``SIBLINGS`` set, ``parent``'s children of those names that are ``nn.Linear`` (``FP8Linear``
    included) of one ``in_features``, as ``(name, module)``; sets of fewer than two left out."""
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
            joined.append(([n for n, _ in fp8], SharedInput([c for _, c in fp8])))
    return joined
