"""``convert``: a whole Hugging Face transformers model to FP8 in place: the MoE blocks' experts (here)
and the dense linears (``convert.convert_linears``), with a ``ConversionReport``. A model without MoE
blocks (Llama, Mistral, ...) has its dense linears converted alone.

Supported blocks and what replaces what:

| block | transformers 5.x (3D expert weights) | transformers 4.x (``ModuleList`` experts) |
|---|---|---|
| ``MixtralSparseMoeBlock`` | ``block.experts`` -> ``FP8GroupedExperts`` sharing the weights | whole block -> ``FP8HFMoEBlock`` (stacked weights, returns ``(out, logits)``) |
| ``Qwen3MoeSparseMoeBlock`` | same | same, ``norm_topk_prob`` honoured |
| ``DeepseekV3MoE`` | same (router, shared experts untouched) | whole block -> ``FP8HFMoEBlock`` (returns ``out``) |
| ``Llama4TextMoe`` | whole block -> ``FP8Llama4TextMoe`` sharing router, shared expert and weights, returns ``(out, logits)`` | same; before 4.54 (``nn.Linear`` router): ``(out, scores (E, T))`` |

Any other transformers 5.x MoE block whose ``experts`` module declares standard SwiGLU experts
(``hf_experts.standard_experts_issue``: Qwen2-MoE, OLMoE, GLM-4.5, DeepSeek-V2, ERNIE 4.5, MiniMax,
Phi-MoE, ...) has its ``experts`` swapped the same way, its routing left as it is.

In 5.x the original router module stays and is called, so ``output_router_logits`` recording
and aux losses keep working. Blocks are recognised by class name and attributes: ``transformers``
itself is never imported. Llama 4 in transformers from 4.54.0 until an upstream fix (around 4.56)
multiplied the expert input by the router scores without transposing them; the converted block
computes the fixed forward, so on those versions its output differs from the unconverted model's
(checked on 4.54.0 only; the router logits are identical).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..quant.recipes import Float8Recipe, get_recipe
from ..routing import RouterConfig
from .conversion_report import (
    BELOW_MIN_EXPERT_SIZE, BELOW_MIN_FP8_WGRAD_SIZE, BF16_RECIPE, DENSE_OFF, FP8_LINEAR, ConversionReport,
)
from .convert import MIN_DENSE_SIZE, check_conversion_args, check_size, convert_linears
from .experts import FP8GroupedExperts
from .fp8_linear import DENSE_RECIPES, FP8Linear, _check_dense_recipe
from .hf_blocks import FP8HFMoEBlock, FP8Llama4TextMoe
from .hf_experts import is_silu, standard_experts_issue

__all__ = ["MIN_BF16_EXPERT_SIZE", "MIN_EXPERT_SIZE", "MIN_FP8_WGRAD_SIZE", "SUPPORTED_BLOCKS", "convert"]

MIN_EXPERT_SIZE = 1024
MIN_BF16_EXPERT_SIZE = 512
MIN_FP8_WGRAD_SIZE = 1024
SUPPORTED_BLOCKS = ("MixtralSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "DeepseekV3MoE", "Llama4TextMoe")
#: the kind of a transformers 5.x block of another family with standard experts (``hf_experts``)
_STANDARD = "standard 5.x experts"
_CONVERTED = (FP8GroupedExperts, FP8Linear, FP8HFMoEBlock, FP8Llama4TextMoe)


def convert(model: nn.Module, *, recipe="rowwise", dense: bool = True, dense_recipe=None,
            filter_fn: Callable[[nn.Module, str], bool] | None = None, min_dense_size: int = MIN_DENSE_SIZE,
            min_expert_size: int = MIN_EXPERT_SIZE, min_bf16_expert_size: int = MIN_BF16_EXPERT_SIZE,
            min_fp8_wgrad_size: int = MIN_FP8_WGRAD_SIZE, backend: str | None = None, fmt=None,
            cache_weights: bool = False, cache_dense_weights: bool = False,
            fused_grad_accumulation: bool = False, share_inputs: bool = True) -> nn.Module:
    """Convert a whole model in place: every supported MoE block's experts, then the dense linears;
    return ``model`` with ``model.fp8_conversion_report`` (a ``ConversionReport``: per module what it
    became and why anything was kept; ``print`` it for a table). A model without MoE blocks (Llama,
    Mistral, any dense model) has its dense linears converted by the rules below; its report has
    ``moe_blocks == 0`` and says so.

    * Experts (the ``SUPPORTED_BLOCKS`` in either layout, and transformers 5.x blocks of any other
      family whose experts are standard SwiGLU experts: ``hf_experts``): FP8 grouped GEMMs with
      ``recipe`` (``"bf16"``: the library's BF16 grouped path, for A/B runs, and the dense linears
      are left untouched), ``backend`` / ``fmt`` / ``cache_weights`` as ``FP8GroupedExperts`` takes
      them. With an FP8 recipe, a block whose experts have
      ``min(hidden, expert hidden) < min_expert_size`` (default ``MIN_EXPERT_SIZE`` = 1024, from the
      whole-model step; 0 converts every size) runs on the library's BF16 grouped path
      instead (same weights, no FP8) when ``min(H, I) >= min_bf16_expert_size`` (default
      ``MIN_BF16_EXPERT_SIZE`` = 512, where that path beat HF's own in every mode measured), and
      is left exactly as it was below that (``min_bf16_expert_size=min_expert_size`` leaves every
      such block as built); the report says which, and why. FP8 experts with
      ``min(H, I) < min_fp8_wgrad_size`` (default ``MIN_FP8_WGRAD_SIZE`` = 1024; ``0``: never) and
      the ``rowwise`` recipe (any recipe with row scales and an FP8 weight gradient) run their weight
      gradients in BF16 (``rowwise_gw_hp``): at these sizes quantizing the wgrad operands costs
      more than the FP8 wgrad GEMMs save (docs/conversion.md).
    * Dense linears (attention and MLA projections, dense MLPs, shared experts), when ``dense``:
      ``FP8Linear`` with ``dense_recipe`` (default: ``recipe``; required for ``"blockwise"``),
      sharing the parameters. Routers, embeddings and ``lm_head`` stay as they are; so do layers
      ``filter_fn(module, fqn)`` rejects, dims not multiple of 16, and layers with
      ``min(in_features, out_features) < min_dense_size`` (default ``MIN_DENSE_SIZE`` = 1536, where
      ``FP8Linear`` starts to pay on one H200: ``benchmarks/results/dense_sweep.md``; 0 converts
      every size). See ``moe_fp8/layers/convert.py`` and docs/conversion.md.
      ``cache_dense_weights``: those ``FP8Linear`` keep their weights' FP8 layouts while unchanged,
      so gradient accumulation quantizes them once per optimizer step (one BF16-sized copy of the
      converted dense weights; off by default, for peak memory).
      ``share_inputs``: the converted linears that the model calls on one input (``q_proj`` /
      ``k_proj`` / ``v_proj``, ``gate_proj`` / ``up_proj``, ``q_a_proj`` / ``kv_a_proj_with_mqa`` of
      the classes in ``shared_input.PARENTS``) run as one ``SharedInput``: the input quantized once
      for all of them, forward and backward (docs/conversion.md).
    * ``fused_grad_accumulation``: the experts' weight-gradient GEMMs add to the weights' ``.grad``
      in place under gradient accumulation (``FP8GroupedExperts``; off by default: autograd then no
      longer sees those gradients pass, and a compiled graph cannot check what needs them; DDP
      forwards and, eagerly, ``torch.autograd.grad`` and hooked weights keep autograd's path; see
      ``moe_fp8/grouped_gemm/grad_accumulation.py``).

    ``model`` may also be a single block: the result is then the converted block (the same object
    for transformers 5.x blocks but Llama 4's, a new one otherwise). Raises ``ValueError`` naming the
    class of a block that looks like an MoE block (has ``experts``) but is not supported, and why;
    when there is nothing to convert (no supported MoE block and no linear passing the dense rules:
    the message lists ``SUPPORTED_BLOCKS`` and, per module, the rule that kept it); and when
    ``model`` holds modules this library converted already (a model is converted once: convert a
    fresh copy to change recipe).
    """
    check_conversion_args(model, filter_fn, min_dense_size)
    check_size("min_expert_size", min_expert_size)
    check_size("min_bf16_expert_size", min_bf16_expert_size)
    check_size("min_fp8_wgrad_size", min_fp8_wgrad_size)
    for name, flag in (("dense", dense), ("fused_grad_accumulation", fused_grad_accumulation)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
    expert_recipe = get_recipe(recipe)
    linear_recipe = _dense_recipe(expert_recipe, dense_recipe, dense)
    _refuse_converted(model)
    opts = dict(recipe=expert_recipe, backend=backend, fmt=fmt, cache_weights=cache_weights,
                fused_grad_accumulation=fused_grad_accumulation)
    rule = _SizeRule(min_expert_size if expert_recipe.is_fp8 else 0, min_bf16_expert_size, min_fp8_wgrad_size)
    root = _convert_block(model, opts, rule)
    if root is not None:  # a bare block: converted in place, its replacement, or itself when kept
        model, blocks = root, 1
    else:
        blocks = _convert_blocks(model, opts, rule)
    report = ConversionReport(expert_recipe.name, min_dense_size, min_expert_size, min_bf16_expert_size,
                              min_fp8_wgrad_size, moe_blocks=blocks)
    keep = DENSE_OFF if not dense else BF16_RECIPE if not expert_recipe.is_fp8 else None
    model = convert_linears(model, report, recipe=linear_recipe, filter_fn=filter_fn, min_dense_size=min_dense_size,
                            fmt=fmt, keep_reason=keep, expert_rules=rule.applied, cache_weights=cache_dense_weights,
                            share_inputs=share_inputs)
    if blocks == 0 and FP8_LINEAR not in report.counts():  # nothing was changed
        raise ValueError(f"model: nothing to convert: no MoE block found (supported: {', '.join(SUPPORTED_BLOCKS)}, "
                         "and 5.x blocks of any family with standard SwiGLU experts) "
                         f"and no linear passed the dense rules; per module, what kept it:\n{report.table()}")
    model.fp8_conversion_report = report
    return model


def _dense_recipe(expert_recipe, dense_recipe, dense: bool):
    if dense_recipe is not None:
        return _check_dense_recipe(dense_recipe)
    if not dense or not expert_recipe.is_fp8:
        return None
    if expert_recipe.name not in DENSE_RECIPES:
        raise ValueError(f"dense_recipe: recipe {expert_recipe.name!r} has no dense FP8Linear form; pass "
                         f"dense_recipe= one of {DENSE_RECIPES}, or dense=False")
    return _check_dense_recipe(expert_recipe)


def _refuse_converted(model: nn.Module) -> None:
    for fqn, m in model.named_modules():
        if isinstance(m, _CONVERTED):
            raise ValueError(f"model: already converted by moe_fp8 ({type(m).__name__} at {fqn or '<model>'!r}); "
                             "a model is converted once: convert a fresh copy")


@dataclass
class _SizeRule:
    """The expert size rules: blocks with ``min(H, I) < min_size`` run the BF16 grouped path when
    ``min(H, I) >= min_bf16_size``, else stay as built; FP8 experts with ``min(H, I) <
    min_fp8_wgrad_size`` get a BF16 weight gradient (row-scaled recipes). ``applied`` maps the
    ``id`` of each block's experts that a rule changed (after conversion) to ``(rule, why)``."""

    min_size: int
    min_bf16_size: int
    min_fp8_wgrad_size: int = 0
    applied: dict[int, tuple[str, str]] = field(default_factory=dict)


def _convert_blocks(model: nn.Module, opts: dict, rule: _SizeRule) -> int:
    """Convert every supported MoE block below ``model``; return how many there were. Raises when
    there were none but a block with ``experts`` of an unsupported class was found."""
    blocks = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = _convert_block(child, opts, rule)
            if new is not None:
                setattr(parent, name, new)
                blocks += 1
    if blocks == 0:
        found = {type(m).__name__: _unsupported_why(m) for m in model.modules() if hasattr(m, "experts")}
        if found:
            why = "; ".join(f"{name}: {reason}" for name, reason in sorted(found.items()))
            raise ValueError(f"model: unsupported MoE block class(es) ({why}); supported: {SUPPORTED_BLOCKS} and "
                             "transformers 5.x blocks of any family whose experts are standard SwiGLU experts")
    return blocks


def _unsupported_why(block: nn.Module) -> str:
    experts = block.experts
    return standard_experts_issue(experts) if isinstance(experts, nn.Module) else "experts is not a module"


def _block_kind(block: nn.Module) -> str | None:
    """The block's kind: a ``SUPPORTED_BLOCKS`` name, ``_STANDARD``, or ``None`` (not convertible)."""
    kind = type(block).__name__
    if kind in SUPPORTED_BLOCKS:
        return kind
    experts = getattr(block, "experts", None)
    if isinstance(experts, nn.Module) and standard_experts_issue(experts) is None:
        return _STANDARD
    return None


def _convert_block(block: nn.Module, opts: dict, rule: _SizeRule) -> nn.Module | None:
    """The converted block (``block`` itself when converted in place or kept by the size rule), or
    ``None`` when ``block`` is not a supported MoE block. Experts a size rule changed are recorded in
    ``rule.applied``."""
    kind = _block_kind(block)
    if kind is None:
        return None
    E, H, I = _expert_dims(block.experts, in_out=_in_out(block, kind))
    size = min(H, I)
    if size >= rule.min_size:
        recipe = opts["recipe"]
        if size >= rule.min_fp8_wgrad_size or not (recipe.scaling == "rowwise" and recipe.fp8_wgrad):
            return _replace_experts(block, kind, opts)
        new = _replace_experts(block, kind, {**opts, "recipe": bf16_wgrad(recipe)})
        rule.applied[id(new.experts)] = (BELOW_MIN_FP8_WGRAD_SIZE, f"min(H, I) < {rule.min_fp8_wgrad_size}")
        return new
    if size < rule.min_bf16_size:
        why = (f"min(H, I) < {rule.min_size}" if rule.min_bf16_size >= rule.min_size
               else f"min(H, I) < {rule.min_bf16_size} (min_bf16_expert_size)")
        rule.applied[id(block.experts)] = (BELOW_MIN_EXPERT_SIZE, f"E={E} H={H} I={I}: {why}")
        return block
    new = _replace_experts(block, kind, {**opts, "recipe": get_recipe("bf16"), "cache_weights": False})
    rule.applied[id(new.experts)] = (BELOW_MIN_EXPERT_SIZE, f"min(H, I) < {rule.min_size}")
    return new


def bf16_wgrad(recipe: Float8Recipe) -> Float8Recipe:
    """``recipe`` with its weight gradient in BF16, named ``<name>_gw_hp`` (``rowwise`` gives the
    registered ``rowwise_gw_hp``)."""
    return recipe.replace(name=f"{recipe.name}_gw_hp", fp8_wgrad=False)


def _replace_experts(block: nn.Module, kind: str, opts: dict) -> nn.Module:
    """``block`` with its experts on ``FP8GroupedExperts`` built from ``opts`` (in place for 5.x
    blocks, a replacement block otherwise)."""
    if kind == "Llama4TextMoe":
        return _llama4(block, opts)
    if isinstance(block.experts, nn.ModuleList):
        return _v4_block(block, kind, opts)
    block.experts = _share_3d_experts(block.experts, opts, in_out=_in_out(block, kind))
    return block


def _in_out(block: nn.Module, kind: str) -> bool:
    """Whether the block's 3D expert weights are stored transposed (Llama 4's ``(E, H, 2I)``)."""
    return kind == "Llama4TextMoe" or (kind == _STANDARD and bool(block.experts.is_transposed))


def _expert_dims(experts: nn.Module, *, in_out: bool) -> tuple[int, int, int]:
    """``(num_experts, hidden, expert hidden)`` of a supported block's experts, read off the weights:
    a 4.x ``ModuleList`` of MLPs (Mixtral's ``w1`` or ``gate_proj``: ``(I, H)``), or 5.x 3D weights
    (``down_proj`` ``(E, H, I)``; ``(E, I, H)`` in Llama 4's ``in_out`` layout)."""
    if isinstance(experts, nn.ModuleList):
        first = experts[0]
        gate = first.w1 if hasattr(first, "w1") else first.gate_proj
        return len(experts), gate.weight.shape[1], gate.weight.shape[0]
    E, a, b = experts.down_proj.shape
    return (E, b, a) if in_out else (E, a, b)


def _check_act(module: nn.Module, where: str) -> None:
    act = getattr(module, "act_fn", None)
    if act is not None and not is_silu(act):
        raise ValueError(f"{where}: only SiLU (SwiGLU) experts are supported, got {type(act).__name__}")


def _share_3d_experts(experts: nn.Module, opts: dict, *, in_out: bool = False) -> FP8GroupedExperts:
    """An ``FP8GroupedExperts`` that holds the SAME parameters as a transformers 5.x experts module."""
    _check_act(experts, type(experts).__name__)
    E, H, I = _expert_dims(experts, in_out=in_out)
    new = FP8GroupedExperts(E, H, I, in_out_layout=in_out, device="meta", **opts)
    new.gate_up_proj, new.down_proj = experts.gate_up_proj, experts.down_proj
    return new


def _stack_experts(mlps: nn.ModuleList, gate: str, up: str, down: str, opts: dict) -> FP8GroupedExperts:
    """Copy a ``ModuleList`` of SwiGLU MLPs into 3D weights ``(E, 2I, H)`` / ``(E, H, I)``."""
    _check_act(mlps[0], type(mlps[0]).__name__)
    w1 = torch.stack([torch.cat([getattr(m, gate).weight, getattr(m, up).weight]) for m in mlps]).detach()
    w2 = torch.stack([getattr(m, down).weight for m in mlps]).detach()
    E, two_i, H = w1.shape
    new = FP8GroupedExperts(E, H, two_i // 2, device="meta", **opts)
    new.gate_up_proj, new.down_proj = nn.Parameter(w1), nn.Parameter(w2)
    return new


def _v4_block(block: nn.Module, kind: str, opts: dict) -> FP8HFMoEBlock:
    E, k = len(block.experts), int(getattr(block, "top_k", 0) or block.gate.top_k)
    if kind == "MixtralSparseMoeBlock":
        experts = _stack_experts(block.experts, "w1", "w3", "w2", opts)
        cfg = RouterConfig(E, k, "softmax", renormalize=True)
        return FP8HFMoEBlock(block.gate, experts, cfg)
    if kind == "Qwen3MoeSparseMoeBlock":
        experts = _stack_experts(block.experts, "gate_proj", "up_proj", "down_proj", opts)
        cfg = RouterConfig(E, k, "softmax", renormalize=bool(block.norm_topk_prob))
        return FP8HFMoEBlock(block.gate, experts, cfg)
    gate = block.gate  # DeepseekV3TopkRouter
    experts = _stack_experts(block.experts, "gate_proj", "up_proj", "down_proj", opts)
    cfg = RouterConfig(
        E, k, "sigmoid", renormalize=bool(gate.norm_topk_prob), n_group=gate.n_group, topk_group=gate.topk_group,
        use_correction_bias=True, routed_scaling_factor=float(gate.routed_scaling_factor),
    )
    return FP8HFMoEBlock(gate, experts, cfg, shared_experts=block.shared_experts, returns_logits=False,
                         logits_fp32=True)


def _llama4(block: nn.Module, opts: dict) -> FP8Llama4TextMoe:
    experts = _share_3d_experts(block.experts, opts, in_out=True)
    # transformers < 4.54 used a plain nn.Linear router and routed (and returned scores) in the block
    linear_router = not any(c.__name__ == "Llama4Router" for c in type(block.router).__mro__)
    return FP8Llama4TextMoe(block.router, experts, block.shared_expert, top_k=block.top_k,
                            linear_router=linear_router)
