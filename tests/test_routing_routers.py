"""Routers: against per-token loop references, against the real models' formulas, losses, NaN, bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moe_fp8.routing import (
    Router,
    RouterConfig,
    expert_counts,
    load_balancing_loss,
    route,
    router_z_loss,
    update_correction_bias_,
)

GEN_SEED = 1234


def _gen(seed=GEN_SEED):
    return torch.Generator().manual_seed(seed)


def _logits(T, E, seed=0, dtype=torch.float32):
    return (torch.randn(T, E, generator=_gen(seed)) * 2).to(dtype)


def _sorted_by_id(ids, w):
    """Order each token's (id, weight) pairs by id, to compare routers whose slot order differs."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), w.gather(1, order)


# --- loop references: one token at a time, plain Python over experts ----------------------------------
def loop_softmax_topk(logits, k, renormalize):
    ids, ws = [], []
    for row in logits.double().tolist():
        m = max(row)
        p = [math.exp(v - m) for v in row]
        s = sum(p)
        p = [v / s for v in p]
        top = sorted(range(len(p)), key=lambda e: -p[e])[:k]
        w = [p[e] for e in top]
        if renormalize:
            w = [v / sum(w) for v in w]
        ids.append(top)
        ws.append(w)
    return torch.tensor(ids).view(-1, k), torch.tensor(ws, dtype=torch.float64).view(-1, k)


