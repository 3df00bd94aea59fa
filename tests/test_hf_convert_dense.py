"""``moe_fp8.hf.convert`` on Hugging Face models without MoE blocks (tiny random Llama and Mistral,
built from configs): the dense linears convert by the dense rules, the report says there was no MoE
block, and a model where nothing converts raises, naming the rule that kept each module."""

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from moe_fp8 import FP8Linear, hf, kernel_backend  # noqa: E402
from moe_fp8.layers import conversion_report as cr  # noqa: E402
from moe_fp8.testing import sqnr  # noqa: E402

V = 96
FLOOR = 24.0  # logits, every attention and MLP linear in FP8 (27-28 dB measured; test_whole_model_conversion's)
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=V)
MODELS = {
    "llama": lambda tied: transformers.LlamaForCausalLM(transformers.LlamaConfig(**_COMMON,
                                                                                  tie_word_embeddings=tied)),
    "mistral": lambda tied: transformers.MistralForCausalLM(transformers.MistralConfig(**_COMMON,
                                                                                        tie_word_embeddings=tied)),
}
# per decoder layer: (name, in_features, out_features)
LINEARS = [("self_attn.q_proj", 64, 64), ("self_attn.k_proj", 64, 32), ("self_attn.v_proj", 64, 32),
           ("self_attn.o_proj", 64, 64), ("mlp.gate_proj", 64, 128), ("mlp.up_proj", 64, 128),
           ("mlp.down_proj", 128, 64)]


