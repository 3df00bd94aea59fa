"""The demo's model: a small Hugging Face ``DeepseekV3ForCausalLM``, built from a config and
converted with the library (``moe_fp8.hf.convert``), once per recipe from the same weights.

* ``bf16``: the MoE blocks converted with ``recipe="bf16"`` (the library's BF16 grouped GEMMs,
  the strongest BF16 baseline of the same module);
* ``rowwise``: the MoE blocks converted with ``recipe="rowwise"``; with ``fp8_dense="shared"`` the
  shared expert's linears too (a ``filter_fn``), with ``"all"`` every dense linear the converter
  takes (attention / MLA projections and shared experts; routers and ``lm_head`` stay), with
  ``"none"`` the routed experts only (``dense=False``). The size rules are off
  (``min_expert_size=0``, ``min_fp8_wgrad_size=0``, ``min_dense_size=0``): the demo's layers are
  small by design. On the tiny CPU model (200 steps) the validation-loss gap to BF16 was 0.75%
  with ``"none"``, 1.25% with ``"shared"``, 2.0% with ``"all"``.

The weight cache is off: a training step updates every weight, so a cached FP8 copy would never
be reused.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from .. import hf
from .corpus import VOCAB


@dataclass(frozen=True)
class ModelSize:
    """The sizes a command line chooses (``hidden``, ``expert_hidden`` multiples of 16)."""

    hidden: int
    expert_hidden: int
    experts: int
    top_k: int
    layers: int
    heads: int
    seq: int


def deepseek_config(size: ModelSize):
    """A ``DeepseekV3Config``: every layer MoE (one shared expert), MLA attention with equal
    query/key and value head dims (128 = 64 + 64 rope), sigmoid group-limited routing."""
    from transformers import DeepseekV3Config

    head = max(32, min(128, size.hidden // size.heads))
    groups = 4 if size.experts % 4 == 0 and size.experts >= 8 else 1
    return DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=size.hidden, intermediate_size=size.expert_hidden,
        moe_intermediate_size=size.expert_hidden, num_hidden_layers=size.layers,
        num_attention_heads=size.heads, num_key_value_heads=size.heads, n_shared_experts=1,
        n_routed_experts=size.experts, num_experts_per_tok=size.top_k, n_group=groups,
        topk_group=max(1, groups // 2), first_k_dense_replace=0, q_lora_rank=None,
        kv_lora_rank=max(32, size.hidden // 4), qk_rope_head_dim=head // 2, qk_nope_head_dim=head // 2,
        v_head_dim=head, max_position_embeddings=max(size.seq, 256), routed_scaling_factor=1.0,
        norm_topk_prob=True, tie_word_embeddings=False, rope_scaling=None,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


DENSE_FILTERS = {  # fp8_dense -> hf.convert's dense options
    "none": dict(dense=False),
    "shared": dict(filter_fn=lambda _module, fqn: ".shared_experts." in fqn, min_dense_size=0),
    "all": dict(min_dense_size=0),
}


def build_pair(size: ModelSize, device: str, *, backend: str | None, fp8_dense: str = "shared",
               seed: int = 0) -> dict[str, nn.Module]:
    """``{"bf16": model, "rowwise": model}``: the same initial weights (bf16), converted per recipe."""
    from transformers import DeepseekV3ForCausalLM

    if fp8_dense not in DENSE_FILTERS:
        raise ValueError(f"fp8_dense: expected one of {list(DENSE_FILTERS)}, got {fp8_dense!r}")
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it trains (a GPU-sized model inits in seconds there)
        base = DeepseekV3ForCausalLM(deepseek_config(size)).to(dtype=torch.bfloat16)
    models = {}
    for recipe in ("bf16", "rowwise"):
        model = copy.deepcopy(base)
        dense = DENSE_FILTERS[fp8_dense] if recipe != "bf16" else {}  # bf16: the linears stay as built
        hf.convert(model, recipe=recipe, backend=backend, cache_weights=False, min_expert_size=0,
                   min_fp8_wgrad_size=0, **dense)
        models[recipe] = model.train()
    return models
