"""Whole-model conversion (``moe_fp8.hf.convert``, ``convert_to_fp8``) of tiny random models: the four
Hugging Face MoE families in the transformers 5.x layout (3D experts) and the 4.x layout (the
ModuleList blocks of test_hf_convert inside the same models), plain modules, and the report."""

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from test_hf_convert import V4_BLOCKS, _first, _random  # noqa: E402

from moe_fp8 import MIN_DENSE_SIZE, FP8GroupedExperts, FP8Linear, FP8MoE, convert_to_fp8, hf  # noqa: E402
from moe_fp8 import kernel_backend  # noqa: E402
from moe_fp8.layers.hf_blocks import FP8HFMoEBlock  # noqa: E402
from moe_fp8.layers import conversion_report as cr  # noqa: E402
from moe_fp8.layers.hf_convert import bf16_wgrad  # noqa: E402
from moe_fp8.quant.recipes import get_recipe  # noqa: E402
from moe_fp8.testing import sqnr  # noqa: E402
from moe_fp8.testing.allocator import dirty_allocator  # noqa: E402

H, I, V = 64, 32, 96  # H, I: the sizes of test_hf_convert's 4.x blocks
FLOOR = 21.0  # logits of the whole model, every expert and dense linear in FP8 (22.6-30.3 dB measured)
_COMMON = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
               tie_word_embeddings=False)

MODELS = {
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        intermediate_size=I, num_local_experts=4, num_experts_per_tok=2, **{**_COMMON, "num_hidden_layers": 1})),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        intermediate_size=64, moe_intermediate_size=I, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        head_dim=16, **{**_COMMON, "num_hidden_layers": 1})),
    "deepseek_v3": lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(  # MLA, a dense layer
        intermediate_size=64, moe_intermediate_size=I, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, rope_scaling=None,
        **{**_COMMON, "num_key_value_heads": 4})),
    "llama4": lambda: transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(  # layer 0 dense, layer 1 MoE
        intermediate_size=I, intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, head_dim=16, **_COMMON)),
}


