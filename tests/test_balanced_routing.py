"""Balanced routing for the whole-model benchmark (``moe_fp8.bench.balanced_routing``): the routers
of an untrained model score random inputs, so that every expert gets tokens even where the hidden
states would send them all to the same few; the experts still compute on the hidden states; the
unconverted model and converted copies route alike; bad uses are refused."""

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from moe_fp8.bench import balanced_routing, models  # noqa: E402

SEQ = 32


def _qwen3(routing: str) -> nn.Module:
    return models.build(models._spec("qwen3_h1024", "cpu", 2, routing=routing), SEQ, "cpu")


def _record(model: nn.Module, kind: str) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Per call, in call order, of the MoE blocks' routers (``kind="router"``: first positional input
    and chosen expert ids), experts (``"experts"``: first positional input) or blocks (``"block"``:
    their hidden states, flattened to rows)."""
    calls = []

    def hook(module, args, out):
        ids = out[2] if kind == "router" else None
        calls.append((args[0].detach().reshape(-1, args[0].shape[-1]).clone(), None if ids is None else ids.clone()))

    for _, router in balanced_routing._routers(model):
        block = next(b for _, b in model.named_modules() if getattr(b, "gate", None) is router)
        {"router": router, "experts": block.experts, "block": block}[kind].register_forward_hook(hook)
    return calls


def test_balanced_routing_reaches_every_expert_where_learned_routing_collapses(torch_references):
    """One token repeated: every hidden state of a position is the same, so the learned routers send
    all tokens to the same top-k experts; the balanced ones spread them over every expert, and the
    experts still get the block's hidden states (not the router's random inputs)."""
    learned, balanced = _qwen3("learned"), _qwen3("balanced")
    assert balanced_routing.routers_on_random_inputs(learned) == 0
    assert balanced_routing.routers_on_random_inputs(balanced) == 2
    cfg = balanced.config
    batch = torch.full((4, SEQ), 97)  # position 0 of every row alike, and each later position alike
    assert models.empty_experts(learned, batch) == cfg.num_experts - cfg.num_experts_per_tok
    torch.manual_seed(1)
    assert models.empty_experts(balanced, batch) == 0  # 128 tokens x top-2 over 8 experts

    routed, computed, blocks = (_record(balanced, kind) for kind in ("router", "experts", "block"))
    torch.manual_seed(2)
    with torch.no_grad():
        balanced(input_ids=batch)
    assert len(routed) == len(computed) == len(blocks) == 2
    for (router_in, _), (experts_in, _), (block_in, _) in zip(routed, computed, blocks):
        # the router's input: standard normal of the hidden states' shape and dtype; the experts': the hidden states
        assert router_in.shape == block_in.shape and router_in.dtype == block_in.dtype
        assert abs(router_in.float().mean()) < 0.05 and abs(router_in.float().std() - 1) < 0.05
        assert torch.equal(experts_in, block_in) and not torch.equal(router_in, block_in)


def test_converted_copies_route_like_the_unconverted_model(torch_references):
    """``models.convert`` keeps the hooks (the router modules are kept, or hooked again), and with the
    same seed the converted copy's routers choose the unconverted model's experts, token by token;
    the router weight still gets a gradient."""
    base = _qwen3("balanced")
    batch = torch.randint(0, base.config.vocab_size, (2, SEQ))
    ids = {}
    for variant in ("hf_bf16", "ours_fp8_experts", "ours_bf16"):
        model = models.convert(base, variant, None, size_rules=False)
        assert balanced_routing.routers_on_random_inputs(model) == 2
        calls = _record(model, "router")
        torch.manual_seed(3)
        out = model(input_ids=batch).logits
        ids[variant] = [i for _, i in calls]
        out.float().square().mean().backward()
        grads = [r.weight.grad for _, r in balanced_routing._routers(model)]
        assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    assert all(torch.equal(a, b) for a, b in zip(ids["hf_bf16"], ids["ours_fp8_experts"]))
    assert all(torch.equal(a, b) for a, b in zip(ids["hf_bf16"], ids["ours_bf16"]))


def test_balanced_routing_hooks_once_and_survives_deepcopy(torch_references):
    model = _qwen3("learned")
    assert balanced_routing.route_on_random_inputs(model) == 2
    assert balanced_routing.route_on_random_inputs(model) == 2  # idempotent: one hook per router
    assert all(len(r._forward_pre_hooks) == 1 for _, r in balanced_routing._routers(model))
    assert balanced_routing.routers_on_random_inputs(copy.deepcopy(model)) == 2


def test_balanced_routing_refusals(torch_references):
    """A model without MoE routers, a block that never calls its router module, a router called
    without positional hidden states, and an unknown routing are refused by name."""
    from moe_fp8.layers.experts import FP8GroupedExperts
    from moe_fp8.layers.hf_blocks import FP8HFMoEBlock
    from moe_fp8.routing import RouterConfig

    dense = models.build(models._spec("llama3_8b", "cpu", 1, routing="balanced"), SEQ, "cpu")
    assert models._spec("llama3_8b", "cpu", 1, routing="balanced").routing == "learned"  # dense: nothing to route
    with pytest.raises(ValueError, match="no MoE router found"):
        balanced_routing.route_on_random_inputs(dense)

    experts = FP8GroupedExperts(4, 16, 32, recipe="bf16")
    block = FP8HFMoEBlock(nn.Linear(16, 4, bias=False), experts, RouterConfig(num_experts=4, top_k=2))
    with pytest.raises(ValueError, match="FP8HFMoEBlock computes its router logits"):
        balanced_routing.route_on_random_inputs(nn.Sequential(block))

    model = _qwen3("balanced")
    _, router = balanced_routing._routers(model)[0]
    with pytest.raises(TypeError, match="first positional argument"):
        router(hidden_states=torch.zeros(3, model.config.hidden_size, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="routing: expected one of"):
        models.collect("cpu", models=["qwen3_h1024"], routing="uniform")


@pytest.mark.parametrize("argv, want", [([], "learned"), (["--routing", "balanced"], "balanced")])
def test_bench_cli_passes_the_routing(argv, want, tmp_path, monkeypatch):
    """``python -m moe_fp8.bench --kinds model --routing ...`` reaches ``models.collect``."""
    from moe_fp8.bench.__main__ import main

    seen = {}
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # on the CPU, main restarts itself without it
    monkeypatch.setattr(models, "collect", lambda device, **kw: seen.update(kw) or [])
    main(["--preset", "models", "--kinds", "model", "--models", "qwen3_h1024", "--out", str(tmp_path), *argv])
    assert seen["routing"] == want
