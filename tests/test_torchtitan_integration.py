"""``moe_fp8.integrations.torchtitan`` against torchtitan 0.3's own BF16 experts, layers and models (CPU).

Skipped where torchtitan does not import (not installed, or torch < 2.13), except the test of the
import without torchtitan. Expert GEMMs run on the ``emulated`` backend (the CPU default) and the
quantizers on their pure-torch reference (the same bytes as the Triton kernels, which other tests
run in the interpreter): the subject here is the seam, not the kernels.

Accuracy bounds, derived from e4m3 (3 mantissa bits): rounding a value whose mantissa is uniform in
[1, 2) leaves a relative error of variance ``2**-6 / 12 * E[1/m**2] = 2**-6 / 24``, i.e. -31.9 dB per
quantized operand. One FP8 GEMM quantizes two operands: ~28.9 dB, so ``>= 25 dB`` for one GEMM
(forward, dgrad or wgrad). A SwiGLU expert stacks them: ``h = silu(x W1) * (x W3)`` carries the
noise of two GEMMs (~26 dB), then ``h`` and ``W2`` are quantized again: ~24 dB at the layer output
and in its gradients (measured 23.5-26.2 dB for every FP8 recipe). The bound is 21 dB: twice that
noise power. The ``bf16`` recipe runs ``torch._grouped_mm`` like torchtitan: equal bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from moe_fp8 import kernel_backend
from moe_fp8.integrations import torchtitan as tti
from moe_fp8.testing import sqnr

try:
    from torchtitan.config.manager import ConfigManager, custom_registry
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_moe_config, make_routed_experts_config, make_router_config
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.deepseek_v3 import model_registry
    import tyro
except ImportError as exc:  # not installed, or a torch torchtitan does not support
    TORCHTITAN_MISSING = str(exc)
else:
    TORCHTITAN_MISSING = None

needs_torchtitan = pytest.mark.skipif(TORCHTITAN_MISSING is not None, reason=f"torchtitan: {TORCHTITAN_MISSING}")

FP8_RECIPES = ("rowwise", "rowwise_gw_hp", "tensorwise", "blockwise")
GEMM_DB, LAYER_DB = 25.0, 21.0
D, F, E, TOP_K = 64, 96, 8, 2  # the MoE layer: dim, expert hidden, experts, top-k
MODULE = "moe_fp8.integrations.torchtitan"


@pytest.fixture(autouse=True)
def _reference_quantizers(monkeypatch):
    monkeypatch.setattr(kernel_backend, "interpreter_enabled", lambda: False)


def _normal(std: float):
    return lambda t: torch.nn.init.normal_(t, std=std)


def _build(cfg, seed: int = 0):
    torch.manual_seed(seed)
    module = cfg.build()
    module.init_states(buffer_device=torch.device("cpu"))
    return module


def _replace(root, config_cls, make) -> None:
    """Replace every ``config_cls`` node under ``root`` by ``make(node)``."""
    for _, cfg, parent, attr in list(root.traverse(config_cls)):
        if isinstance(parent, list):
            parent[attr] = make(cfg)
        else:
            setattr(parent, attr, make(cfg))


def test_import_without_torchtitan():
    """The module imports without torchtitan; using it raises ImportError naming the extra."""
    code = (
        "import sys; sys.modules['torchtitan'] = None\n"
        f"import {MODULE} as m\n"
        "errors = []\n"
        "for use in (lambda: m.fp8_experts(None), lambda: m.fp8_linears(None), lambda: m.MoEFP8Converter):\n"
        "    try:\n"
        "        use()\n"
        "    except ImportError as e:\n"
        "        errors.append(str(e))\n"
        "print(__import__('json').dumps(errors))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    errors = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(errors) == 3 and all("moe_fp8[torchtitan]" in e for e in errors), errors


@needs_torchtitan
def test_bad_settings_raise():
    experts = GroupedExperts.Config(dim=32, hidden_dim=32, num_experts=2)
    with pytest.raises(ValueError, match="recipe"):
        tti.fp8_experts(experts, recipe="fp4")
    with pytest.raises(ValueError, match="backend"):
        tti.fp8_experts(experts, backend="cuda_graphs")
    with pytest.raises(TypeError, match="GroupedExperts.Config"):
        tti.fp8_experts(Linear.Config(in_features=32, out_features=32))
    with pytest.raises(ValueError, match="recipe"):
        tti.fp8_linears(Linear.Config(in_features=32, out_features=32), recipe="blockwise")
    with pytest.raises(ValueError, match="linear_recipe"):
        tti.MoEFP8Converter.Config(linear_recipe="blockwise").build()


@needs_torchtitan
def test_converting_twice_changes_the_settings_only():
    once = tti.fp8_experts(GroupedExperts.Config(dim=32, hidden_dim=32, num_experts=2), recipe="rowwise")
    twice = tti.fp8_experts(once, recipe="bf16", backend="emulated")
    assert type(twice) is type(once) and (twice.recipe, twice.backend, twice.dim) == ("bf16", "emulated", 32)


@needs_torchtitan
@pytest.mark.parametrize("recipe", ("bf16", *FP8_RECIPES))
def test_seam_ragged_groups_empty_expert_and_tail(recipe, monkeypatch):
    """``_grouped_mm`` itself: ragged groups, an empty expert, rows past ``offs[-1]`` (a padding
    dispatcher's). The weights reach ``fp8_grouped_mm`` as the parameter itself, ``(E, N, K)``."""
    experts = tti.fp8_experts(GroupedExperts.Config(dim=32, hidden_dim=48, num_experts=4), recipe=recipe).build()
    experts.to(torch.bfloat16)
    torch.manual_seed(0)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    seen, fp8_grouped_mm = [], tti.fp8_grouped_mm

    def spy(x, w, offs, **kwargs):
        seen.append(w)
        return fp8_grouped_mm(x, w, offs, **kwargs)

    monkeypatch.setattr(tti, "fp8_grouped_mm", spy)
    a = torch.randn(40, 32, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor([13, 13, 29, 35], dtype=torch.int32)  # expert 1 empty, rows 35..39 past the end
    w = experts.w1_EFD
    out = experts._grouped_mm(A=a, B_t=w.transpose(-2, -1), offs=offs)
    ref_a = a.detach().clone().requires_grad_()
    ref_w = w.detach().clone().requires_grad_()
    ref = torch._grouped_mm(ref_a, ref_w.transpose(-2, -1), offs=offs)

    assert seen[0].data_ptr() == w.data_ptr() and seen[0].shape == (4, 48, 32) and seen[0].is_contiguous()
    assert out.dtype == torch.bfloat16 and out.shape == (40, 48)
    # zeros past offs[-1], forward and dgrad, where torch._grouped_mm leaves the rows unwritten
    grad = torch.randn(40, 48, dtype=torch.bfloat16)
    out.backward(grad)
    ref.backward(grad)
    assert torch.count_nonzero(out[35:]) == 0 and torch.count_nonzero(a.grad[35:]) == 0
    pairs = [(ref[:35], out[:35]), (ref_a.grad[:35], a.grad[:35]), (ref_w.grad, w.grad)]
    if recipe == "bf16":
        assert all(torch.equal(r, g) for r, g in pairs)
    else:
        assert min(sqnr(r, g) for r, g in pairs) >= GEMM_DB
    assert torch.count_nonzero(w.grad[1]) == 0  # the empty expert


def _moe_config():
    experts_init = {name: _normal(0.05) for name in ("w1_EFD", "w2_EDF", "w3_EFD")}
    return make_moe_config(
        num_experts=E,
        router=make_router_config(dim=D, num_experts=E, gate_param_init={"weight": _normal(0.02)}, top_k=TOP_K,
                                  score_func="softmax", route_norm=True),
        routed_experts=make_routed_experts_config(dim=D, hidden_dim=F, num_experts=E, top_k=TOP_K,
                                                  param_init=experts_init, comm_backend="standard"),
    )


def _run_moe(moe, x: torch.Tensor, grad: torch.Tensor):
    """Skewed routing through the layer's own load-balancing bias (used for the choice only): expert
    0 is in every token's top-k, expert E-1 in none (softmax scores lie in (0, 1))."""
    moe.expert_bias_E.zero_()
    moe.expert_bias_E[0], moe.expert_bias_E[E - 1] = 1.0, -1.0
    x = x.clone().requires_grad_()
    out = moe(x)
    out.backward(grad)
    return out.detach(), x.grad, {n: p.grad for n, p in moe.named_parameters()}


@needs_torchtitan
@pytest.mark.parametrize("recipe", ("bf16", *FP8_RECIPES))
def test_moe_layer_against_torchtitan_bf16(recipe):
    """torchtitan's own ``MoE`` with converted experts against the same layer unconverted, same weights."""
    ref_moe = _build(_moe_config())
    cfg = _moe_config()
    _replace(cfg, GroupedExperts.Config, lambda c: tti.fp8_experts(c, recipe=recipe))
    moe = _build(cfg, seed=1)
    moe.load_state_dict(ref_moe.state_dict())
    assert type(moe.routed_experts.inner_experts).__name__ == "MoEFP8GroupedExperts"
    gen = torch.Generator().manual_seed(2)
    x, grad = torch.randn(2, 24, D, generator=gen), torch.randn(2, 24, D, generator=gen)
    ref = _run_moe(ref_moe, x, grad)
    got = _run_moe(moe, x, grad)

    counts = ref_moe.tokens_per_expert_E
    assert counts[0] == 48 and counts[E - 1] == 0 and len(set(counts.tolist())) > 2  # skewed, one expert empty
    assert torch.equal(counts, moe.tokens_per_expert_E)
    pairs = [(ref[0], got[0]), (ref[1], got[1])] + [(ref[2][n], got[2][n]) for n in ref[2]]
    if recipe == "bf16":
        assert all(torch.equal(r, g) for r, g in pairs)
    else:
        dbs = [sqnr(r, g) for r, g in pairs]
        assert min(dbs) >= LAYER_DB, dbs
    assert torch.count_nonzero(got[2]["routed_experts.inner_experts.w1_EFD"][E - 1]) == 0


@needs_torchtitan
@pytest.mark.parametrize("recipe", ("bf16", "rowwise", "rowwise_gw_hp", "tensorwise"))
def test_dense_linear_against_torchtitan_linear(recipe):
    """``fp8_linears``: a torchtitan ``Linear`` becomes an ``FP8Linear`` with the same parameters."""
    init = {"weight": _normal(0.05), "bias": _normal(0.05)}
    cfg = Linear.Config(in_features=64, out_features=48, bias=True, param_init=init)
    ref_lin = _build(cfg)
    lin = _build(tti.fp8_linears(cfg, recipe=recipe))
    lin.load_state_dict(ref_lin.state_dict())
    assert type(lin).__name__ == "TorchtitanFP8Linear" and lin.recipe.name == recipe
    x = torch.randn(3, 10, 64, dtype=torch.bfloat16)
    results = []
    for module in (ref_lin.to(torch.bfloat16), lin.to(torch.bfloat16)):
        xx = x.clone().requires_grad_()
        out = module(xx)
        out.backward(torch.ones_like(out))
        results.append((out, xx.grad, module.weight.grad, module.bias.grad))
    for r, g in zip(*results):
        assert torch.equal(r, g) if recipe == "bf16" else sqnr(r, g) >= GEMM_DB
    odd = Linear.Config(in_features=64, out_features=8)
    assert tti.fp8_linears(odd) is odd  # not a multiple of 16: left as it is


def _dsv3_config(converters=None):
    """torchtitan's DeepSeek-V3 debug model (dim 256, 8 experts of 256, top-3, 2 shared experts),
    cut to its dense first layer and one MoE layer. Its attention backend, FlexAttention, needs a
    BlockMask and has no backward on CPU (NotImplementedError), so torchtitan's own
    ScaledDotProductAttention (causal, no mask) replaces it, in both models alike."""
    cfg = model_registry("debugmodel", converters=converters).model
    del cfg.layers[2:]
    _replace(cfg, FlexAttention.Config, lambda _: ScaledDotProductAttention.Config())
    return cfg


def _forward_backward(model, tokens: torch.Tensor):
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def dsv3_reference():
    model = _build(_dsv3_config())
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernel_backend, "interpreter_enabled", lambda: False)
        return model.state_dict(), tokens, _forward_backward(model, tokens)


@needs_torchtitan
@pytest.mark.parametrize("recipe", ("bf16", "rowwise"))
def test_deepseek_v3_model_with_converter(recipe, dsv3_reference):
    """The converter in torchtitan's own ``model_registry``: the experts (and the shared experts'
    linears) through moe_fp8; logits, loss and every gradient against the unconverted model."""
    state, tokens, (ref_logits, ref_loss, ref_grads) = dsv3_reference
    converter = tti.MoEFP8Converter.Config(recipe=recipe, linear_recipe=recipe,
                                           linear_fqns=["*layers.*.moe.shared_experts.*"])
    model = _build(_dsv3_config([converter]), seed=1)
    model.load_state_dict(state)
    kinds = {n: type(m).__name__ for n, m in model.named_modules()}
    assert kinds["layers.1.moe.routed_experts.inner_experts"] == "MoEFP8GroupedExperts"
    assert kinds["layers.1.moe.shared_experts.w2"] == "TorchtitanFP8Linear"
    assert kinds["layers.1.attention.wq"] == kinds["layers.1.moe.router.gate"] == "Linear"
    logits, loss, grads = _forward_backward(model, tokens)
    if recipe == "bf16":
        assert torch.equal(logits, ref_logits) and torch.equal(loss, ref_loss)
        assert all(torch.equal(ref_grads[n], grads[n]) for n in ref_grads)
        return
    assert sqnr(ref_logits, logits) >= LAYER_DB
    # cross-entropy's gradient in the logits is p - onehot (L1 norm <= 2): |dloss| <= 2 max |dlogits|
    assert abs(loss - ref_loss) <= 2 * (logits - ref_logits).abs().max()
    dbs = {n: sqnr(ref_grads[n], grads[n]) for n in ref_grads}
    assert min(dbs.values()) >= LAYER_DB, dbs


@needs_torchtitan
def test_override_imports_from_the_command_line():
    """``--override.imports`` parsed by the trainer's own CLI rule, then applied as the trainer does
    (``apply_overrides`` on the config tree holding the model spec)."""
    args = ["--imports", f'{MODULE}.fp8_experts={{"recipe": "tensorwise", "backend": "emulated"}}',
            f"{MODULE}.fp8_linears"]
    ConfigManager()  # registers torchtitan's CLI rules, as the trainer's entry point does
    overrides = tyro.cli(OverrideConfig, args=args, default=OverrideConfig(), registry=custom_registry)
    assert overrides.imports == [(f"{MODULE}.fp8_experts", {"recipe": "tensorwise", "backend": "emulated"}),
                                 f"{MODULE}.fp8_linears"]
    spec = model_registry("debugmodel")
    log = apply_overrides(overrides, spec)
    experts = [c for _, c, _, _ in spec.model.traverse(GroupedExperts.Config)]
    assert len(experts) == 5  # the debug model: a dense first layer, then five MoE layers
    assert all(type(c).__qualname__ == "MoEFP8GroupedExperts.Config" for c in experts)
    assert all((c.recipe, c.backend) == ("tensorwise", "emulated") for c in experts)
    linears = {fqn: type(c).__qualname__ for fqn, c, _, _ in spec.model.traverse(Linear.Config)}
    assert linears["layers.0.feed_forward.w1"] == linears["layers.1.attention.wkv_b"] == "TorchtitanFP8Linear.Config"
    assert linears["layers.1.moe.shared_experts.w3"] == "TorchtitanFP8Linear.Config"
    assert linears["layers.1.moe.router.gate"] == linears["lm_head"] == "Linear.Config"
    assert sum("fp8_experts: model.layers" in line for line in log) == len(experts)
