"""Dense part of a model conversion: ``nn.Linear`` -> ``FP8Linear`` in place, every decision reported.

``convert_to_fp8`` (users' own models) and ``moe_fp8.hf.convert`` (after the MoE experts) share
``convert_linears``. What stays high precision, whatever ``filter_fn`` says:

* routers: a module whose class name contains ``Router`` (``DeepseekV3TopkRouter``,
  ``Llama4Router``, ``MixtralTopKRouter``, the library's ``Router``), or an ``nn.Linear`` named
  ``gate`` / ``router`` whose parent has ``experts``: top-k selection is not robust to FP8 logits;
* embeddings (``nn.Embedding``) and ``lm_head`` (by name, or an ``nn.Linear`` tied to an
  embedding's weight): a lookup, and the logits that the loss and sampling read directly;
* ``nn.Linear`` subclasses other than ``FP8Linear`` (their forward is not ``F.linear``).

Then ``filter_fn(module, fqn) -> bool`` (False: kept), dims not multiple of 16 (``torch._scaled_mm``
needs them), and the size rule ``min(in_features, out_features) < min_dense_size``: FP8 quantization
is memory-bound work, about three memory passes over each operand (read, write the codes, read them
again in the GEMM), a cost linear in the tensor sizes against a GEMM saving that grows with K*N, so
below a size FP8 cannot pay. ``MIN_DENSE_SIZE`` (1536) is read off an H200 sweep at 8192 tokens
(``benchmarks/results/dense_sweep.md``, GPU time alone): every shape with ``min(K, N) >= 1536``
was 1.35-1.67x BF16, every one below 0.32-0.92x (docs/conversion.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn

from .conversion_report import (
    BELOW_MIN_SIZE, BF16_EXPERTS, EMBEDDING, FILTER_FN, FP8_EXPERTS, FP8_LINEAR, KEPT, LM_HEAD,
    NOT_MULTIPLE_OF_16, NOT_PLAIN_LINEAR, ROUTER, ConversionReport,
)
from .experts import FP8GroupedExperts
from .fp8_linear import FP8Linear, _check_dense_recipe
from .shared_input import join_siblings

__all__ = ["MIN_DENSE_SIZE", "check_conversion_args", "check_size", "convert_linears", "convert_to_fp8", "is_router"]

log = logging.getLogger("moe_fp8")

MIN_DENSE_SIZE = 1536
FilterFn = Callable[[nn.Module, str], bool]


def convert_to_fp8(
    model: nn.Module,
    recipe="rowwise",
    filter_fn: FilterFn | None = None,
    *,
    min_dense_size: int = 0,
    fmt=None,
    cache_weights: bool = False,
    share_inputs: bool = True,
) -> nn.Module:
    """Replace the plain ``nn.Linear`` layers of ``model`` (in place) by ``FP8Linear`` layers sharing
    their parameters; return ``model`` with ``model.fp8_conversion_report`` (a ``ConversionReport``).

    Routers, embeddings and ``lm_head`` stay as they are; so do layers ``filter_fn(module, fqn)``
    rejects, layers with a dim not a multiple of 16, and (``min_dense_size > 0``) layers with
    ``min(in_features, out_features) < min_dense_size`` (see this module's docstring; the default 0
    converts every size, pass ``MIN_DENSE_SIZE`` for the rule). Each kept layer is also logged on the
    ``moe_fp8`` logger at INFO level. Layers already ``FP8Linear`` (and FP8 experts) are reported as
    they are: converting twice changes nothing. A bare ``nn.Linear`` is returned converted.
    ``cache_weights``: the new layers keep their weights' FP8 layouts while unchanged (``FP8Linear``;
    one BF16-sized copy of each weight, for gradient accumulation).
    ``share_inputs``: sibling linears that the model calls on one input (``shared_input.SIBLINGS``:
    ``q_proj`` / ``k_proj`` / ``v_proj``, ``gate_proj`` / ``up_proj``, ``q_a_proj`` /
    ``kv_a_proj_with_mqa``) in the model classes known to call them on one tensor
    (``shared_input.PARENTS``) run as one ``SharedInput``, the input quantized once for all of them.
    """
    recipe = _check_dense_recipe(recipe)
    check_conversion_args(model, filter_fn, min_dense_size)
    report = ConversionReport(recipe.name, min_dense_size)
    model = convert_linears(model, report, recipe=recipe, filter_fn=filter_fn, min_dense_size=min_dense_size,
                            fmt=fmt, cache_weights=cache_weights, share_inputs=share_inputs)
    model.fp8_conversion_report = report
    return model


def check_conversion_args(model, filter_fn, min_dense_size) -> None:
    """``TypeError`` / ``ValueError`` naming the argument, for the arguments both converters take."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn: expected a callable (module, fqn) -> bool or None, got {type(filter_fn).__name__}")
    check_size("min_dense_size", min_dense_size)