class _Unpacked(nn.Module):
    """What a 4.x decoder layer did with its MoE block's output: take the hidden states, in the input's shape."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return _first(self.block(x)).view(x.shape)


def _model(family: str, layout: str) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[family]().to(torch.bfloat16)
    if layout == "v4":  # every MoE block -> its 4.x form (ModuleList experts, 4.x routers)
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child).__name__ in hf.SUPPORTED_BLOCKS:
                    block = _random(V4_BLOCKS[family]())
                    with torch.no_grad():  # the 5.x models' init scale (initializer_range 0.02)
                        for p in block.parameters():
                            p.mul_(0.2)
                    setattr(parent, name, block if family == "llama4" else _Unpacked(block))  # 5.x Llama 4 unpacks
    return model


def _ids(batch=2, seq=8):
    return torch.randint(0, V, (batch, seq), generator=torch.Generator().manual_seed(1))


def _fp8_modules(model) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (FP8Linear, FP8GroupedExperts))}


@pytest.mark.parametrize("layout", ["v5", "v4"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_families_whole_model(family, layout, monkeypatch):
    """The CPU references: emulated expert GEMMs, reference quantizers (the same bytes as the Triton
    kernels, which the skewed-routing test below runs in the interpreter)."""
    monkeypatch.setattr(kernel_backend, "interpreter_enabled", lambda: False)  # quantizers: the reference
    model = _model(family, layout)
    ids = _ids()
    ref = model(ids).logits
    converted = hf.convert(copy.deepcopy(model), min_dense_size=0, min_expert_size=0, backend="emulated")
    report = converted.fp8_conversion_report
    n_moe = sum(type(m).__name__ in hf.SUPPORTED_BLOCKS for m in model.modules())
    by = {b: [e for e in report.entries if e.became == b] for b in cr.BECAME}
    # what each module became, checked against the converted model itself
    fp8 = _fp8_modules(converted)
    assert {e.fqn for e in by[cr.FP8_LINEAR] + by[cr.FP8_EXPERTS]} == set(fp8)
    assert len(by[cr.FP8_EXPERTS]) == n_moe and not by[cr.BF16_EXPERTS]
    assert sum(isinstance(m, FP8Linear) for m in fp8.values()) == len(by[cr.FP8_LINEAR]) >= 4
    kept = {e.fqn: e.reason for e in by[cr.KEPT]}
    routers = [f for f, r in kept.items() if r == cr.ROUTER]
    assert len(routers) == n_moe and all(f.rsplit(".", 1)[1] in ("gate", "router") for f in routers)
    assert kept["model.embed_tokens"] == cr.EMBEDDING and kept["lm_head"] == cr.LM_HEAD
    assert len(kept) == n_moe + 2
    leftover = {n for n, m in converted.named_modules() if type(m) is nn.Linear}
    assert leftover <= set(kept)  # every plain linear left is a reported router or lm_head
    if layout == "v5":  # attention, MLA, dense MLPs, shared experts: all in FP8
        assert any(".self_attn." in f for f in fp8)
    if family in ("deepseek_v3", "llama4"):
        assert any(".shared_expert" in f for f in fp8) and any(f.endswith(".mlp.down_proj") or
                                                               f.endswith("feed_forward.down_proj") for f in fp8)
    # the parameter accounting, recomputed from the model
    fp8_params = {id(p): p.numel() for m in fp8.values() for p in m.parameters()}
    kept_params = {id(p): p.numel() for n, m in converted.named_modules() if kept.get(n) in (cr.ROUTER, cr.LM_HEAD)
                   for p in m.parameters()}
    assert report.fp8_params == sum(fp8_params.values())
    assert report.matmul_params == sum({**fp8_params, **kept_params}.values())
    assert 0.5 < report.fp8_fraction < 1
    # same function, and gradients reach every converted weight
    out = converted(ids).logits
    assert sqnr(ref.float(), out.float()) >= FLOOR
    out.float().pow(2).mean().backward()
    for name, m in fp8.items():
        for pname, p in m.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), f"{name}.{pname}"
            assert p.grad.abs().sum() > 0, f"{name}.{pname}"


def test_default_size_rules_keep_small_layers():
    """With the default rules a tiny model is left exactly as it was (same modules, same logits),
    and the report says why for every expert block and linear."""
    original = _model("deepseek_v3", "v5")
    ids = _ids()
    model = hf.convert(copy.deepcopy(original))
    report = model.fp8_conversion_report
    assert report.min_dense_size == MIN_DENSE_SIZE == 1536 and report.min_expert_size == hf.MIN_EXPERT_SIZE == 1024
    assert report.min_bf16_expert_size == hf.MIN_BF16_EXPERT_SIZE == 512
    assert report.min_fp8_wgrad_size == hf.MIN_FP8_WGRAD_SIZE == 1024
    assert "min_dense_size 1536, min_expert_size 1024, min_bf16_expert_size 512, min_fp8_wgrad_size 1024" in str(report)
    assert not any(isinstance(m, (FP8Linear, FP8GroupedExperts)) for m in model.modules())
    assert [type(m) for m in model.modules()] == [type(m) for m in original.modules()]
    assert torch.equal(model(ids).logits, original(ids).logits)
    dense = [e for e in report.entries if e.cls == "Linear" and e.reason != cr.LM_HEAD]
    assert len(dense) == 16 and all(e.reason == cr.BELOW_MIN_SIZE for e in dense)
    assert "min(in, out) < 1536" in dense[0].detail
    (experts,) = [e for e in report.entries if e.reason == cr.BELOW_MIN_EXPERT_SIZE]
    assert experts.fqn == "model.layers.1.mlp.experts" and experts.became == cr.KEPT and not experts.fp8
    assert experts.detail == f"E=8 H={H} I={I}: min(H, I) < 512 (min_bf16_expert_size)"
    assert report.fp8_params == 0 and report.matmul_params > experts.numel > 0
    # the rule's boundary, on a plain module: min(in, out) >= min_dense_size converts
    plain = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 496), nn.Linear(496, 512))
    convert_to_fp8(plain, min_dense_size=512)
    assert isinstance(plain[0], FP8Linear) and type(plain[1]) is nn.Linear and type(plain[2]) is nn.Linear
    assert [e.reason for e in plain.fp8_conversion_report.entries] == [None, cr.BELOW_MIN_SIZE, cr.BELOW_MIN_SIZE]


@pytest.mark.parametrize("layout", ["v5", "v4"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_expert_size_rule_boundary(family, layout):
    """``min(H, I) >= min_expert_size`` converts a block's experts; one more keeps the block as it
    was (4.x ModuleList experts included: their linears are not handed to the dense rules)."""
    small = min(H, I)
    converted = hf.convert(_model(family, layout), dense=False, min_expert_size=small)
    assert converted.fp8_conversion_report.counts()[cr.FP8_EXPERTS] >= 1
    model = _model(family, layout)
    blocks = [(n, m, m.experts) for n, m in model.named_modules() if type(m).__name__ in hf.SUPPORTED_BLOCKS]
    hf.convert(model, min_dense_size=0, min_expert_size=small + 1, min_bf16_expert_size=small + 1)
    report = model.fp8_conversion_report
    assert not any(isinstance(m, FP8GroupedExperts) for m in model.modules())
    kept = [e for e in report.entries if e.reason == cr.BELOW_MIN_EXPERT_SIZE]
    assert [e.fqn for e in kept] == [f"{n}.experts" for n, _, _ in blocks]
    assert all(f"H={H} I={I}: min(H, I) < {small + 1}" in e.detail for e in kept)
    for name, block, experts in blocks:
        assert model.get_submodule(name) is block and block.experts is experts
        assert not any(isinstance(m, FP8Linear) for m in experts.modules())
    assert any(isinstance(m, FP8Linear) for m in model.modules())  # the dense rules still apply
    bf16 = hf.convert(_model(family, layout), recipe="bf16", min_expert_size=small + 1)  # the rule is FP8's
    assert bf16.fp8_conversion_report.counts()[cr.BF16_EXPERTS] == len(blocks)
    assert not any("below" in e.detail for e in bf16.fp8_conversion_report.entries)


@pytest.mark.parametrize("layout", ["v5", "v4"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_small_experts_run_the_bf16_grouped_path(family, layout):
    """Experts below ``min_expert_size`` but not below ``min_bf16_expert_size`` run on the library's
    BF16 grouped path (no FP8, no weight cache), the report says why, the dense rules still apply,
    and with its dense linears put back the model computes exactly what ``recipe="bf16"`` (the same
    experts, asked for) does. One below ``min_bf16_expert_size`` as well: the block stays as built."""
    small = min(H, I)
    original = _model(family, layout)
    kept = hf.convert(copy.deepcopy(original), dense=False, min_expert_size=small + 2, min_bf16_expert_size=small + 1)
    (entry,) = {e.detail for e in kept.fp8_conversion_report.entries if e.reason == cr.BELOW_MIN_EXPERT_SIZE}
    assert entry.endswith(f"H={H} I={I}: min(H, I) < {small + 1} (min_bf16_expert_size)")
    assert not any(isinstance(m, FP8GroupedExperts) for m in kept.modules())
    model = hf.convert(copy.deepcopy(original), min_dense_size=0, min_expert_size=small + 1,
                       min_bf16_expert_size=small)
    report = model.fp8_conversion_report
    experts = [m for m in model.modules() if isinstance(m, FP8GroupedExperts)]
    entries = [e for e in report.entries if e.became == cr.BF16_EXPERTS]
    assert experts and len(entries) == len(experts) and report.counts().get(cr.FP8_EXPERTS, 0) == 0
    assert all(m.recipe.name == "bf16" and not m.cache_weights for m in experts)
    assert all(e.detail.endswith(f"H={H} I={I}, bf16 (below min_expert_size: min(H, I) < {small + 1})") and not e.fp8
               for e in entries)
    assert any(isinstance(m, FP8Linear) for m in model.modules())
    bf16 = hf.convert(copy.deepcopy(original), recipe="bf16")  # the same experts, asked for by recipe
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(_logits_without_dense_fp8(model, bf16, ids), bf16(ids).logits)


@pytest.mark.parametrize("layout", ["v5", "v4"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_small_fp8_experts_get_a_bf16_weight_gradient(family, layout):
    """FP8 experts with ``min(H, I) < min_fp8_wgrad_size`` run ``rowwise_gw_hp`` (the report says
    why; at the boundary they keep ``rowwise``), and the model then computes, forward and backward,
    exactly what ``recipe="rowwise_gw_hp"`` (asked for) computes. Recipes without row scales and an
    FP8 weight gradient are left as asked."""
    small = min(H, I)
    original = _model(family, layout)
    at = hf.convert(copy.deepcopy(original), dense=False, min_expert_size=0, min_fp8_wgrad_size=small)
    assert {m.recipe.name for m in at.modules() if isinstance(m, FP8GroupedExperts)} == {"rowwise"}
    assert not any("below" in e.detail for e in at.fp8_conversion_report.entries)
    model = hf.convert(copy.deepcopy(original), dense=False, min_expert_size=0, min_fp8_wgrad_size=small + 1,
                       cache_weights=True)
    report = model.fp8_conversion_report
    experts = [m for m in model.modules() if isinstance(m, FP8GroupedExperts)]
    entries = [e for e in report.entries if e.became == cr.FP8_EXPERTS]
    assert experts and len(entries) == len(experts) and not report.counts().get(cr.BF16_EXPERTS)
    assert all(m.recipe == get_recipe("rowwise_gw_hp") and m.cache_weights for m in experts)
    assert all(e.fp8 and e.detail.endswith(f"H={H} I={I}, rowwise_gw_hp (below min_fp8_wgrad_size: "
                                           f"min(H, I) < {small + 1})") for e in entries)
    assert f"min_fp8_wgrad_size {small + 1}" in str(report) and report.min_fp8_wgrad_size == small + 1
    asked = hf.convert(copy.deepcopy(original), recipe="rowwise_gw_hp", dense=False, min_expert_size=0)
    ids = _ids()
    got, want = model(ids).logits, asked(ids).logits
    assert torch.equal(got, want)
    if (family, layout) == ("qwen3_moe", "v5"):
        got.float().square().mean().backward()
        want.float().square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), asked.parameters()):
            assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name
    tensorwise = hf.convert(copy.deepcopy(original), recipe="tensorwise", dense=False, min_expert_size=0,
                            min_fp8_wgrad_size=small + 1)
    assert {m.recipe.name for m in tensorwise.modules() if isinstance(m, FP8GroupedExperts)} == {"tensorwise"}


def test_bf16_wgrad_recipe_keeps_the_other_settings():
    custom = get_recipe("rowwise", pow2_scales=False).replace(grad_format="e5m2")
    assert bf16_wgrad(get_recipe("rowwise")) == get_recipe("rowwise_gw_hp")
    assert bf16_wgrad(custom) == custom.replace(name="rowwise_gw_hp", fp8_wgrad=False)


def _logits_without_dense_fp8(model: nn.Module, reference: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``model``'s logits with each ``FP8Linear`` swapped for ``reference``'s linear of the same name."""
    for name, m in list(model.named_modules()):
        if isinstance(m, FP8Linear):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, reference.get_submodule(name))
    return model(ids).logits