def _model(family: str, tied: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[family](tied).to(torch.bfloat16)


def _ids(batch=2, seq=8):
    return torch.randint(0, V, (batch, seq), generator=torch.Generator().manual_seed(1))


def _linear_fqns() -> list[str]:
    return [f"model.layers.{i}.{name}" for i in range(2) for name, _, _ in LINEARS]


def _check_close_and_backward(model: nn.Module, converted: nn.Module) -> None:
    ids = _ids()
    ref = model(ids).logits
    out = converted(ids).logits
    assert out.dtype == ref.dtype and sqnr(ref.float(), out.float()) >= FLOOR
    out.float().pow(2).mean().backward()
    for fqn in _linear_fqns():
        g = converted.get_submodule(fqn).weight.grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, fqn


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_dense_model_converts(family, tied, monkeypatch):
    """Every attention and MLP linear becomes an FP8Linear sharing its parameters; the embedding and
    lm_head stay (tied or not); the report says there was no MoE block. Reference quantizers (the
    same bytes as the Triton kernels, which the interpreter test below runs)."""
    monkeypatch.setattr(kernel_backend, "interpreter_enabled", lambda: False)
    model = _model(family, tied)
    copied = copy.deepcopy(model)
    weights = {fqn: copied.get_submodule(fqn).weight for fqn in _linear_fqns()}
    converted = hf.convert(copied, min_dense_size=0)
    assert converted is copied
    for fqn, w in weights.items():
        m = converted.get_submodule(fqn)
        assert type(m) is FP8Linear and m.weight is w and m.recipe.name == "rowwise", fqn
    assert type(converted.lm_head) is nn.Linear and type(converted.model.embed_tokens) is nn.Embedding
    assert (converted.lm_head.weight is converted.model.embed_tokens.weight) == tied
    report = converted.fp8_conversion_report
    assert report.moe_blocks == 0
    got = {e.fqn: (e.cls, e.became, e.reason) for e in report.entries}
    want = {"model.embed_tokens": ("Embedding", cr.KEPT, cr.EMBEDDING), "lm_head": ("Linear", cr.KEPT, cr.LM_HEAD),
            **{fqn: ("Linear", cr.FP8_LINEAR, None) for fqn in _linear_fqns()}}
    assert got == want
    assert report["model.layers.1.self_attn.k_proj"].detail == "64->32, rowwise; input quantized with q_proj, v_proj"
    assert report.fp8_params == 2 * sum(i * o for _, i, o in LINEARS)
    assert report.matmul_params == report.fp8_params + 64 * V
    text = str(report)
    assert "no MoE block found (a dense model)" in text and "FP8Linear 14" in text
    _check_close_and_backward(model, converted)


@pytest.mark.interpreter
def test_dense_model_triton_kernels():
    """The same conversion with the Triton quantization kernels, in the CPU interpreter."""
    model = _model("mistral")
    converted = hf.convert(copy.deepcopy(model), min_dense_size=0)
    _check_close_and_backward(model, converted)


def test_dense_size_rule_and_options():
    """``min_dense_size``, ``filter_fn`` and ``dense_recipe`` apply as they do to an MoE model's linears."""
    model = hf.convert(_model("llama"), min_dense_size=64)  # min(in, out): 64 converts, 32 does not
    report = model.fp8_conversion_report
    for i in range(2):
        for name, fan_in, fan_out in LINEARS:
            e = report[f"model.layers.{i}.{name}"]
            if min(fan_in, fan_out) >= 64:
                assert (e.became, e.reason) == (cr.FP8_LINEAR, None)
                assert isinstance(model.get_submodule(e.fqn), FP8Linear)
            else:
                assert (e.became, e.reason, e.detail) == (cr.KEPT, cr.BELOW_MIN_SIZE, "64->32: min(in, out) < 64")
                assert type(model.get_submodule(e.fqn)) is nn.Linear
    assert report.counts()[cr.FP8_LINEAR] == 10 and report.counts()[f"kept: {cr.BELOW_MIN_SIZE}"] == 4
    model = hf.convert(_model("mistral"), dense_recipe="tensorwise", min_dense_size=0,
                       filter_fn=lambda m, fqn: ".mlp." in fqn)
    report = model.fp8_conversion_report
    assert report.counts()[cr.FP8_LINEAR] == 6 and report.counts()[f"kept: {cr.FILTER_FN}"] == 8
    assert all(m.recipe.name == "tensorwise" for m in model.modules() if isinstance(m, FP8Linear))


@pytest.mark.parametrize(("kwargs", "reason", "detail"), [
    ({}, cr.BELOW_MIN_SIZE, "min(in, out) < 1536"),  # the default rule: every linear of a tiny model is below
    ({"dense": False, "min_dense_size": 0}, cr.DENSE_OFF, ""),
    ({"recipe": "bf16", "min_dense_size": 0}, cr.BF16_RECIPE, ""),
    ({"filter_fn": lambda m, fqn: False, "min_dense_size": 0}, cr.FILTER_FN, ""),
])
def test_nothing_to_convert_raises(kwargs, reason, detail):
    """No MoE block and no linear converted: ValueError listing the supported blocks and, per module,
    the rule that kept it; the model is left as it was."""
    model = _model("llama")
    with pytest.raises(ValueError) as info:
        hf.convert(model, **kwargs)
    msg = str(info.value)
    assert msg.startswith("model: nothing to convert: no MoE block found (supported: ")
    assert all(block in msg for block in hf.SUPPORTED_BLOCKS)
    lines = {line.split()[0]: line for line in msg.splitlines()[2:]}
    assert set(lines) == {"model.embed_tokens", "lm_head", *_linear_fqns()}
    assert " embedding " in lines["model.embed_tokens"] and " lm_head " in lines["lm_head"]
    for fqn in _linear_fqns():
        assert f" {reason} " in lines[fqn] + " " and detail in lines[fqn], lines[fqn]
    assert not any(isinstance(m, FP8Linear) for m in model.modules())
    assert not hasattr(model, "fp8_conversion_report")


def test_state_dict_round_trip():
    """The converted model's state_dict has the original keys, holds the same tensors, and loads
    into an unconverted model (and back) strictly."""
    model = _model("llama")
    keys = list(model.state_dict())
    converted = hf.convert(copy.deepcopy(model), min_dense_size=0)
    state = converted.state_dict()
    assert list(state) == keys
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    fresh = _model("llama")
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(state, strict=True)
    ids = _ids()
    assert torch.equal(fresh(ids).logits, model(ids).logits)
    converted.load_state_dict(fresh.state_dict(), strict=True)
    assert isinstance(converted.model.layers[0].self_attn.q_proj, FP8Linear)


def test_siblings_share_their_input(monkeypatch):
    """Each decoder layer's q/k/v and gate/up projections run as one ``SharedInput``, and the model
    calls them so that each group runs once per forward (no member alone); the report says which
    share. ``share_inputs=False`` leaves every linear on its own."""
    from moe_fp8.layers import shared_input

    model = _model("llama")
    converted = hf.convert(copy.deepcopy(model), min_dense_size=0)
    report = converted.fp8_conversion_report
    attn, mlp = converted.model.layers[0].self_attn, converted.model.layers[0].mlp
    assert attn.q_proj.shared_input.members == (attn.q_proj, attn.k_proj, attn.v_proj)
    assert mlp.gate_proj.shared_input.members == (mlp.gate_proj, mlp.up_proj)
    assert attn.o_proj.shared_input is None and mlp.down_proj.shared_input is None
    assert report["model.layers.1.self_attn.k_proj"].detail.endswith("; input quantized with q_proj, v_proj")
    assert report["model.layers.1.mlp.up_proj"].detail.endswith("; input quantized with gate_proj")
    runs, real = [], shared_input.fp8_linears_shared_input
    monkeypatch.setattr(shared_input, "fp8_linears_shared_input", lambda x, w, *a, **k: runs.append(len(w)) or real(x, w, *a, **k))
    _check_close_and_backward(model, converted)
    assert runs == [3, 2, 3, 2]
    alone = hf.convert(copy.deepcopy(model), min_dense_size=0, share_inputs=False)
    assert not any(getattr(m, "shared_input", None) for m in alone.modules())


def test_siblings_below_the_size_rule_stay_apart():
    """``min_dense_size=64`` keeps k_proj / v_proj (64 -> 32) in BF16: q_proj, the one FP8 linear of
    its input, runs alone; gate_proj and up_proj (64 -> 128) still share theirs."""
    model = hf.convert(_model("llama"), min_dense_size=64)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert type(attn.k_proj) is nn.Linear and attn.q_proj.shared_input is None
    assert mlp.gate_proj.shared_input.members == (mlp.gate_proj, mlp.up_proj)
