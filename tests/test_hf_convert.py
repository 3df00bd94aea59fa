"""moe_fp8.hf.convert on tiny random Hugging Face blocks (transformers 5.x classes, and 4.x-style
blocks with ModuleList experts written here), built from config objects: no hub downloads."""

import copy
from collections import Counter

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from transformers import DeepseekV3Config, Llama4TextConfig, MixtralConfig, Qwen3MoeConfig  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE  # noqa: E402
from transformers.models.llama4.modeling_llama4 import Llama4TextMoe  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

from moe_fp8 import FP8GroupedExperts, hf  # noqa: E402
from moe_fp8.layers.hf_blocks import FP8HFMoEBlock, FP8Llama4TextMoe  # noqa: E402
from moe_fp8.testing import sqnr  # noqa: E402

H, I = 64, 32
FP8_FLOOR = 20.0  # block output vs the original block (two FP8 layers, ~22-25 dB measured)
BF16_FLOOR = 40.0  # recipe="bf16": the same bf16 math in another order (~50 dB measured)

V5_BLOCKS = {
    "mixtral": lambda: MixtralSparseMoeBlock(
        MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=4, num_experts_per_tok=2)
    ),
    "qwen3_moe": lambda: Qwen3MoeSparseMoeBlock(
        Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    ),
    "deepseek_v3": lambda: DeepseekV3MoE(
        DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=8, num_experts_per_tok=2,
                         n_group=2, topk_group=1, n_shared_experts=1)
    ),
    "llama4": lambda: Llama4TextMoe(
        Llama4TextConfig(hidden_size=H, intermediate_size=I, num_local_experts=4, num_experts_per_tok=1)
    ),
}