def test_min_bf16_expert_size_is_checked():
    with pytest.raises(ValueError, match="min_bf16_expert_size: expected >= 0, got -1"):
        hf.convert(_model("qwen3_moe", "v5"), min_bf16_expert_size=-1)
    with pytest.raises(TypeError, match="min_bf16_expert_size: expected an int, got str"):
        hf.convert(_model("qwen3_moe", "v5"), min_bf16_expert_size="bf16")


def test_expert_size_rule_on_a_bare_block():
    block = _random(V4_BLOCKS["qwen3_moe"]())
    assert hf.convert(block) is block and isinstance(block.experts, nn.ModuleList)
    assert block.fp8_conversion_report.counts() == {cr.KEPT: 2, f"kept: {cr.BELOW_MIN_EXPERT_SIZE}": 1,
                                                    f"kept: {cr.ROUTER}": 1}
    new = hf.convert(_random(V4_BLOCKS["qwen3_moe"]()), min_bf16_expert_size=0)
    assert isinstance(new, FP8HFMoEBlock) and new.experts.recipe.name == "bf16"
    assert new.fp8_conversion_report.counts()[cr.BF16_EXPERTS] == 1


class _Plain(nn.Module):
    """A user's own model: embedding, an MLP with one odd width, a tied head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, 32)
        self.up = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 24)
        self.back = nn.Linear(24, 32)
        self.proj = nn.Linear(32, 32, bias=False)
        self.head = nn.Linear(32, V, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        x = self.proj(self.back(torch.relu(self.odd(torch.relu(self.up(x))))) + x)
        return self.head(x)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_save_pretrained_and_generate(family, tmp_path):
    """What users do with a converted model after training: ``save_pretrained`` writes the unconverted
    model's keys and values (an unconverted model loads them as they are, caches filled or not), and
    ``generate`` decodes with the KV cache through the FP8 modules (one-token steps), its first
    token the argmax of the prefill's logits."""
    model = _model(family, "v5")
    reference = copy.deepcopy(model)
    hf.convert(model, min_dense_size=0, min_expert_size=0, cache_dense_weights=True)
    ids = _ids()
    model(ids, labels=ids).loss.backward()  # fills the weight caches
    model.save_pretrained(tmp_path)
    loaded = type(reference).from_pretrained(tmp_path, dtype=torch.bfloat16)
    want = reference.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    model.eval()
    with torch.no_grad():
        prompt = ids[:1, :4]
        first = model(prompt).logits[0, -1].argmax()
        out = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 8) and torch.equal(out[0, :4], prompt[0]) and out[0, 4] == first
    assert ((out >= 0) & (out < V)).all()


