"""FP8MoE / FP8GroupedExperts against an fp64 reference MoE and a plain PyTorch BF16 MoE."""

import pytest
import torch
from torch import nn

from moe_fp8 import FP8GroupedExperts, FP8MoE
from moe_fp8.routing import RouterConfig, padded_num_rows
from moe_fp8.testing import reference_moe_forward, sqnr
from test_backends import fake_cuda  # noqa: F401  (fixture: the cuda backend faked on the CPU)

T, H, I, E, K = 40, 64, 32, 4, 2

# Output SQNR floor of the FP8 MoE against fp64. One e4m3 rowwise GEMM is ~28.5 dB off exact math
# (both operands quantized); the SwiGLU multiplies two such outputs (~25.5 dB) and the down GEMM
# quantizes again, so two chained layers land near 24 dB whatever the sizes (measured 24.1-24.4 dB
# at H in {64, 256}, T in {40, 256}; TorchAO's MoE test floor is 23 dB). The bf16 recipe gives ~47 dB.
# No rowwise-e4m3 implementation can do better than the *ideal* one (operands quantized, all else
# exact): test_rowwise_output_at_the_ideal_fp8_bound measures that bound (~23.8 dB) and holds the
# module to it; a 25 dB bar is held against that fp64 reference of the recipe instead
# (test_rowwise_output_against_the_fp64_reference_of_the_recipe, at 33 dB).
OUT_SQNR = 23.0

def _moe(recipe="rowwise", seed=0, **kw):
    torch.manual_seed(seed)
    return FP8MoE(H, I, E, K, recipe=recipe, **kw).to(torch.bfloat16)


def _plain_bf16_moe(moe: FP8MoE, x: torch.Tensor) -> torch.Tensor:
    """The same block written with plain PyTorch ops (index_select / matmul / index_add)."""
    r = moe.router(x)
    w1, w2 = moe.experts.gate_up_proj, moe.experts.down_proj
    out = torch.zeros_like(x, dtype=torch.float32)
    for e in range(E):
        tok, slot = torch.nonzero(r.topk_ids == e, as_tuple=True)
        gate, up = (x[tok] @ w1[e].T).chunk(2, dim=-1)
        y = (nn.functional.silu(gate) * up) @ w2[e].T
        out.index_add_(0, tok, y.float() * r.topk_weights[tok, slot, None])
    return out.to(x.dtype)


def _grads(moe: FP8MoE, x: torch.Tensor, dy: torch.Tensor):
    moe.zero_grad()
    x = x.detach().clone().requires_grad_()
    out = moe(x)
    out.backward(dy)
    return out, x.grad, {n: p.grad for n, p in moe.named_parameters()}


_SWIGLU = ("gate_proj", "up_proj", "down_proj")