# --- transformers 4.x-style blocks (ModuleList experts), as those releases wrote them ----------
class _MLP(nn.Module):
    def __init__(self, names=("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        g, u, d = names
        setattr(self, g, nn.Linear(H, I, bias=False))
        setattr(self, u, nn.Linear(H, I, bias=False))
        setattr(self, d, nn.Linear(I, H, bias=False))
        self.names = names
        self.act_fn = nn.SiLU()

    def forward(self, x):
        g, u, d = (getattr(self, n) for n in self.names)
        return d(self.act_fn(g(x)) * u(x))


class MixtralSparseMoeBlock4(nn.Module):  # renamed to the 4.x class name below
    def __init__(self, E=4, k=2):
        super().__init__()
        self.top_k = k
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(_MLP(("w1", "w3", "w2")) for _ in range(E))

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        logits = self.gate(x)
        w = torch.softmax(logits, dim=1, dtype=torch.float)
        w, ids = torch.topk(w, self.top_k, dim=-1)
        w = (w / w.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, (expert(x[tok]) * w[tok, slot, None]).to(x.dtype))
        return out.view(b, s, h), logits


class Qwen3MoeSparseMoeBlock4(MixtralSparseMoeBlock4):
    def __init__(self, E=8, k=2):
        super().__init__(E, k)
        self.norm_topk_prob = True
        self.experts = nn.ModuleList(_MLP() for _ in range(E))


class DeepseekV3TopkRouter4(nn.Module):
    def __init__(self, E=8, k=2):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = k, 2, 1
        self.norm_topk_prob, self.routed_scaling_factor = True, 2.5
        self.weight = nn.Parameter(torch.empty(E, H))
        self.register_buffer("e_score_correction_bias", torch.zeros(E))

    def forward(self, x):  # 4.x: returns (topk_indices, topk_weights)
        E = self.weight.shape[0]
        scores = torch.sigmoid(nn.functional.linear(x.float(), self.weight.float()))
        choice = scores + self.e_score_correction_bias
        group = choice.view(-1, self.n_group, E // self.n_group).topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(group).scatter_(1, group.topk(self.topk_group, dim=-1)[1], 1)
        mask = keep.unsqueeze(-1).expand(-1, self.n_group, E // self.n_group).reshape(-1, E)
        ids = choice.masked_fill(~mask.bool(), 0.0).topk(self.top_k, dim=-1)[1]
        w = scores.gather(1, ids)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * self.routed_scaling_factor
        return ids, w


class DeepseekV3MoE4(nn.Module):
    def __init__(self, E=8, k=2):
        super().__init__()
        self.gate = DeepseekV3TopkRouter4(E, k)
        self.experts = nn.ModuleList(_MLP() for _ in range(E))
        self.shared_experts = _MLP()

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.view(-1, shape[-1])
        ids, w = self.gate(x)
        out = torch.zeros_like(x, dtype=torch.float32)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, expert(x[tok]).float() * w[tok, slot, None])
        return (out.to(x.dtype) + self.shared_experts(x)).view(shape)


class _Llama4Experts4(nn.Module):
    """Llama4TextExperts: fused in/out weights (E, H, 2I) / (E, I, H), input expert-major (E*T, H)."""

    def __init__(self, E):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(E, H, 2 * I))
        self.down_proj = nn.Parameter(torch.empty(E, I, H))
        self.act_fn = nn.SiLU()

    def forward(self, x):
        gate, up = torch.bmm(x.view(self.gate_up_proj.shape[0], -1, H), self.gate_up_proj).chunk(2, dim=-1)
        return torch.bmm(up * self.act_fn(gate), self.down_proj).view(-1, H)


class Llama4TextMoe4(nn.Module):
    """transformers 4.51-4.53: the router is a plain nn.Linear, the block picks the top-k and returns
    (out (T, H), scores (E, T)): sigmoid of the top-k logits, 0 for the other experts."""

    def __init__(self, E=4, k=2):
        super().__init__()
        self.top_k, self.hidden_dim, self.num_experts = k, H, E
        self.experts = _Llama4Experts4(E)
        self.router = nn.Linear(H, E, bias=False)
        self.shared_expert = _MLP()

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, H)
        logits = self.router(x)
        top, ids = torch.topk(logits, self.top_k, dim=1)
        scores = torch.full_like(logits, float("-inf")).scatter_(1, ids, top).t()
        scores = torch.sigmoid(scores.float()).to(x.dtype)
        routed = self.experts(x.repeat(self.num_experts, 1) * scores.reshape(-1, 1))
        return self.shared_expert(x) + routed.view(self.num_experts, -1, H).sum(dim=0), scores


MixtralSparseMoeBlock4.__name__ = "MixtralSparseMoeBlock"
Qwen3MoeSparseMoeBlock4.__name__ = "Qwen3MoeSparseMoeBlock"
DeepseekV3MoE4.__name__ = "DeepseekV3MoE"
Llama4TextMoe4.__name__ = "Llama4TextMoe"
V4_BLOCKS = {"mixtral": MixtralSparseMoeBlock4, "qwen3_moe": Qwen3MoeSparseMoeBlock4, "deepseek_v3": DeepseekV3MoE4,
             "llama4": Llama4TextMoe4}


def _random(block: nn.Module) -> nn.Module:
    """Random parameters, and random bias buffers (DeepSeek-V3's selection-only
    ``e_score_correction_bias``, zero as built, which would leave the bias path untested)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
        for name, b in block.named_buffers():
            if name.endswith("bias") and b.is_floating_point():
                b.uniform_(-0.3, 0.3)
    return block.to(torch.bfloat16)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _check(block: nn.Module, recipe: str):
    x = torch.randn(4, 16, H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ref = block(x)
    model = nn.Sequential(copy.deepcopy(block))
    hf.convert(model, recipe=recipe, min_expert_size=0)
    out = model[0](x)
    assert type(out) is type(ref) and _first(out).shape == _first(ref).shape
    assert _first(out).dtype == _first(ref).dtype
    if isinstance(ref, tuple):
        assert out[1].dtype == ref[1].dtype
        assert torch.equal(out[1], ref[1])  # router logits / scores come back unchanged
    floor = BF16_FLOOR if recipe == "bf16" else FP8_FLOOR
    assert sqnr(_first(ref).float(), _first(out).float()) >= floor
    return model[0]


@pytest.mark.interpreter
@pytest.mark.parametrize("recipe", ["bf16", "rowwise"])
@pytest.mark.parametrize("family", sorted(V5_BLOCKS))
def test_transformers_v5_blocks(family, recipe):
    block = _random(V5_BLOCKS[family]())
    if family == "deepseek_v3":  # a random selection bias: ignoring or negating it fails (< 4 dB)
        assert block.gate.e_score_correction_bias.abs().min() > 0
    new = _check(block, recipe)
    if family == "llama4":
        assert isinstance(new, FP8Llama4TextMoe) and type(new.router) is type(block.router)
        assert not new.linear_router
    else:
        assert isinstance(new.experts, FP8GroupedExperts)
        assert type(new.gate) is type(block.gate)  # the original router module stays


def test_v5_conversion_shares_parameters():
    block = _random(V5_BLOCKS["qwen3_moe"]())
    w = block.experts.gate_up_proj
    hf.convert(nn.Sequential(block), min_expert_size=0)
    assert block.experts.gate_up_proj is w  # no copy: optimizer state and checkpoints carry over
    assert set(block.state_dict()) >= {"experts.gate_up_proj", "experts.down_proj", "gate.weight"}
    llama = _random(V5_BLOCKS["llama4"]())
    w1, w2 = llama.experts.gate_up_proj, llama.experts.down_proj
    holder = nn.Sequential(llama)
    hf.convert(holder, min_expert_size=0)
    assert holder[0].experts.gate_up_proj is w1 and holder[0].experts.down_proj is w2
    assert holder[0].experts.in_out_layout


@pytest.mark.interpreter
def test_weight_caches_are_off_by_default():
    """Caches hold a BF16-sized copy under accumulation: every builder leaves them off unless asked."""
    block = hf.convert(_random(V4_BLOCKS["mixtral"]()), min_expert_size=0)
    assert not block.experts.cache_weights and not any(c.copies for c in block.experts._caches)
    assert hf.convert(_random(V4_BLOCKS["mixtral"]()), min_expert_size=0, cache_weights=True).experts.cache_weights
    assert not FP8GroupedExperts(4, 64, 32).cache_weights


def test_llama4_layout_weight_cache_hits():
    """Llama 4 stores (E, H, 2I): the experts pass transposed views, new each call; the cache
    must still hit while the weights are unchanged, and miss after an update."""
    llama = _random(V5_BLOCKS["llama4"]()).to(torch.bfloat16)
    holder = nn.Sequential(llama)
    hf.convert(holder, min_expert_size=0, cache_weights=True)
    experts = holder[0].experts
    x = torch.randn(2, 5, H, dtype=torch.bfloat16)
    for _ in range(3):
        holder(x)
    up, down = experts._caches
    assert (up.misses, up.hits) == (2, 1) and (down.misses, down.hits) == (2, 1)  # the first kept nothing
    with torch.no_grad():
        experts.gate_up_proj.mul_(0.5)
    holder(x)
    assert up.misses == 3 and down.misses == 2


@pytest.mark.interpreter
@pytest.mark.parametrize("recipe", ["bf16", "rowwise"])
@pytest.mark.parametrize("family", sorted(V4_BLOCKS))
def test_transformers_v4_blocks(family, recipe):
    block = _random(V4_BLOCKS[family]())
    if family == "deepseek_v3":  # a random selection bias: ignoring or negating it fails (< 4 dB)
        assert block.gate.e_score_correction_bias.abs().min() > 0
    new = _check(block, recipe)
    if family == "llama4":
        assert isinstance(new, FP8Llama4TextMoe) and new.linear_router and type(new.router) is nn.Linear
    else:
        assert isinstance(new, FP8HFMoEBlock)


@pytest.mark.interpreter
def test_whole_model_and_backward():
    cfg = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=4, num_experts_per_tok=2,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=96)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.randint(0, 96, (2, 12))
    ref = model(ids).logits
    converted = hf.convert(copy.deepcopy(model), min_expert_size=0)
    out = converted(ids).logits
    assert sqnr(ref.float(), out.float()) >= FP8_FLOOR
    out.float().pow(2).mean().backward()
    grads = [p.grad for n, p in converted.named_parameters() if "experts" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.interpreter
def test_report_gives_the_weight_caches_filled_bytes():
    """The conversion report's ``weight_cache_nbytes`` is what the converted modules' caches hold
    after micro-batches of gradient accumulation (experts and dense linears), and its text says so;
    ``uncached_layouts_nbytes`` is what the caches left off would hold: the same bytes for a model
    converted without caches, the dense linears' alone with the experts' cache on."""
    cfg = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=4, num_experts_per_tok=2,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=96)
    torch.manual_seed(0)
    base = transformers.MixtralForCausalLM(cfg).to(torch.bfloat16)

    def converted(experts: bool, dense: bool):
        return hf.convert(copy.deepcopy(base), min_expert_size=0, min_dense_size=0, cache_weights=experts,
                          cache_dense_weights=dense)

    model = converted(True, True)
    for _ in range(3):
        model(torch.randint(0, 96, (2, 12))).logits.float().square().mean().backward()
    held = Counter()
    for m in model.modules():
        held[type(m).__name__] += getattr(m, "weight_cache_nbytes", 0)
    held = +held  # the classes holding bytes
    assert set(held) == {"FP8Linear", "FP8GroupedExperts"}
    cached, off, experts_only = (m.fp8_conversion_report for m in (model, converted(False, False),
                                                                    converted(True, False)))
    assert (cached.weight_cache_nbytes, cached.uncached_layouts_nbytes) == (sum(held.values()), 0)
    assert (off.weight_cache_nbytes, off.uncached_layouts_nbytes) == (0, sum(held.values()))
    assert (experts_only.weight_cache_nbytes, experts_only.uncached_layouts_nbytes) == (
        held["FP8GroupedExperts"], held["FP8Linear"])
    assert "once filled" in str(cached) and "caches off" not in str(cached)
    assert "once filled" not in str(off) and "caches off" in str(off)
    assert "once filled" in str(experts_only) and "caches off" in str(experts_only)


@pytest.mark.interpreter
def test_bare_block():
    block = _random(V5_BLOCKS["mixtral"]())
    assert hf.convert(block, min_expert_size=0) is block and isinstance(block.experts, FP8GroupedExperts)
    assert isinstance(hf.convert(_random(V5_BLOCKS["llama4"]()), min_expert_size=0), FP8Llama4TextMoe)
    assert isinstance(hf.convert(_random(V4_BLOCKS["mixtral"]()), min_expert_size=0), FP8HFMoEBlock)


def test_unsupported_blocks_are_named():
    class FancyMoeBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList()

    with pytest.raises(ValueError, match=r"unsupported MoE block class\(es\) \(FancyMoeBlock: not a transformers 5.x "
                                         r"experts module"):
        hf.convert(nn.Sequential(FancyMoeBlock()))
    with pytest.raises(ValueError, match="no MoE block found"):
        hf.convert(nn.Sequential(nn.Linear(4, 4)))