@pytest.mark.parametrize("family", sorted(MODELS))
def test_hf_gradient_checkpointing_and_fp32_master_weights(family):
    """Hugging Face's own activation checkpointing (non-reentrant) on a converted model recomputes
    the FP8 modules in backward: two accumulated micro-batches give the same loss and gradients bit
    for bit as without it (weight caches on, dense ones too). fp32 parameters under bf16 autocast
    train through the caches' stand-ins: fp32 gradients, close to the bf16 model's."""
    base = _model(family, "v5")
    ids = _ids()
    plain = copy.deepcopy(base)
    hf.convert(plain, min_dense_size=0, min_expert_size=0, cache_dense_weights=True)
    recomputed = copy.deepcopy(plain)
    recomputed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    results = []
    for model in (plain.train(), recomputed.train()):
        for _ in range(2):
            loss = model(ids, labels=ids).loss
            loss.backward()
        results.append([loss.detach(), *(p.grad for p in model.parameters())])
    assert all(g is not None for g in results[0][1:])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    master = copy.deepcopy(base).float()
    hf.convert(master, min_dense_size=0, min_expert_size=0, cache_dense_weights=True)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss32 = master(ids, labels=ids).loss
        loss32.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in master.parameters())
    assert abs(loss32.item() - results[0][0].item()) < 0.05 * abs(results[0][0].item())