def check_size(name: str, value) -> None:
    """``TypeError`` / ``ValueError`` naming ``name`` unless ``value`` is an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name}: expected >= 0, got {value}")


def convert_linears(model: nn.Module, report: ConversionReport, *, recipe, filter_fn: FilterFn | None,
                    min_dense_size: int, fmt=None, keep_reason: str | None = None,
                    expert_rules: dict[int, tuple[str, str]] | None = None, cache_weights: bool = False,
                    share_inputs: bool = False) -> nn.Module:
    """Walk ``model``: record experts, routers, embeddings and linears in ``report``, swap the linears
    that pass every rule (none when ``keep_reason`` is given: all are kept for that reason).
    ``expert_rules`` maps the ``id`` of experts an expert size rule changed to ``(rule, why)``: the
    ``FP8GroupedExperts`` made for them (the detail says which rule and why), or the experts left as
    they were (recorded as kept for that rule, not entered); ``cache_weights``: ``FP8Linear``'s;
    ``share_inputs``: as ``convert_to_fp8`` takes it.
    Returns ``model``, or its replacement when ``model`` itself is a converted ``nn.Linear``."""
    for flag_name, flag in (("cache_weights", cache_weights), ("share_inputs", share_inputs)):
        if not isinstance(flag, bool):
            raise TypeError(f"{flag_name}: expected a bool, got {type(flag).__name__}")
    ctx = dict(report=report, recipe=recipe, filter_fn=filter_fn, min_size=min_dense_size, fmt=fmt,
               cache_weights=cache_weights, keep_reason=keep_reason, seen=set(), expert_rules=expert_rules or {},
               tied={id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}, share=share_inputs)
    new = _visit(None, "", model, "", ctx)
    return model if new is None else new


def _visit(parent, name: str, module: nn.Module, fqn: str, ctx: dict) -> nn.Module | None:
    """Record ``module`` (or recurse into it); return its replacement, or ``None`` to keep it."""
    if id(module) in ctx["seen"]:
        return None
    ctx["seen"].add(id(module))
    report = ctx["report"]
    applied = ctx["expert_rules"].get(id(module))
    if isinstance(module, FP8GroupedExperts):
        became = FP8_EXPERTS if module.recipe.is_fp8 else BF16_EXPERTS
        detail = f"E={module.num_experts} H={module.hidden_size} I={module.expert_hidden_size}, {module.recipe.name}"
        report.add(fqn, module, became, detail=f"{detail} ({applied[0]}: {applied[1]})" if applied else detail)
    elif applied is not None:
        report.add(fqn, module, KEPT, *applied)
        log.info("%s stays as it was (%s): %s", fqn or "<model>", *applied)
    elif isinstance(module, nn.Embedding):
        report.add(fqn, module, KEPT, EMBEDDING, f"{module.num_embeddings}x{module.embedding_dim}")
    elif is_router(parent, name, module):
        report.add(fqn, module, KEPT, ROUTER, _shape(module))
    elif isinstance(module, nn.Linear):
        return _linear(module, name, fqn, ctx)
    else:
        for child_name, child in list(module.named_children()):
            new = _visit(module, child_name, child, f"{fqn}.{child_name}" if fqn else child_name, ctx)
            if new is not None:
                setattr(module, child_name, new)
        if ctx["share"]:
            for names, _ in join_siblings(module):
                for n in names:
                    others = ", ".join(o for o in names if o != n)
                    report.annotate(f"{fqn}.{n}" if fqn else n, f"input quantized with {others}")
    return None


def is_router(parent: nn.Module, name: str, module: nn.Module) -> bool:
    """Whether ``module``, the child ``name`` of ``parent``, is a MoE router (kept out of FP8): a class
    named like one, or an ``nn.Linear`` called ``gate`` / ``router`` beside ``experts``."""
    if "router" in type(module).__name__.lower():
        return True
    return isinstance(module, nn.Linear) and name in ("gate", "router") and hasattr(parent, "experts")


def _shape(module: nn.Module) -> str:
    w = getattr(module, "weight", None)
    return "x".join(map(str, w.shape)) if w is not None else ""


def _linear(module: nn.Linear, name: str, fqn: str, ctx: dict) -> FP8Linear | None:
    report, detail = ctx["report"], f"{module.in_features}->{module.out_features}"
    if isinstance(module, FP8Linear):
        report.add(fqn, module, FP8_LINEAR, detail=f"{detail}, {module.recipe.name} (already FP8Linear)")
        return None
    reason = _keep_reason(module, name, fqn, ctx)
    if reason is not None:
        reason, why = reason
        report.add(fqn, module, KEPT, reason, f"{detail}{why}")
        log.info("%s stays in BF16 (%s): %s%s", fqn or "<model>", reason, detail, why)
        return None
    new = FP8Linear.from_linear(module, recipe=ctx["recipe"], fmt=ctx["fmt"], cache_weights=ctx["cache_weights"])
    report.add(fqn, new, FP8_LINEAR, detail=f"{detail}, {new.recipe.name}", cls=type(module).__name__)
    return new


def _keep_reason(module: nn.Linear, name: str, fqn: str, ctx: dict) -> tuple[str, str] | None:
    """``(reason, detail suffix)`` when ``module`` stays high precision, else ``None``."""
    if name == "lm_head" or id(module.weight) in ctx["tied"]:
        return LM_HEAD, ""
    if type(module) is not nn.Linear:
        return NOT_PLAIN_LINEAR, ""
    if ctx["keep_reason"] is not None:
        return ctx["keep_reason"], ""
    if ctx["filter_fn"] is not None and not ctx["filter_fn"](module, fqn):
        return FILTER_FN, ""
    dims = (("in_features", module.in_features), ("out_features", module.out_features))
    bad = [f"{n}={v}" for n, v in dims if v % 16]
    if bad:
        return NOT_MULTIPLE_OF_16, ": " + ", ".join(bad)
    if min(module.in_features, module.out_features) < ctx["min_size"]:
        return BELOW_MIN_SIZE, f": min(in, out) < {ctx['min_size']}"
    return None