def loop_grouped_sigmoid(logits, bias, k, n_group, topk_group, scale):
    ids, ws = [], []
    E = logits.shape[1]
    size = E // n_group
    for row in logits.double().tolist():
        s = [1 / (1 + math.exp(-v)) for v in row]
        key = [s[e] + float(bias[e]) for e in range(E)]
        gscore = [sum(sorted(key[g * size : (g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
        kept = sorted(range(n_group), key=lambda g: -gscore[g])[:topk_group]
        eligible = [e for e in range(E) if e // size in kept]
        top = sorted(eligible, key=lambda e: -key[e])[:k]
        w = [s[e] for e in top]
        w = [scale * v / (sum(w) + 1e-20) for v in w]
        ids.append(top)
        ws.append(w)
    return torch.tensor(ids).view(-1, k), torch.tensor(ws, dtype=torch.float64).view(-1, k)


def loop_sigmoid_topk(logits, k):
    ids, ws = [], []
    for row in logits.double().tolist():
        top = sorted(range(len(row)), key=lambda e: -row[e])[:k]
        ids.append(top)
        ws.append([1 / (1 + math.exp(-row[e])) for e in top])
    return torch.tensor(ids).view(-1, k), torch.tensor(ws, dtype=torch.float64).view(-1, k)


@pytest.mark.parametrize("E,k,renorm", [(8, 2, True), (16, 4, True), (64, 6, False), (5, 5, True), (7, 1, False)])
def test_softmax_topk_matches_loop(E, k, renorm):
    logits = _logits(23, E, seed=E + k)
    out = route(logits, RouterConfig(E, k, "softmax", renormalize=renorm))
    ids, w = loop_softmax_topk(logits, k, renorm)
    assert torch.equal(out.topk_ids, ids)
    torch.testing.assert_close(out.topk_weights.double(), w, rtol=1e-6, atol=1e-7)
    assert out.input_scales is None and out.topk_ids.dtype == torch.int64 and out.topk_weights.dtype == torch.float32


@pytest.mark.parametrize("E,k,G,TG", [(32, 4, 4, 2), (256, 8, 8, 4), (16, 3, 16, 5), (12, 2, 1, 1)])
def test_grouped_sigmoid_matches_loop(E, k, G, TG):
    logits = _logits(17, E, seed=E)
    bias = torch.randn(E, generator=_gen(E)) * 0.1
    cfg = RouterConfig(E, k, "sigmoid", renormalize=True, n_group=G, topk_group=TG, use_correction_bias=True,
                       routed_scaling_factor=2.5)
    out = route(logits, cfg, bias)
    ids, w = loop_grouped_sigmoid(logits, bias, k, G, TG, 2.5)
    assert torch.equal(out.topk_ids, ids)
    torch.testing.assert_close(out.topk_weights.double(), w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("E,k", [(16, 1), (128, 1), (8, 2)])
def test_sigmoid_topk_on_input_matches_loop(E, k):
    logits = _logits(19, E, seed=3)
    out = route(logits, RouterConfig.llama4(E, k))
    ids, w = loop_sigmoid_topk(logits, k)
    assert torch.equal(out.topk_ids, ids)
    assert out.topk_weights is None
    torch.testing.assert_close(out.input_scales.double(), w, rtol=1e-6, atol=1e-7)


# --- the real models' formulas (transformers 5.x / the models' reference code), written out -----------
def hf_mixtral_router(hidden, weight, top_k):  # MixtralTopKRouter / Qwen3MoeTopKRouter (norm_topk_prob)
    router_logits = F.linear(hidden, weight)
    router_probs = F.softmax(router_logits.float(), dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, top_k, dim=-1)
    router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    return router_top_value, router_indices


def deepseek_moe_gate(hidden, weight, top_k, norm_topk_prob=False):  # DeepSeek-MoE-16B MoEGate
    logits = F.linear(hidden, weight, None)
    scores = logits.softmax(dim=-1)
    topk_weight, topk_idx = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    if top_k > 1 and norm_topk_prob:
        topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weight, topk_idx


def hf_deepseek_v3_router(hidden, weight, bias, top_k, n_group, topk_group, scale):  # DeepseekV3TopkRouter
    E = weight.shape[0]
    router_logits = F.linear(hidden.type(torch.float32), weight.type(torch.float32))
    scores = router_logits.sigmoid()
    scores_for_choice = scores.view(-1, E) + bias.unsqueeze(0)
    group_scores = scores_for_choice.view(-1, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, E // n_group).reshape(-1, E)
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), 0.0)
    topk_indices = torch.topk(scores_for_choice, k=top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    topk_weights /= topk_weights.sum(dim=-1, keepdim=True) + 1e-20
    return topk_weights * scale, topk_indices


def hf_llama4_router(hidden, weight, top_k):  # Llama4Router: (T, E) scores, sigmoid of the top logits
    router_logits = F.linear(hidden, weight)
    router_top_value, router_indices = torch.topk(router_logits, top_k, dim=1)
    router_scores = torch.full_like(router_logits, float("-inf")).scatter_(1, router_indices, router_top_value)
    return torch.sigmoid(router_scores.float()).to(router_scores.dtype), router_indices


def _router(H, cfg, seed=0):
    torch.manual_seed(seed)
    return Router(H, cfg)


def test_mixtral_and_qwen3_formula():
    for cfg in (RouterConfig.mixtral(), RouterConfig.qwen3_moe()):
        r = _router(64, cfg)
        x = torch.randn(31, 64, generator=_gen(5)).bfloat16()
        r.weight.data = r.weight.data.bfloat16()
        out = r(x)
        w_ref, ids_ref = hf_mixtral_router(x, r.weight, cfg.top_k)
        assert torch.equal(out.topk_ids, ids_ref)
        assert torch.equal(out.topk_weights, w_ref)  # same fp32 ops: bit-identical


def test_deepseek_moe_16b_formula():
    cfg = RouterConfig.deepseek_moe_16b()
    r = _router(48, cfg)
    x = torch.randn(29, 48, generator=_gen(6))
    out = r(x)
    w_ref, ids_ref = deepseek_moe_gate(x, r.weight, cfg.top_k)
    ids, w = _sorted_by_id(out.topk_ids, out.topk_weights)
    ids_r, w_r = _sorted_by_id(ids_ref, w_ref)
    assert torch.equal(ids, ids_r)
    torch.testing.assert_close(w, w_r, rtol=0, atol=0)


def test_deepseek_v3_formula():
    cfg = RouterConfig.deepseek_v3()
    r = _router(96, cfg).bfloat16()
    r.e_score_correction_bias.uniform_(0.0, 0.05)  # keys stay positive: HF's 0.0-mask equals -inf-mask
    x = torch.randn(41, 96, generator=_gen(7)).bfloat16()
    out = r(x)
    w_ref, ids_ref = hf_deepseek_v3_router(x, r.weight, r.e_score_correction_bias, 8, 8, 4, 2.5)
    ids, w = _sorted_by_id(out.topk_ids, out.topk_weights)
    ids_r, w_r = _sorted_by_id(ids_ref, w_ref)
    assert torch.equal(ids, ids_r)
    torch.testing.assert_close(w, w_r, rtol=1e-6, atol=0)  # sum order of the k weights may differ
    assert out.logits.dtype == torch.float32


def test_deepseek_v3_masks_other_groups_even_with_negative_keys():
    """DeepSeek's reference masks the dropped groups to -inf: negative keys in kept groups still win."""
    E, G = 8, 4
    cfg = RouterConfig(E, 2, "sigmoid", renormalize=True, n_group=G, topk_group=1, use_correction_bias=True)
    bias = torch.full((E,), -2.0)
    logits = torch.tensor([[5.0, 4.0, -9, -9, -9, -9, -9, -9]])
    out = route(logits, cfg, bias)
    assert sorted(out.topk_ids[0].tolist()) == [0, 1]


def test_llama4_formula():
    cfg = RouterConfig.llama4(16)
    r = _router(40, cfg)
    x = torch.randn(33, 40, generator=_gen(8))
    out = r(x)
    scores, ids_ref = hf_llama4_router(x, r.weight, 1)
    assert torch.equal(out.topk_ids, ids_ref)
    assert torch.equal(out.input_scales, scores.gather(1, ids_ref))
    assert torch.equal(scores.sum(-1, keepdim=True), out.input_scales)  # non-selected score 0


# --- losses -----------------------------------------------------------------------------------------
def hf_load_balancing_loss(gate_logits, num_experts, top_k):  # transformers load_balancing_loss_func
    routing_weights = F.softmax(gate_logits, dim=-1)
    _, selected_experts = torch.topk(routing_weights, top_k, dim=-1)
    expert_mask = F.one_hot(selected_experts, num_experts)
    tokens_per_expert = torch.mean(expert_mask.float(), dim=0)
    router_prob_per_expert = torch.mean(routing_weights, dim=0)
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * num_experts


@pytest.mark.parametrize("k", [1, 2, 4])
def test_load_balancing_loss_is_hf_over_k(k):
    logits = _logits(50, 8, seed=k)
    out = route(logits, RouterConfig(8, k, "softmax", renormalize=True, aux_loss_coef=1.0))
    torch.testing.assert_close(out.aux_loss * k, hf_load_balancing_loss(logits, 8, k), rtol=1e-6, atol=0)


def test_load_balancing_loss_is_one_when_balanced_and_has_gradient():
    T, E, k = 16, 4, 2
    ids = torch.tensor([[t % E, (t + 1) % E] for t in range(T)])
    density = torch.full((T, E), 1 / E, requires_grad=True)
    loss = load_balancing_loss(density, expert_counts(ids, E), k)
    torch.testing.assert_close(loss, torch.tensor(1.0))
    loss.backward()
    torch.testing.assert_close(density.grad, torch.full((T, E), 1 / T))


def test_sigmoid_aux_loss_uses_normalised_scores():
    logits = _logits(30, 16, seed=11)
    cfg = RouterConfig(16, 4, "sigmoid", renormalize=True, aux_loss_coef=0.5)
    out = route(logits, cfg)
    s = logits.sigmoid().double()
    density = s / s.sum(-1, keepdim=True)
    f = torch.bincount(out.topk_ids.reshape(-1), minlength=16).double() / (30 * 4)
    expected = 0.5 * 16 * (f * density.mean(0)).sum()
    torch.testing.assert_close(out.aux_loss.double(), expected, rtol=1e-6, atol=0)


def test_z_loss_and_combined_aux():
    logits = _logits(12, 8, seed=12)
    lse = [math.log(sum(math.exp(v) for v in row)) for row in logits.double().tolist()]
    expected = sum(v * v for v in lse) / 12
    torch.testing.assert_close(router_z_loss(logits).double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=0)
    cfg = RouterConfig(8, 2, aux_loss_coef=0.01, z_loss_coef=0.001)
    out = route(logits, cfg)
    lb = load_balancing_loss(torch.softmax(logits, -1), out.expert_counts, 2)
    torch.testing.assert_close(out.aux_loss, 0.01 * lb + 0.001 * router_z_loss(logits))


def test_aux_loss_off_by_default_and_gradient_reaches_router_weight():
    r = _router(24, RouterConfig(8, 2, aux_loss_coef=0.01, z_loss_coef=1e-3))
    out = r(torch.randn(10, 24))
    out.aux_loss.backward()
    assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
    assert route(_logits(4, 8), RouterConfig(8, 2)).aux_loss is None


# --- monitoring and aux-loss-free balancing ----------------------------------------------------------
def test_expert_counts_and_bias_update():
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    counts = expert_counts(ids, 5)
    assert counts.tolist() == [4, 2, 1, 1, 0] and counts.dtype == torch.int32
    assert torch.equal(expert_counts(ids, 5, ids_in_range=True), counts)
    assert expert_counts(torch.tensor([[0, 5], [-1, 4]]), 5).tolist() == [1, 0, 0, 0, 1]  # out of range: not counted
    skewed = torch.randint(0, 3, (1000, 4), generator=torch.Generator().manual_seed(0))
    assert torch.equal(expert_counts(skewed, 64, ids_in_range=True), expert_counts(skewed, 64))
    bias = torch.zeros(5)
    update_correction_bias_(bias, counts, 0.1)  # mean load 1.6
    torch.testing.assert_close(bias, torch.tensor([-0.1, -0.1, 0.1, 0.1, 0.1]))


def test_router_accumulates_load_and_updates_bias():
    cfg = RouterConfig.deepseek_v3(num_experts=16, top_k=2, n_group=4, topk_group=2, bias_update_rate=0.01)
    r = _router(32, cfg)
    x = torch.randn(20, 32)
    c1 = r(x).expert_counts
    c2 = r(x).expert_counts
    assert torch.equal(r.load_since_update, (c1 + c2).long())
    r.eval()
    r(x)
    assert torch.equal(r.load_since_update, (c1 + c2).long())  # eval forwards do not count
    load = r.load_since_update.clone().float()
    r.update_bias()
    torch.testing.assert_close(r.e_score_correction_bias, 0.01 * torch.sign(load.mean() - load))
    assert r.load_since_update.sum() == 0
    with pytest.raises(RuntimeError, match="no correction bias"):
        _router(8, RouterConfig(4, 2)).update_bias()


# --- NaN, edge sizes, bad input -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "cfg",
    [RouterConfig(8, 2, renormalize=True), RouterConfig.llama4(8), RouterConfig.deepseek_v3(8, 2, 4, 2)],
    ids=["softmax", "llama4", "deepseek_v3"],
)
def test_nan_logits_are_never_selected_and_all_nan_rows_weigh_zero(cfg):
    logits = _logits(6, 8, seed=21)
    logits[0, :3] = float("nan")
    logits[2, 5] = float("nan")
    logits[4, :] = float("nan")
    bias = torch.zeros(8) if cfg.use_correction_bias else None
    out = route(logits, cfg, bias)
    w = out.topk_weights if out.topk_weights is not None else out.input_scales
    assert int(out.nan_count) == 3 + 1 + 8
    assert not torch.isnan(w).any()
    for t in (0, 2):
        chosen = out.topk_ids[t].tolist()
        assert not any(torch.isnan(logits[t, e]) for e in chosen)
    assert torch.equal(w[4], torch.zeros_like(w[4]))
    ids4 = out.topk_ids[4]
    assert ids4.min() >= 0 and ids4.max() < 8 and ids4.unique().numel() == cfg.top_k
    clean = route(logits[[1, 3, 5]], cfg, bias)  # rows without NaN: unaffected by the others
    assert torch.equal(clean.topk_ids, out.topk_ids[[1, 3, 5]])


@pytest.mark.parametrize("cfg", [RouterConfig(8, 2, renormalize=True), RouterConfig(8, 2)], ids=["renorm", "raw"])
def test_inf_logit_takes_the_softmax_weight(cfg):
    """Softmax: a +inf logit wins its token with weight 1, two +inf share it; other tokens unaffected."""
    logits = _logits(4, 8, seed=22)
    logits[0, 3] = float("inf")
    logits[1, 2] = logits[1, 6] = float("inf")
    out = route(logits, cfg)
    w = out.topk_weights
    assert int(out.topk_ids[0, 0]) == 3 and float(w[0, 0]) == 1.0 and float(w[0, 1]) == 0.0
    assert set(out.topk_ids[1].tolist()) == {2, 6} and w[1].tolist() == [0.5, 0.5]
    clean = route(logits[[2, 3]], cfg)
    assert torch.equal(clean.topk_ids, out.topk_ids[[2, 3]]) and torch.equal(clean.topk_weights, w[[2, 3]])


@pytest.mark.parametrize("cfg", [RouterConfig.llama4(8), RouterConfig.deepseek_v3(8, 2, 4, 2)], ids=["llama4", "dsv3"])
def test_inf_logit_under_sigmoid_is_a_huge_logit(cfg):
    logits = _logits(4, 8, seed=23)
    logits[0, 3] = logits[1, 2] = logits[1, 6] = float("inf")
    bias = torch.zeros(8) if cfg.use_correction_bias else None
    out, huge = route(logits, cfg, bias), route(logits.nan_to_num(posinf=1e4), cfg, bias)
    assert torch.equal(out.topk_ids, huge.topk_ids)
    for a, b in ((out.topk_weights, huge.topk_weights), (out.input_scales, huge.input_scales)):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("T", [0, 1])
def test_zero_and_one_token(T):
    for cfg in (RouterConfig.qwen3_moe(16, 4, aux_loss_coef=0.1, z_loss_coef=0.1), RouterConfig.deepseek_v3(32, 4, 4, 2)):
        r = _router(8, cfg)
        out = r(torch.randn(T, 8))
        assert out.topk_ids.shape == (T, cfg.top_k) and out.expert_counts.sum() == T * cfg.top_k
        if out.aux_loss is not None:
            assert torch.isfinite(out.aux_loss)
            if T == 0:
                assert out.aux_loss == 0


def test_bad_config():
    with pytest.raises(ValueError, match="top_k"):
        RouterConfig(4, 5)
    with pytest.raises(ValueError, match="top_k"):
        RouterConfig(4, 0)
    with pytest.raises(ValueError, match="n_group"):
        RouterConfig(10, 2, "sigmoid", n_group=4)
    with pytest.raises(ValueError, match="topk_group"):
        RouterConfig(16, 8, "sigmoid", n_group=8, topk_group=3)
    with pytest.raises(ValueError, match="scoring"):
        RouterConfig(4, 2, "relu")
    with pytest.raises(ValueError, match="use_correction_bias"):
        RouterConfig(4, 2, "softmax", use_correction_bias=True)
    with pytest.raises(ValueError, match="n_group"):
        RouterConfig(8, 2, "softmax", n_group=2)


def test_bad_input():
    cfg = RouterConfig(8, 2)
    with pytest.raises(ValueError, match="logits"):
        route(torch.randn(4, 7), cfg)
    with pytest.raises(ValueError, match="logits"):
        route(torch.randn(8), cfg)
    with pytest.raises(TypeError, match="logits"):
        route(torch.zeros(4, 8, dtype=torch.int32), cfg)
    with pytest.raises(ValueError, match="correction_bias"):
        route(torch.randn(4, 8), RouterConfig.deepseek_v3(8, 2, 2, 1))
    with pytest.raises(ValueError, match="correction_bias"):
        route(torch.randn(4, 8), cfg, torch.zeros(8))
    with pytest.raises(ValueError, match="x: expected last dim 16"):
        _router(16, cfg)(torch.randn(3, 15))
    with pytest.raises(TypeError, match="config"):
        Router(16, {"num_experts": 8})


def test_router_flattens_leading_dims():
    r = _router(12, RouterConfig(6, 2))
    x = torch.randn(2, 5, 12)
    assert torch.equal(r(x).topk_ids, r(x.reshape(10, 12)).topk_ids)
