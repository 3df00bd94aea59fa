"""What ``hf.convert``'s default size rules do to real models: layers of Qwen3-30B-A3B, DeepSeek-V3,
Mixtral-8x7B, Llama3-8B and two small-expert Qwen3-MoEs, built from their configs on the meta device
(no memory), each module's outcome checked against the rules' tables in docs/conversion.md."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moe_fp8 import hf  # noqa: E402
from moe_fp8.layers import conversion_report as cr  # noqa: E402

F, K, BF16, FP8E = cr.FP8_LINEAR, cr.KEPT, cr.BF16_EXPERTS, cr.FP8_EXPERTS
ATTN = {"q_proj": F, "k_proj": K, "v_proj": K, "o_proj": F}  # GQA with 8 (or 4) KV heads of 128
MLA = {"q_a_proj": F, "q_b_proj": F, "kv_a_proj_with_mqa": K, "kv_b_proj": K, "o_proj": F}


def _qwen3(hidden: int, expert: int, heads: int, kv_heads: int):
    return transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=hidden, intermediate_size=4 * hidden, moe_intermediate_size=expert,
        num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128, num_experts=128,
        num_experts_per_tok=8)


CONFIGS = {
    "qwen3_30b_a3b": (lambda: _qwen3(2048, 768, 32, 4),
                      {**{f"layers.0.self_attn.{n}": b for n, b in ATTN.items()}, "layers.0.mlp.experts": BF16}),
    "qwen3_moe_i512": (lambda: _qwen3(2048, 512, 32, 4),
                       {**{f"layers.0.self_attn.{n}": b for n, b in ATTN.items()}, "layers.0.mlp.experts": BF16}),
    "qwen3_moe_h1024": (lambda: _qwen3(1024, 384, 16, 4),
                        {**{f"layers.0.self_attn.{n}": K for n in ATTN}, "layers.0.mlp.experts": K}),
    "deepseek_v3": (lambda: transformers.DeepseekV3Config(
        vocab_size=1024, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=2,
        first_k_dense_replace=1, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, n_group=8, topk_group=4),
        {**{f"layers.{i}.self_attn.{n}": b for i in (0, 1) for n, b in MLA.items()},
         **{f"layers.0.mlp.{n}": F for n in ("gate_proj", "up_proj", "down_proj")},
         **{f"layers.1.mlp.shared_experts.{n}": F for n in ("gate_proj", "up_proj", "down_proj")},
         "layers.1.mlp.experts": FP8E}),
    "mixtral_8x7b": (lambda: transformers.MixtralConfig(
        vocab_size=1024, hidden_size=4096, intermediate_size=14336, num_hidden_layers=1, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2),
        {**{f"layers.0.self_attn.{n}": b for n, b in ATTN.items()}, "layers.0.mlp.experts": FP8E}),
    "llama3_8b": (lambda: transformers.LlamaConfig(
        vocab_size=1024, hidden_size=4096, intermediate_size=14336, num_hidden_layers=1, num_attention_heads=32,
        num_key_value_heads=8),
        {**{f"layers.0.self_attn.{n}": b for n, b in ATTN.items()},
         **{f"layers.0.mlp.{n}": F for n in ("gate_proj", "up_proj", "down_proj")}}),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_default_rules_at_real_sizes(name):
    make_config, expected = CONFIGS[name]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(make_config())
    report = hf.convert(model).fp8_conversion_report
    became = {e.fqn.removeprefix("model."): e.became for e in report.entries}
    assert {fqn: became[fqn] for fqn in expected} == expected
    # every linear and expert block the table does not name is a router, an embedding or lm_head
    others = {e.reason for e in report.entries if e.fqn.removeprefix("model.") not in expected}
    assert others <= {cr.ROUTER, cr.EMBEDDING, cr.LM_HEAD}
    kept_experts = [e for e in report.entries if e.reason == cr.BELOW_MIN_EXPERT_SIZE]
    assert all(e.detail.endswith("min(H, I) < 512 (min_bf16_expert_size)") for e in kept_experts)
    for e in report.entries:
        if e.became == BF16:
            assert e.detail.endswith(f"bf16 (below min_expert_size: min(H, I) < {hf.MIN_EXPERT_SIZE})") and not e.fp8
    for e in report.entries:  # the experts that get FP8 keep the FP8 weight gradient (min(H, I) >= 1024)
        if e.became == FP8E:
            assert e.detail.endswith(", rowwise") and e.fp8


@pytest.mark.parametrize("name, recipe", [("qwen3_30b_a3b", "rowwise_gw_hp"), ("qwen3_moe_h1024", "rowwise_gw_hp"),
                                          ("deepseek_v3", "rowwise"), ("mixtral_8x7b", "rowwise")])
def test_forced_fp8_experts_weight_gradient_at_real_sizes(name, recipe):
    """``min_expert_size=0`` gives every block FP8 experts; below ``MIN_FP8_WGRAD_SIZE`` (Qwen3-MoE's
    768 and 384) their weight gradient runs in BF16, at 2048 and above (DeepSeek-V3, Mixtral) in FP8."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name][0]())
    report = hf.convert(model, min_expert_size=0).fp8_conversion_report
    (experts,) = [e for e in report.entries if e.became == FP8E]
    assert experts.fp8 and experts.detail.split(", ")[1].split(" ")[0] == recipe