@pytest.mark.parametrize("family", sorted(MODELS))
def test_inference_mode_evaluation_between_training_steps(family):
    """An evaluation under ``torch.inference_mode`` (a forward and ``generate``) between training
    steps fills the weight caches with inference tensors, which autograd cannot save: the next
    training step misses them and trains exactly as a twin that never evaluated (it raised before)."""
    model = _model(family, "v5")
    hf.convert(model, min_dense_size=0, min_expert_size=0, cache_dense_weights=True)
    twin = copy.deepcopy(model)
    ids = _ids()
    results = []
    for m, evaluate in ((model, True), (twin, False)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        losses = []
        for _ in range(2):
            loss = m(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            if evaluate:
                m.eval()
                with torch.inference_mode():
                    m(ids)
                    m.generate(ids[:1, :4], max_new_tokens=2, do_sample=False, pad_token_id=0)
                m.train()
        loss = m(ids, labels=ids).loss
        loss.backward()
        results.append([*losses, loss.detach(), *(p.grad for p in m.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_router_logits_and_load_balancing_loss(family):
    """``output_router_logits=True`` (the load-balancing loss of Mixtral / Qwen3-MoE training): the
    converted blocks hand Hugging Face the router logits, so with the dense linears as built (the
    router sees the same hidden states) the auxiliary loss and its gradient in the router equal the
    unconverted model's bit for bit (transformers 5.x records them from the router modules)."""
    model = _model(family, "v5")
    reference = copy.deepcopy(model)
    hf.convert(model, dense=False, min_expert_size=0)
    ids = _ids()
    got = model(ids, labels=ids, output_router_logits=True)
    want = reference(ids, labels=ids, output_router_logits=True)
    assert got.aux_loss is not None and torch.equal(got.aux_loss, want.aux_loss)
    got.aux_loss.backward()
    want.aux_loss.backward()
    routers = [n for n, m in reference.named_modules() if n.endswith((".gate", ".router")) and hasattr(m, "weight")]
    assert routers
    mine = dict(model.named_parameters())
    for n in routers:
        w = dict(reference.named_parameters())[f"{n}.weight"]
        assert w.grad is not None and torch.equal(mine[f"{n}.weight"].grad, w.grad), n


def test_plain_model():
    torch.manual_seed(0)
    model = _Plain().to(torch.bfloat16)
    ids = _ids()
    ref = model(ids)
    converted = convert_to_fp8(copy.deepcopy(model))
    report = converted.fp8_conversion_report
    got = {e.fqn: (e.became, e.reason) for e in report.entries}
    assert got == {"embed": (cr.KEPT, cr.EMBEDDING), "up": (cr.FP8_LINEAR, None),
                   "odd": (cr.KEPT, cr.NOT_MULTIPLE_OF_16), "back": (cr.KEPT, cr.NOT_MULTIPLE_OF_16),
                   "proj": (cr.FP8_LINEAR, None), "head": (cr.KEPT, cr.LM_HEAD)}  # tied to the embedding
    assert isinstance(converted.up, FP8Linear) and converted.up.weight is not model.up.weight  # a deep copy
    assert report.fp8_params == 32 * 64 + 64 + 32 * 32
    out = converted(ids)
    assert sqnr(ref.float(), out.float()) >= FLOOR
    out.float().pow(2).mean().backward()
    for m in (converted.up, converted.proj):
        assert m.weight.grad is not None and m.weight.grad.abs().sum() > 0
    text = str(report)
    assert "FP8 parameters: 3,136 of" in text and "not a multiple of 16" in text and "64->24" in text


def test_own_fp8moe_model():
    """FP8MoE's router stays, its experts are reported as FP8 already, its shared experts convert."""
    model = nn.ModuleDict({"moe": FP8MoE(64, 32, 4, 2, shared_expert_hidden_size=32), "out": nn.Linear(64, 64)})
    convert_to_fp8(model)
    kinds = {e.fqn: (e.became, e.reason) for e in model.fp8_conversion_report.entries}
    assert kinds["moe.router"] == (cr.KEPT, cr.ROUTER) and kinds["moe.experts"] == (cr.FP8_EXPERTS, None)
    assert kinds["out"] == (cr.FP8_LINEAR, None)
    assert any(f.startswith("moe.shared_experts.") and b == cr.FP8_LINEAR for f, (b, _) in kinds.items())


def test_filter_fn_honoured():
    seen = []

    def only_attention(module, fqn):
        seen.append((type(module), fqn))
        return ".self_attn." in fqn

    model = hf.convert(_model("llama4", "v5"), filter_fn=only_attention, min_dense_size=0, min_expert_size=0)
    report = model.fp8_conversion_report
    assert all(t is nn.Linear for t, _ in seen) and "lm_head" not in {f for _, f in seen}  # lm_head never asked
    for e in report.entries:
        if e.cls == "Linear" and e.fqn != "lm_head":
            want = (cr.FP8_LINEAR, None) if ".self_attn." in e.fqn else (cr.KEPT, cr.FILTER_FN)
            assert (e.became, e.reason) == want, e.fqn
    assert report.counts()[f"kept: {cr.FILTER_FN}"] == 6  # the dense MLP and the shared expert
    assert report.counts()[cr.FP8_EXPERTS] == 1  # filter_fn chooses among dense linears only


def test_bf16_recipe_and_dense_off():
    model = hf.convert(_model("qwen3_moe", "v5"), recipe="bf16", min_dense_size=0, min_expert_size=0)
    report = model.fp8_conversion_report
    assert report.counts()[cr.BF16_EXPERTS] == 1 and cr.FP8_LINEAR not in report.counts()
    assert report.counts()[f"kept: {cr.BF16_RECIPE}"] == 4 and report.fp8_fraction == 0.0
    assert not any(isinstance(m, FP8Linear) for m in model.modules())
    model = hf.convert(_model("qwen3_moe", "v4"), dense=False, min_dense_size=0, min_expert_size=0)
    assert model.fp8_conversion_report.counts()[f"kept: {cr.DENSE_OFF}"] == 4
    assert model.fp8_conversion_report.counts()[cr.FP8_EXPERTS] == 1
    model = hf.convert(_model("qwen3_moe", "v5"), recipe="blockwise", dense_recipe="tensorwise", min_dense_size=0,
                       min_expert_size=0)
    linears = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert len(linears) == 4 and all(m.recipe.name == "tensorwise" for m in linears)


@pytest.mark.interpreter
def test_skewed_routing_empty_experts():
    """DeepSeek-V3's selection bias pushed down for experts 2..7: every token goes to experts 0 and 1,
    the others get no rows; outputs and gradients stay finite, the empty experts' gradients zero."""
    model = _model("deepseek_v3", "v5")
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias[2:] = -100.0
    ids = _ids()
    ref = model(ids).logits
    converted = hf.convert(copy.deepcopy(model), min_dense_size=0, min_expert_size=0)
    dirty_allocator()
    out = converted(ids).logits
    assert torch.isfinite(out).all() and sqnr(ref.float(), out.float()) >= FLOOR
    out.float().pow(2).mean().backward()
    for w in (converted.model.layers[1].mlp.experts.gate_up_proj, converted.model.layers[1].mlp.experts.down_proj):
        g = w.grad
        assert torch.isfinite(g).all() and g[:2].abs().sum() > 0 and torch.equal(g[2:], torch.zeros_like(g[2:]))


def test_bad_arguments():
    model = _model("mixtral", "v5")
    with pytest.raises(TypeError, match="filter_fn: expected a callable"):
        hf.convert(model, filter_fn="attn")
    with pytest.raises(ValueError, match="min_dense_size: expected >= 0, got -1"):
        hf.convert(model, min_dense_size=-1)
    with pytest.raises(TypeError, match="min_dense_size: expected an int, got str"):
        convert_to_fp8(model, min_dense_size="512")
    with pytest.raises(ValueError, match="min_expert_size: expected >= 0, got -2"):
        hf.convert(model, min_expert_size=-2)
    with pytest.raises(TypeError, match="min_expert_size: expected an int, got float"):
        hf.convert(model, min_expert_size=1024.0)
    with pytest.raises(ValueError, match="min_fp8_wgrad_size: expected >= 0, got -1"):
        hf.convert(model, min_fp8_wgrad_size=-1)
    with pytest.raises(TypeError, match="min_fp8_wgrad_size: expected an int, got float"):
        hf.convert(model, min_fp8_wgrad_size=1.5)
    with pytest.raises(TypeError, match="dense: expected a bool"):
        hf.convert(model, dense="yes")
    with pytest.raises(TypeError, match="model: expected an nn.Module, got dict"):
        hf.convert({})
    with pytest.raises(ValueError, match="recipe: expected one of"):
        hf.convert(model, recipe="fp4")
    with pytest.raises(ValueError, match="dense_recipe: recipe 'blockwise' has no dense FP8Linear form"):
        hf.convert(model, recipe="blockwise")
    with pytest.raises(ValueError, match="recipe: expected one of .* for a dense layer"):
        hf.convert(model, dense_recipe="blockwise")
    assert not any(isinstance(m, (FP8Linear, FP8GroupedExperts)) for m in model.modules())  # nothing half-done


def test_converting_twice():
    """hf.convert refuses a model it converted (a second recipe would silently not apply);
    convert_to_fp8 is idempotent (FP8Linear layers are reported as they are)."""
    model = hf.convert(_model("mixtral", "v4"), min_dense_size=0, min_expert_size=0)
    with pytest.raises(ValueError, match="model: already converted by moe_fp8 .*convert a fresh copy"):
        hf.convert(model, recipe="bf16")
    plain = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 20))
    convert_to_fp8(plain)
    first, before = plain[0], plain.fp8_conversion_report
    convert_to_fp8(plain)
    after = plain.fp8_conversion_report
    assert plain[0] is first and [e.became for e in after.entries] == [e.became for e in before.entries]
    assert "already FP8Linear" in after.entries[0].detail and after.fp8_params == before.fp8_params


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["v5", "v4"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_families_whole_model_gpu(family, layout):
    """On the GPU, default backends (torch._scaled_grouped_mm / torch._scaled_mm, Triton quantizers)."""
    model = _model(family, layout).cuda()
    ids = _ids().cuda()
    ref = model(ids).logits
    converted = hf.convert(copy.deepcopy(model), min_dense_size=0, min_expert_size=0)
    counts = converted.fp8_conversion_report.counts()
    assert counts[cr.FP8_EXPERTS] >= 1 and counts[cr.FP8_LINEAR] >= 4
    out = converted(ids).logits
    assert sqnr(ref.float(), out.float()) >= FLOOR
    out.float().pow(2).mean().backward()
    for name, m in _fp8_modules(converted).items():
        for p in m.parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
