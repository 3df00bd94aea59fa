"""Which transformers 5.x experts modules ``FP8GroupedExperts`` can stand in for, whatever the family.

In transformers 5.x an MoE block routes and then calls ``self.experts(hidden_states, top_k_index,
top_k_weights)``; the experts classes decorated with ``use_experts_implementation`` declare their
layout on each instance (``has_gate``, ``has_bias``, ``is_concatenated``, ``is_transposed``,
``has_post_expert_norm``) so that transformers' own grouped-GEMM forward can replace theirs. Those
that declare SwiGLU experts without biases, ``[gate; up]`` rows and no norm after each expert,
apply the default gate (``act_fn(gate) * up``) with SiLU, and hold ``gate_up_proj (E, 2I, H)`` and
``down_proj (E, H, I)`` (``(E, H, 2I)`` / ``(E, I, H)`` when transposed) compute exactly what
``FP8GroupedExperts`` computes: the block's ``experts`` is swapped, its router left alone. Recognised
by these attributes: ``transformers`` itself is never imported.
"""

from __future__ import annotations

from torch import nn

__all__ = ["is_silu", "standard_experts_issue"]


def is_silu(act) -> bool:
    """Whether the activation module ``act`` is SiLU (torch's, or transformers' ``SiLUActivation``)."""
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def standard_experts_issue(experts: nn.Module) -> str | None:
    """``None`` when ``experts`` is a standard transformers 5.x SwiGLU experts module (module
    docstring), else why not, in a few words."""
    if not all(hasattr(experts, a) for a in ("has_gate", "is_transposed", "gate_up_proj", "down_proj")):
        return "not a transformers 5.x experts module with 3D gate_up_proj / down_proj weights"
    checks = (
        (not experts.has_gate, "experts without a gate (not SwiGLU)"),
        (getattr(experts, "has_bias", False), "expert biases"),
        (not getattr(experts, "is_concatenated", True), "interleaved gate and up rows"),
        (getattr(experts, "has_post_expert_norm", False), "a norm after each expert"),
        (getattr(experts, "_is_expert_parallel", False), "transformers' own expert parallelism"),
        (getattr(type(experts), "_apply_gate", None) is not None
         and type(experts)._apply_gate.__name__ != "_default_apply_gate", "a gate function of its own"),
    )
    for failed, why in checks:
        if failed:
            return why
    act = getattr(experts, "act_fn", None)
    if not is_silu(act):
        return f"activation {type(act).__name__} (SiLU only)"
    w1, w2 = experts.gate_up_proj, experts.down_proj
    if not (isinstance(w1, nn.Parameter) and isinstance(w2, nn.Parameter) and w1.dim() == w2.dim() == 3):
        return "gate_up_proj / down_proj are not 3D parameters"
    E, a, b = w1.shape
    two_i, h = (b, a) if experts.is_transposed else (a, b)
    want = (E, h, two_i // 2) if not experts.is_transposed else (E, two_i // 2, h)
    if two_i % 2 or tuple(w2.shape) != want:
        return f"gate_up_proj {tuple(w1.shape)} and down_proj {tuple(w2.shape)} do not match"
    return None