def _swiglu64(x64: torch.Tensor, mlp: nn.Module | dict, prefix: str = "") -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` in fp64 from a SwiGLU MLP's weights (a module, or a dict of
    fp64 parameters keyed ``{prefix}{gate,up,down}_proj.weight``), never through its FP8 linears."""
    if isinstance(mlp, nn.Module):
        mlp = {f"{prefix}{n}.weight": getattr(mlp, n).weight.detach().double() for n in _SWIGLU}
    gate, up, down = (mlp[f"{prefix}{n}.weight"] for n in _SWIGLU)
    return (nn.functional.silu(x64 @ gate.T) * (x64 @ up.T)) @ down.T


def _reference(moe: FP8MoE, x: torch.Tensor, dy: torch.Tensor, *, router_grad: bool = True):
    """fp64 forward and gradients of ``x`` and of every parameter, with the module's routing ids.

    The routing weights are differentiable fp64 functions of the fp64 router logits over the
    top-k ids: softmax, renormalised (the default router), combining the expert outputs; or, for
    Llama 4 (``weights_on_input``), sigmoid scaling the expert INPUTS (unit combine weights).
    ``router_grad=False`` takes the module's weights as constants instead. Shared experts (if
    any) in fp64 too. Returns ``(out (T, H), grad of x (T, H), {parameter name: gradient})``, all fp64.
    """
    cfg = moe.router.config
    on_input = cfg.weights_on_input
    if on_input:
        assert (cfg.scoring, cfg.grouped, cfg.use_correction_bias) == ("sigmoid", False, False)
    else:
        assert (cfg.scoring, cfg.renormalize, cfg.use_correction_bias) == ("softmax", True, False)
    r = moe.router(x)
    params = {n: p.detach().double().requires_grad_() for n, p in moe.named_parameters()}
    x64 = x.detach().double().requires_grad_()
    if router_grad:
        logits = x64 @ params["router.weight"].T
        if on_input:
            weights = torch.sigmoid(logits.gather(1, r.topk_ids))
        else:
            probs = torch.softmax(logits, dim=-1).gather(1, r.topk_ids)
            weights = probs / probs.sum(-1, keepdim=True)
    else:
        weights = (r.input_scales if on_input else r.topk_weights).detach().double()
    w1, w2 = params["experts.gate_up_proj"], params["experts.down_proj"]
    out = torch.zeros_like(x64)
    for e in range(E):
        tok, slot = torch.nonzero(r.topk_ids == e, as_tuple=True)
        w = weights[tok, slot, None]
        gate, up = ((x64[tok] * w if on_input else x64[tok]) @ w1[e].T).chunk(2, dim=-1)
        y = (nn.functional.silu(gate) * up) @ w2[e].T
        out = out.index_add(0, tok, y if on_input else y * w)
    if moe.shared_experts is not None:
        out = out + _swiglu64(x64, params, "shared_experts.")
    out.backward(dy.double())
    return out, x64.grad, {n: p.grad for n, p in params.items()}


@pytest.mark.interpreter
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp", "tensorwise", "blockwise"])
def test_fp8_moe_vs_fp64(recipe):
    """Output, input gradient and EVERY parameter's gradient (router, routed and shared experts)
    against fp64 (differentiable routing weights). Measured >= 22.4 dB on every gradient over seeds
    0-2 (lowest: the router's, whose gradient takes differences of two experts' FP8 outputs)."""
    moe = _moe(recipe, shared_expert_hidden_size=I)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    dy = torch.randn(T, H, generator=g).to(torch.bfloat16)
    out, gx, grads = _grads(moe, x, dy)
    ref, ref_gx, ref_grads = _reference(moe, x, dy)
    assert out.dtype == torch.bfloat16 and out.shape == (T, H)
    # One scale per tensor loses ~2 dB more than row scales on Gaussian activations.
    assert sqnr(ref, out) >= (OUT_SQNR - 3 if recipe == "tensorwise" else OUT_SQNR)
    assert sqnr(ref_gx, gx) >= 20
    assert set(grads) == set(ref_grads) and {"router.weight", "shared_experts.down_proj.weight"} <= set(grads)
    for name, grad in grads.items():
        assert sqnr(ref_grads[name], grad) >= 20, name


def _ideal_rowwise_fp8(moe: FP8MoE, x: torch.Tensor) -> torch.Tensor:
    """The module's forward with the rowwise e4m3 quantizations of its four GEMM operands (x, h by
    row; both weights by output channel) and everything else in fp64: the best any implementation of
    the recipe can do (no accumulation-order or bf16 rounding error)."""
    from moe_fp8.quant import reference as ref

    pow2 = moe.experts.recipe.pow2_scales

    def dq(t):
        q, scale = ref.quantize_rowwise(t.float().reshape(-1, t.shape[-1]), "e4m3fn", pow2=pow2)
        return (q.double() * scale.double()[:, None]).reshape(t.shape)

    r = moe.router(x)
    x64, w1, w2 = dq(x), dq(moe.experts.gate_up_proj.detach()), dq(moe.experts.down_proj.detach())
    out = torch.zeros_like(x64)
    for e in range(E):
        tok, slot = torch.nonzero(r.topk_ids == e, as_tuple=True)
        gate, up = (x64[tok] @ w1[e].T).chunk(2, dim=-1)
        y = dq(nn.functional.silu(gate) * up) @ w2[e].T
        out = out.index_add(0, tok, y * r.topk_weights[tok, slot, None].detach().double())
    return out


@pytest.mark.interpreter
def test_rowwise_output_at_the_ideal_fp8_bound():
    """Ours loses nothing beyond the format itself; and the format caps a SwiGLU MoE near 24 dB,
    below a 25 dB bar (measured here, see OUT_SQNR)."""
    moe = _moe("rowwise", seed=4)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    exact = _reference(moe, x, torch.zeros_like(x))[0]
    bound = sqnr(exact, _ideal_rowwise_fp8(moe, x))
    assert 22.5 < bound < 25.0
    assert sqnr(exact, moe(x)) >= bound - 0.5


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["emulated", "triton"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rowwise_output_against_the_fp64_reference_of_the_recipe(backend, seed):
    """A 25 dB output bar, held against the fp64 reference MoE of the recipe (its four
    GEMM operands quantized as ``rowwise`` quantizes them, everything else in fp64): what is left is
    our bf16 intermediates and accumulation order. Measured 36.1-38.8 dB (seeds 0-3, both backends);
    held at 33 dB. Against exact math the format itself caps the output near 24 dB (the test above)."""
    moe = _moe("rowwise", seed=seed, backend=backend)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 10)).to(torch.bfloat16)
    assert sqnr(_ideal_rowwise_fp8(moe, x), moe(x)) >= 33


@pytest.mark.interpreter
def test_input_gradient_through_experts():
    moe = _moe("rowwise")
    moe.router.weight.requires_grad_(False)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    dy = torch.randn(T, H, generator=g).to(torch.bfloat16)
    x_req = x.clone().requires_grad_()
    r = moe.router(x_req)
    out = moe.experts(x_req, r.topk_ids, r.topk_weights.detach())
    out.backward(dy)
    _, ref_gx, _ = _reference(moe, x, dy, router_grad=False)
    assert sqnr(ref_gx, x_req.grad) >= 20


def test_bf16_recipe_equals_plain_pytorch_moe():
    moe = _moe("bf16")
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = moe(x)
    plain = _plain_bf16_moe(moe, x)
    # Same bf16 matmuls; the combine sums the k slots in fp32 in slot order, index_add in fp32 too.
    assert (out.float() - plain.float()).abs().max() <= plain.float().abs().max() * 2**-7
    assert sqnr(reference_moe_forward(x, *moe.router(x)[:2], moe.experts.gate_up_proj, moe.experts.down_proj), out) > 40


@pytest.mark.interpreter
def test_shared_expert_llama4_and_deepseek_routing():
    """The routed part alone (the module's experts on its routing) and the whole block, each against
    fp64; the shared expert of the reference is fp64 from its weights, not the module's FP8 one
    (which would compare the shared path with itself)."""
    for cfg in (RouterConfig.llama4(num_experts=E, top_k=1), RouterConfig.deepseek_v3(E, K, n_group=2, topk_group=1)):
        torch.manual_seed(4)
        moe = FP8MoE(H, I, E, cfg.top_k, router_config=cfg, shared_expert_hidden_size=I,
                     return_router_output=True).to(torch.bfloat16)
        x = torch.randn(3, 5, H).to(torch.bfloat16)
        out, r = moe(x)
        assert out.shape == (3, 5, H) and r.topk_ids.shape == (15, cfg.top_k)
        tokens = x.reshape(-1, H)
        if cfg.weights_on_input:
            ids = r.topk_ids
            routed = torch.zeros(15, H, dtype=torch.float64)
            for t in range(15):
                e = int(ids[t, 0])
                xin = (tokens[t] * r.input_scales[t, 0].to(torch.bfloat16)).double()
                gate, up = (moe.experts.gate_up_proj[e].double() @ xin).chunk(2)
                routed[t] = moe.experts.down_proj[e].double() @ (nn.functional.silu(gate) * up)
        else:
            routed = reference_moe_forward(tokens, r.topk_ids, r.topk_weights, moe.experts.gate_up_proj,
                                           moe.experts.down_proj)
        routed_fp8 = moe.experts(tokens, r.topk_ids, r.topk_weights, input_scales=r.input_scales)
        assert sqnr(routed, routed_fp8) >= OUT_SQNR, cfg
        ref = routed + _swiglu64(tokens.double(), moe.shared_experts)
        assert sqnr(ref, out.reshape(-1, H)) >= OUT_SQNR, cfg


@pytest.mark.interpreter
def test_weight_cache_hits_and_invalidates():
    moe = _moe("rowwise", cache_weights=True)
    x = torch.randn(T, H).to(torch.bfloat16)
    cache_up, _ = moe.experts._caches
    assert moe.experts.weight_cache_nbytes == 0
    moe(x)
    assert moe.experts.weight_cache_nbytes == 0  # one forward of these weights: nothing to read again
    moe(x)
    weights = moe.experts.gate_up_proj.numel() + moe.experts.down_proj.numel()  # fp8 twice, + fp32 scales
    assert moe.experts.weight_cache_nbytes == 2 * weights + 4 * E * (2 * I + H + H + I)
    first = moe(x)
    assert cache_up.hits == 1
    with torch.no_grad():
        moe.experts.gate_up_proj.mul_(2.0)  # an optimizer-style in-place update
    second = moe(x)
    assert not torch.equal(first, second)
    fresh = FP8MoE(H, I, E, K, cache_weights=False).to(torch.bfloat16)
    fresh.load_state_dict(moe.state_dict())
    assert torch.equal(fresh(x), second)


@pytest.mark.interpreter
@pytest.mark.parametrize("autocast", [True, False])
def test_weight_cache_hits_for_fp32_parameters(autocast):
    """fp32 parameters cast for the GEMMs (bf16 under autocast; the down GEMM's bf16 input without)
    hit the cache keyed on the parameter; an in-place update misses and uses the new values."""
    torch.manual_seed(6)
    moe = FP8MoE(H, I, E, K, cache_weights=True)  # fp32 parameters
    fresh = FP8MoE(H, I, E, K, cache_weights=False)
    x = torch.randn(16, H)
    dy = torch.randn(16, H)

    def run(m):
        m.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = m(x)
        out.backward(dy.to(out.dtype))
        return out, {n: p.grad for n, p in m.named_parameters()}

    caches = moe.experts._caches
    for _ in range(3):  # the first keeps nothing, the second keeps, the third hits
        out, grads = run(moe)
    assert all(c.hits == 1 and c.misses == 2 for c in caches), caches
    with torch.no_grad():
        moe.experts.gate_up_proj.add_(0.01)
        moe.experts.down_proj.mul_(-1)
    fresh.load_state_dict(moe.state_dict())
    out, grads = run(moe)  # the previous weights served three forwards: kept from the first
    assert all(c.misses == 3 and len(c) == 1 and c.nbytes for c in caches), caches
    want, want_grads = run(fresh)
    assert torch.equal(out, want)
    for name, g in grads.items():
        assert g.dtype == torch.float32 and torch.equal(g, want_grads[name]), name


@pytest.mark.interpreter
def test_capture_bypasses_the_weight_cache_of_fp32_parameters(monkeypatch):
    """During a CUDA graph capture (faked: the check of ``Fp8WeightCache.bypassed``) the module uses
    no cache and makes no stand-in: the cache is untouched and the step equals an uncached one."""
    from moe_fp8 import Fp8WeightCache

    torch.manual_seed(7)
    moe = FP8MoE(H, I, E, K, cache_weights=True)  # fp32 parameters, cast under autocast
    fresh = FP8MoE(H, I, E, K, cache_weights=False)
    fresh.load_state_dict(moe.state_dict())
    x, dy = torch.randn(16, H), torch.randn(16, H)
    stand_ins = []
    monkeypatch.setattr(Fp8WeightCache, "stand_in", lambda self, w, dtype: stand_ins.append(w))
    monkeypatch.setattr(Fp8WeightCache, "bypassed", staticmethod(lambda t: True))
    results = []
    for m in (moe, fresh):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        out.backward(dy.to(out.dtype))
        results.append((out, {n: p.grad for n, p in m.named_parameters()}))
    assert not stand_ins and all((c.hits, c.misses, len(c)) == (0, 0, 0) for c in moe.experts._caches)
    assert torch.equal(results[0][0], results[1][0])
    for name, g in results[0][1].items():
        assert torch.equal(g, results[1][1][name]), name


@pytest.mark.interpreter
def test_fp32_module_on_bf16_only_backend(fake_cuda, monkeypatch):
    """fp32 parameters and input, no autocast, on the ``cuda`` backend (faked on the CPU: takes
    bf16 only): the grouped GEMMs get bf16, the module returns fp32, the cache still hits."""
    import moe_fp8.grouped_gemm.with_neighbors as with_neighbors
    from moe_fp8.grouped_gemm.op import grouped_mm_arguments

    seen = []

    def recording(x, w, offs, **kw):  # every grouped GEMM's arguments, fused with its neighbours or not
        seen.append((x.dtype, w.dtype))
        return grouped_mm_arguments(x, w, offs, **kw)

    monkeypatch.setattr(with_neighbors, "grouped_mm_arguments", recording)
    monkeypatch.setattr("moe_fp8.grouped_gemm.op.grouped_mm_arguments", recording)
    torch.manual_seed(7)
    moe = FP8MoE(H, I, E, K, backend="cuda", cache_weights=True)  # fp32 parameters
    x, dy = torch.randn(T, H), torch.randn(T, H)
    for _ in range(3):
        out, gx, grads = _grads(moe, x, dy)
    assert out.dtype == gx.dtype == torch.float32
    assert seen == [(torch.bfloat16, torch.bfloat16)] * 6
    assert len(fake_cuda) == 18  # forward, dgrad, wgrad of both GEMMs, three times
    assert all(c.hits == 1 for c in moe.experts._caches)  # the second step keeps, the third hits
    ref, _, ref_grads = _reference(moe, x, dy)
    assert sqnr(ref, out) >= OUT_SQNR
    for name, grad in grads.items():
        assert grad.dtype == torch.float32 and sqnr(ref_grads[name], grad) >= 20, name


def test_state_dict_names_and_bad_input():
    moe = _moe()
    keys = set(moe.state_dict())
    assert {"router.weight", "experts.gate_up_proj", "experts.down_proj"} <= keys
    with pytest.raises(ValueError, match="hidden_size: expected a multiple of 16"):
        FP8MoE(60, I, E, K)
    with pytest.raises(ValueError, match="expert_hidden_size: expected a multiple of 16"):
        FP8MoE(H, 20, E, K)
    with pytest.raises(ValueError, match="router_config: expected num_experts=4"):
        FP8MoE(H, I, E, K, router_config=RouterConfig(8, 2))
    with pytest.raises(ValueError, match="x: expected last dim 64"):
        moe(torch.randn(3, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="return_router_output: must be True"):  # the loss would be dropped
        FP8MoE(H, I, E, K, router_config=RouterConfig(E, K, aux_loss_coef=0.01))
    moe = FP8MoE(H, I, E, K, router_config=RouterConfig(E, K, z_loss_coef=1e-3), return_router_output=True)
    out, r = moe(torch.randn(3, H))
    assert out.shape == (3, H) and r.aux_loss is not None and r.aux_loss.ndim == 0


def test_given_routed_experts():
    torch.manual_seed(0)
    built = FP8MoE(H, I, E, K, backend="emulated").to(torch.bfloat16)
    experts = FP8GroupedExperts(E, H, I, backend="emulated").to(torch.bfloat16)
    experts.load_state_dict(built.experts.state_dict())
    given = FP8MoE(H, I, E, K, experts=experts).to(torch.bfloat16)
    given.router.load_state_dict(built.router.state_dict())
    assert given.experts is experts and given.recipe == experts.recipe
    x = torch.randn(T, H).to(torch.bfloat16)
    assert torch.equal(given(x), built(x))
    with pytest.raises(TypeError, match="experts: expected an nn.Module or None"):
        FP8MoE(H, I, E, K, experts=built.experts.gate_up_proj)
    for bad, what in (
        (FP8GroupedExperts(E + 1, H, I), "global_num_experts"),
        (FP8GroupedExperts(E, H + 16, I), "hidden_size"),
        (FP8GroupedExperts(E, H, I + 16), "expert_hidden_size"),
        (FP8GroupedExperts(E, H, I, recipe="bf16"), "recipe"),
    ):
        with pytest.raises(ValueError, match=f"experts: its {what} is"):
            FP8MoE(H, I, E, K, experts=bad)


def test_meta_parameters_and_device_mismatch():
    meta = FP8MoE(H, I, E, K, device="meta")
    for x in (torch.randn(T, H), torch.randn(T, H, device="meta")):
        with pytest.raises(ValueError, match=r"router.weight: the weights are on the meta device .*to_empty"):
            meta(x)
    ids = torch.zeros(T, K, dtype=torch.long)
    with pytest.raises(ValueError, match=r"gate_up_proj: the weights are on the meta device"):
        meta.experts(torch.randn(T, H), ids, None)
    with pytest.raises(ValueError, match=r"x: expected device cpu \(that of parameter router.weight\), got meta"):
        _moe()(torch.randn(T, H, device="meta", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"hidden_states: expected device cpu .*gate_up_proj.*got meta"):
        _moe().experts(torch.randn(T, H, device="meta", dtype=torch.bfloat16), ids, None)


@pytest.mark.interpreter
def test_empty_and_one_expert_routing():
    experts = FP8GroupedExperts(E, H, I).to(torch.bfloat16)
    x = torch.randn(9, H).to(torch.bfloat16)
    ids = torch.full((9, 2), 3)
    ids[:, 1] = 1
    w = torch.rand(9, 2)
    out = experts(x, ids, w)
    ref = reference_moe_forward(x, ids, w, experts.gate_up_proj, experts.down_proj)
    # 9 tokens average little of the FP8 rounding: 21.9-26 dB over 60 seeds (a wrong route: ~0 dB)
    assert sqnr(ref, out) >= 20
    assert experts(x[:0], ids[:0], w[:0]).shape == (0, H)


@pytest.mark.interpreter
def test_empty_experts_backward_vs_fp64():
    """Experts 1 and 3 (one between used experts, one last) get no token: a large first input
    feature and router rows of opposite signs on it send every token to experts 0 and 2. Output,
    x's and every parameter's gradient against fp64; the empty experts' weight gradients are 0."""
    moe, x, dy = _empty_experts_case("rowwise")
    assert moe.router(x).expert_counts.tolist() == [24, 0, 24, 0]
    out, gx, grads = _grads(moe, x, dy)
    ref, ref_gx, ref_grads = _reference(moe, x, dy)
    assert sqnr(ref, out) >= OUT_SQNR
    assert sqnr(ref_gx, gx) >= 20
    for name, grad in grads.items():
        assert sqnr(ref_grads[name], grad) >= 20, name
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        assert not grads[name][[1, 3]].any(), name


def _empty_experts_case(recipe: str, **kw):
    """A layer whose experts 1 and 3 (one between used experts, one last) get no token, its input
    and output gradient (see ``test_empty_experts_backward_vs_fp64``)."""
    moe = _moe(recipe, seed=8, **kw)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(24, H, generator=g)
    x[:, 0] = 4.0
    with torch.no_grad():
        moe.router.weight[:, 0] = torch.tensor([1.0, -1.0, 1.0, -1.0])
    return moe, x.to(torch.bfloat16), torch.randn(24, H, generator=g).to(torch.bfloat16)


@pytest.mark.interpreter
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp", "bf16"])
def test_empty_experts_reach_the_weight_gradient_gemm_with_a_zero_row(recipe, monkeypatch):
    """The layer's plan keeps a zero row for each expert without tokens in the weight gradient's
    groups: every wgrad GEMM gets groups of at least one row (so a library GEMM computes the empty
    experts' zero gradients, and the zeroing after it finds nothing to write), those gradients are
    exactly zero, and everything equals the layout without those rows bit for bit."""
    import moe_fp8.grouped_gemm.library as lib
    import moe_fp8.layers.experts as experts_module

    moe, x, dy = _empty_experts_case(recipe)
    assert moe.router(x).expert_counts.tolist() == [24, 0, 24, 0]
    seen = []

    def spy(op, offs_at):
        def call(*args):
            seen.append(args[offs_at])
            return op(*args)
        return call

    monkeypatch.setattr(lib, "mm_2d2d", spy(lib.mm_2d2d, 5))
    monkeypatch.setattr(lib, "bf16_mm_2d2d", spy(lib.bf16_mm_2d2d, 3))
    out, gx, grads = _grads(moe, x, dy)
    assert len(seen) == 2  # the two expert weights' gradients
    for offs in seen:
        assert (torch.diff(offs, prepend=offs.new_zeros(1)) > 0).all(), offs
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        assert not grads[name][[1, 3]].any() and grads[name][[0, 2]].abs().sum() > 0, name
    plan = experts_module.make_dispatch_plan
    monkeypatch.setattr(experts_module, "make_dispatch_plan", lambda ids, e, **kw: plan(ids, e))
    seen.clear()
    want_out, want_gx, want_grads = _grads(moe, x, dy)
    assert [torch.diff(o, prepend=o.new_zeros(1)).tolist() for o in seen] == [[24, 0, 24, 0]] * 2
    assert torch.equal(out, want_out) and torch.equal(gx, want_gx)
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name


@pytest.mark.interpreter
def test_empty_experts_reach_the_cuda_weight_gradient_with_rows(fake_cuda):
    """On the ``cuda`` backend (faked on the CPU: ``torch._scaled_grouped_mm`` checked against its
    contract) the FP8 weight gradients' GEMMs get a padded group of 16 rows for each expert without
    tokens (its zero row), never an empty group; those experts' gradients are exactly zero."""
    moe, x, dy = _empty_experts_case("rowwise", backend="cuda")
    assert moe.router(x).expert_counts.tolist() == [24, 0, 24, 0]
    _, _, grads = _grads(moe, x, dy)
    wgrads = [c for c in fake_cuda if c.b.dim() == 2]
    assert len(wgrads) == 2
    for call in wgrads:
        sizes = torch.diff(call.offs, prepend=call.offs.new_zeros(1))
        assert (sizes[[1, 3]] == 16).all() and (sizes >= 16).all(), sizes
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        assert not grads[name][[1, 3]].any() and grads[name][[0, 2]].abs().sum() > 0, name


@pytest.mark.interpreter
@pytest.mark.parametrize("top_k", [1, 2])
def test_llama4_input_scales_backward_vs_fp64(top_k):
    """Llama 4 routing (sigmoid of the top-k logits scales the expert INPUT, unit combine weights)
    with a shared expert: output, x's and every parameter's gradient (the router's through the
    input scales) against fp64."""
    cfg = RouterConfig.llama4(num_experts=E, top_k=top_k)
    torch.manual_seed(10)
    moe = FP8MoE(H, I, E, top_k, router_config=cfg, shared_expert_hidden_size=I).to(torch.bfloat16)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    dy = torch.randn(T, H, generator=g).to(torch.bfloat16)
    out, gx, grads = _grads(moe, x, dy)
    ref, ref_gx, ref_grads = _reference(moe, x, dy)
    assert sqnr(ref, out) >= OUT_SQNR
    assert sqnr(ref_gx, gx) >= 20
    assert set(grads) == set(ref_grads) and grads["router.weight"].abs().max() > 0
    for name, grad in grads.items():
        assert sqnr(ref_grads[name], grad) >= 20, name


def _gpu_pair(H=2048, I=768, E=32, k=8, T=4096, **kw):
    mods = {}
    for recipe in ("bf16", "rowwise"):
        torch.manual_seed(0)
        mods[recipe] = FP8MoE(H, I, E, k, recipe=recipe, device="cuda", dtype=torch.bfloat16, **kw)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    dy = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    return mods, x, dy


@pytest.mark.gpu
def test_fp8_moe_gpu_vs_bf16_recipe_no_sync():
    """No host sync in forward + backward; FP8 against the bf16 recipe (output and gradients), and
    both outputs against an fp64 reference on the module's routing (the two recipes share the
    router, permute and combine kernels, so comparing them alone could cancel a bug there)."""
    mods, x, dy = _gpu_pair()
    results = {}
    for recipe, moe in mods.items():
        xr = x.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = moe(xr)
            out.backward(dy)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results[recipe] = (out, xr.grad, moe.experts.gate_up_proj.grad, moe.experts.down_proj.grad)
    ref, fp8 = results["bf16"], results["rowwise"]
    assert sqnr(ref[0], fp8[0]) >= OUT_SQNR
    for r, f in zip(ref[1:], fp8[1:]):
        assert sqnr(r, f) >= 20
    moe = mods["rowwise"]  # both modules hold the same weights (same seed)
    with torch.no_grad():
        r = moe.router(x)
        exact = reference_moe_forward(x, r.topk_ids, r.topk_weights, moe.experts.gate_up_proj, moe.experts.down_proj)
    assert sqnr(exact, fp8[0]) >= OUT_SQNR
    assert sqnr(exact, ref[0]) >= 40  # the bf16 recipe: ~47 dB


@pytest.mark.gpu
@pytest.mark.parametrize("H, I, E, k", [(4096, 1024, 16, 4), (2048, 768, 128, 8)])
def test_fp8_moe_gpu_peak_memory_above_bf16_by_the_fp8_operands_only(H, I, E, k):
    """Eager forward + backward without the weight cache, 8192 tokens: the FP8 peak exceeds the
    bf16 recipe's by no more than the FP8 operands live at the first GEMM's weight gradient, its
    column-major copies of x and grad_h and grad_h's FP8 rows (``M * (H + 4*I)`` bytes), with 5%
    for scales, amaxes and group padding. With 2049 rows per expert the rowwise backward reduces the
    gradients' group amaxes itself; with about 512 the dgrads take the gradients' FP8 rows from the
    SwiGLU and combine backwards, whose nodes free ``h``, ``y`` and their incoming gradients first."""
    T = 8192
    mods, x, dy = _gpu_pair(H=H, I=I, E=E, k=k, T=T, cache_weights=False)
    peaks = {}
    for recipe, moe in mods.items():
        xr = x.clone().requires_grad_()
        moe(xr).backward(dy)  # warm-up: kernels compiled, allocator settled
        moe.zero_grad(set_to_none=True)
        xr.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        moe(xr).backward(dy)
        torch.cuda.synchronize()
        peaks[recipe] = torch.cuda.max_memory_allocated() - base
        moe.zero_grad(set_to_none=True)
    rows = padded_num_rows(T * k, E, 1, empty_group_rows=True)
    assert peaks["rowwise"] - peaks["bf16"] <= 1.05 * rows * (H + 4 * I), peaks


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [True, False])
def test_fp8_moe_gpu_fp32_parameters(autocast):
    """fp32 parameters on the default backend (``cuda``: bf16 GEMMs), under autocast and without:
    the weight cache hits from the second step and gives what an uncached module gives."""
    mods = []
    for cache_weights in (True, False):
        torch.manual_seed(0)
        mods.append(FP8MoE(2048, 768, 32, 8, device="cuda", cache_weights=cache_weights))
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1024, 2048, device="cuda", generator=g)
    dy = torch.randn(1024, 2048, device="cuda", generator=g)

    def step(m):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = m(x)
        out.backward(dy.to(out.dtype))
        return out, {n: p.grad for n, p in m.named_parameters()}

    for _ in range(3):
        out, grads = step(mods[0])
    assert all(c.hits == 1 and c.misses == 2 for c in mods[0].experts._caches)
    want, want_grads = step(mods[1])
    assert out.dtype == (torch.bfloat16 if autocast else torch.float32) and torch.equal(out, want)
    for name, grad in grads.items():
        assert grad.dtype == torch.float32 and sqnr(want_grads[name], grad) >= 60, name


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["rowwise", "bf16"])
def test_fp8_moe_gpu_compile_fullgraph(recipe):
    """Inductor, whole graph: output, x's and every parameter's gradient against eager. (The bf16
    recipe's grouped GEMM once got zero gradients compiled on torch 2.11: see autograd_outputs.)"""
    mods, x, dy = _gpu_pair(T=1024)
    moe = mods[recipe]
    eager, eager_gx, eager_grads = _grads(moe, x, dy)
    compiled = torch.compile(moe, fullgraph=True)
    moe.zero_grad()
    xr = x.clone().requires_grad_()
    out = compiled(xr)
    out.backward(dy)
    assert sqnr(eager, out) >= 40
    assert sqnr(eager_gx, xr.grad) >= 40
    assert set(eager_grads) == {n for n, _ in moe.named_parameters()}
    for name, p in moe.named_parameters():
        assert p.grad is not None and sqnr(eager_grads[name], p.grad) >= 40, name


@pytest.mark.gpu
def test_fp8_moe_gpu_compile_reduce_overhead():
    """``torch.compile(mode="reduce-overhead")`` (Inductor's CUDA graphs, what a host-bound user
    reaches for): several steps, the last after an in-place update of every parameter, each equal
    to an eager step of the same weights (output, x's and every parameter's gradient)."""
    mods, x, dy = _gpu_pair(T=1024)
    moe = mods["rowwise"]
    torch._dynamo.reset()
    compiled = torch.compile(moe, mode="reduce-overhead", fullgraph=True)
    for step in range(4):
        if step == 3:
            with torch.no_grad():
                for p in moe.parameters():
                    p.mul_(-0.5)
        eager, eager_gx, eager_grads = _grads(moe, x, dy)
        moe.zero_grad()
        torch.compiler.cudagraph_mark_step_begin()
        xr = x.clone().requires_grad_()
        out = compiled(xr)
        out.backward(dy)
        assert sqnr(eager, out) >= 40, step
        assert sqnr(eager_gx, xr.grad) >= 40, step
        for name, p in moe.named_parameters():
            assert p.grad is not None and sqnr(eager_grads[name], p.grad) >= 40, (step, name)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_fp8_moe_gpu_compile_weights_quantized_once_per_step(mode):
    """Inductor, full graph, weight cache on, ``quantize_after_step``: 3 optimizer steps of 2
    micro-batches; every micro-batch against an eager step of the same weights (output, x's and
    every parameter's gradient). Before the last step every weight is flipped in place outside the
    optimizer (a stale FP8 copy would flip the output's sign). Without CUDA graphs the compiled
    cache quantizes each weight in the first two forwards (the first keeps nothing) and after the
    flip, the hook after each step; with CUDA graphs it is never filled."""
    from moe_fp8.grouped_gemm import compiled_weight_cache
    from moe_fp8.optim import quantize_after_step

    mods, x, dy = _gpu_pair(T=1024, cache_weights=True)
    moe = mods["rowwise"]
    opt = torch.optim.SGD(moe.parameters(), lr=1e-3)
    quantize_after_step(opt, moe)
    torch._dynamo.reset()
    compiled = torch.compile(moe, mode=mode, fullgraph=True)
    cache = compiled_weight_cache()
    misses = cache.misses
    for step in range(3):
        if step == 2:
            with torch.no_grad():
                for p in moe.parameters():
                    p.mul_(-0.5)
        for micro in range(2):
            eager, eager_gx, eager_grads = _grads(moe, x, dy)
            moe.zero_grad()
            if mode is not None:
                torch.compiler.cudagraph_mark_step_begin()
            xr = x.clone().requires_grad_()
            out = compiled(xr)
            out.backward(dy)
            assert sqnr(eager, out) >= 40, (step, micro)
            assert sqnr(eager_gx, xr.grad) >= 40, (step, micro)
            for name, p in moe.named_parameters():
                assert sqnr(eager_grads[name], p.grad) >= 40, (step, micro, name)
        opt.step()
    weights = moe.experts._weights()
    held = sum(len(cache.keys(w)) for w in weights)
    assert (held, cache.misses - misses) == ((2, 6) if mode is None else (0, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe, cache_weights", [("rowwise", True), ("rowwise", False), ("bf16", True)])
def test_fp8_moe_gpu_cuda_graph_forward_backward(recipe, cache_weights):
    """Forward + backward captured in one CUDA graph (what a host-bound layer needs): replays with
    new inputs, and after an in-place update of every parameter, match eager steps. With the
    weight cache on, the capture bypasses it (a cached FP8 copy frozen into the graph would be
    stale after the update)."""
    mods, x, dy = _gpu_pair(T=1024, cache_weights=cache_weights)
    moe = mods[recipe]
    static_x, static_dy = x.clone().requires_grad_(), dy.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up off the capture stream: kernels compiled, cache filled
            moe.zero_grad(set_to_none=True)
            moe(static_x).backward(static_dy)
    torch.cuda.current_stream().wait_stream(side)
    moe.zero_grad(set_to_none=True)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe(static_x)
        static_out.backward(static_dy)
    static_grads = {n: p.grad for n, p in moe.named_parameters()}
    static_gx = static_x.grad
    gen = torch.Generator(device="cuda").manual_seed(7)
    for update in (False, True):
        with torch.no_grad():
            static_x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
            static_dy.copy_(torch.randn(dy.shape, device="cuda", generator=gen))
            if update:  # what optimizer.step() does: in place, version counters bumped
                for p in moe.parameters():
                    p.mul_(1.5)
        graph.replay()
        torch.cuda.synchronize()
        got = static_out.clone(), static_gx.clone(), {n: t.clone() for n, t in static_grads.items()}
        want, want_gx, want_grads = _grads(moe, static_x.detach(), static_dy)
        assert sqnr(want, got[0]) >= 40 and sqnr(want_gx, got[1]) >= 40, update
        for name, grad in want_grads.items():
            assert sqnr(grad, got[2][name]) >= 40, (update, name)


@pytest.mark.interpreter
def test_autocast_frozen_weights_and_meta_init():
    torch.manual_seed(5)
    moe = FP8MoE(H, I, E, K)  # fp32 parameters
    moe.experts.gate_up_proj.requires_grad_(False)
    x = torch.randn(T, H, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad is not None and moe.experts.gate_up_proj.grad is None
    assert moe.experts.down_proj.grad is not None and moe.experts.down_proj.grad.dtype == torch.float32
    ref = reference_moe_forward(x, *moe.router(x)[:2], moe.experts.gate_up_proj, moe.experts.down_proj)
    assert sqnr(ref, out) >= OUT_SQNR - 1  # inputs rounded to bf16 by autocast first

    meta = FP8MoE(H, I, E, K, shared_expert_hidden_size=I, device="meta")
    assert meta.experts.gate_up_proj.is_meta
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    for name, p in meta.named_parameters():
        assert torch.isfinite(p).all() and p.abs().max() > 0, name
    assert meta(torch.randn(4, H)).shape == (4, H)


@pytest.mark.interpreter
def test_compile_fullgraph_matches_eager():
    """Every kernel is a custom op with a fake: dynamo captures the whole block (CPU, aot_eager)."""
    moe = _moe("rowwise")
    x = torch.randn(16, H).to(torch.bfloat16)
    dy = torch.randn(16, H).to(torch.bfloat16)
    eager, eager_gx, eager_grads = _grads(moe, x, dy)
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    moe.zero_grad()
    xr = x.clone().requires_grad_()
    out = compiled(xr)
    out.backward(dy)
    assert torch.equal(out, eager) and torch.equal(xr.grad, eager_gx)
    for name, p in moe.named_parameters():
        assert torch.equal(p.grad, eager_grads[name]), name
