"""``hf.convert`` on transformers 5.x MoE families beyond the four with block converters of their own:
blocks whose experts declare standard SwiGLU experts (``moe_fp8.layers.hf_experts``) have their
``experts`` swapped for ``FP8GroupedExperts`` sharing the parameters, the routing left as it is.

Tiny models of each family (two layers, eval mode: Phi-MoE's router samples in training) against
the unconverted model: the library's BF16 grouped path within BF16 rounding, rowwise FP8 within FP8's
error, gradients in every expert weight. Families this transformers does not have are skipped."""

import copy

import pytest
import torch
from torch import nn

from moe_fp8 import FP8GroupedExperts, hf
from moe_fp8.layers import conversion_report as cr
from moe_fp8.layers.hf_experts import standard_experts_issue
from moe_fp8.testing import sqnr

transformers = pytest.importorskip("transformers")

FAMILIES = ["qwen2_moe", "olmoe", "glm4_moe", "deepseek_v2", "ernie4_5_moe", "minimax", "phimoe", "granitemoe",
            "hunyuan_v1_moe"]
V = 96
# every family's own names for the sizes; a config keeps the ones it does not know as attributes
_SIZES = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=V, num_experts=8,
              n_routed_experts=8, num_local_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=32,
              first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
              qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
              decoder_sparse_step=1, mlp_only_layers=[], moe_layer_start_index=0, pad_token_id=0, eos_token_id=1,
              bos_token_id=2)


def _model(family: str) -> nn.Module:
    try:
        config = transformers.AutoConfig.for_model(family, **_SIZES)
    except (KeyError, ValueError):
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_standard_experts_of_other_families(family):
    model = _model(family)
    ids = torch.randint(3, V, (2, 8), generator=torch.Generator().manual_seed(1))
    want = model(ids).logits.float()
    originals = [m.experts for m in model.modules() if hasattr(m, "experts")]
    assert originals and all(standard_experts_issue(e) is None for e in originals)
    for recipe, floor in (("bf16", 40.0), ("rowwise", 30.0)):
        converted = copy.deepcopy(model)
        hf.convert(converted, recipe=recipe, dense=False, min_expert_size=0)
        named = {n: m for n, m in converted.named_modules() if isinstance(m, FP8GroupedExperts)}
        experts = list(named.values())
        assert len(experts) == len(originals) and converted.fp8_conversion_report.moe_blocks == len(originals)
        became = {e.became for e in converted.fp8_conversion_report.entries if e.fqn in named}
        assert became == {cr.FP8_EXPERTS if recipe == "rowwise" else cr.BF16_EXPERTS}
        out = converted(ids, labels=ids)
        assert sqnr(want, out.logits.float()) >= floor, recipe
        out.loss.backward()
        for e in experts:
            for p in (e.gate_up_proj, e.down_proj):
                assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
    shared = copy.deepcopy(model)
    weights = [(m.experts.gate_up_proj, m.experts.down_proj) for m in shared.modules() if hasattr(m, "experts")]
    hf.convert(shared, dense=False, min_expert_size=0)
    now = [(m.experts.gate_up_proj, m.experts.down_proj) for m in shared.modules() if hasattr(m, "experts")]
    assert all(a is c and b is d for (a, b), (c, d) in zip(weights, now))  # the same parameters, no copy
    assert set(shared.state_dict()) == set(model.state_dict())


def test_experts_of_another_kind_are_refused_with_the_reason():
    """GPT-OSS experts (biases, interleaved gate/up rows, a gate function of their own) are not
    what ``FP8GroupedExperts`` computes: the conversion names the block and why."""
    model = _model("gpt_oss")
    with pytest.raises(ValueError, match=r"unsupported MoE block class\(es\) \(GptOssMLP: expert biases\)"):
        hf.convert(model, min_expert_size=0)


class _Experts(nn.Module):
    """The attributes ``use_experts_implementation`` puts on an experts module, standard values."""

    def __init__(self, E=4, H=32, I=16, transposed=False):
        super().__init__()
        self.has_gate, self.has_bias, self.is_concatenated, self.has_post_expert_norm = True, False, True, False
        self.is_transposed, self._is_expert_parallel = transposed, False
        shapes = ((E, H, 2 * I), (E, I, H)) if transposed else ((E, 2 * I, H), (E, H, I))
        self.gate_up_proj, self.down_proj = (nn.Parameter(torch.zeros(s)) for s in shapes)
        self.act_fn = nn.SiLU()


@pytest.mark.parametrize("change, why", [
    (dict(has_gate=False), "experts without a gate"),
    (dict(has_bias=True), "expert biases"),
    (dict(is_concatenated=False), "interleaved gate and up rows"),
    (dict(has_post_expert_norm=True), "a norm after each expert"),
    (dict(_is_expert_parallel=True), "transformers' own expert parallelism"),
    (dict(act_fn=nn.GELU()), "activation GELU"),
    (dict(down_proj=nn.Parameter(torch.zeros(4, 32, 8))), "do not match"),
])
def test_standard_experts_checks(change, why):
    assert standard_experts_issue(_Experts()) is None and standard_experts_issue(_Experts(transposed=True)) is None
    experts = _Experts()
    for name, value in change.items():
        setattr(experts, name, value)
    assert why in standard_experts_issue(experts)
    assert "not a transformers 5.x experts module" in standard_experts_issue(nn.Linear(4, 4))
