"""adamw_quantize: the fused AdamW update + FP8 copies against torch.optim.AdamW and the reference
quantizers (byte for byte), and AdamWQuantize filling the weight caches of FP8GroupedExperts."""

import copy

import pytest
import torch
from torch import nn

from moe_fp8 import FP8GroupedExperts
from moe_fp8.grouped_gemm import compiled_weight_cache, library, quant_seam
from moe_fp8.optim import AdamWQuantize, adamw_hyper, adamw_quantize, adamw_quantize_reference
from moe_fp8.quant import reference as ref
from moe_fp8.testing import dirty_allocator
from quant_kernel_cases import FNUZ_OK

HYPER = dict(lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _assert_quantized_equal(got, want):
    assert len(got) == len(want) == 4
    for name, a, b in zip(("q_fwd", "s_fwd", "q_bwd", "s_bwd"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous(), name
        assert torch.equal(_bytes(a), _bytes(b)), name


def _state(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(shape, generator=g) * 3).to(dtype)
    p[0, 0] = 0  # an all-zero row before the update
    grad = torch.randn(shape, generator=g).to(dtype)
    m = torch.randn(shape, generator=g) * 0.1
    v = torch.rand(shape, generator=g) * 0.01
    return p, grad, m, v


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype, quant_dtype, state_dtype, shape, fmt, pow2", [
    (torch.bfloat16, torch.bfloat16, torch.float32, (3, 24, 40), "e4m3fn", False),
    (torch.float32, torch.float32, torch.float32, (2, 5, 33), "e4m3fn", True),  # odd sizes, a partial row block
    pytest.param(torch.float32, torch.bfloat16, torch.float32, (1, 17, 64), "e4m3fnuz", False,  # fp32 master, bf16 GEMMs
                 marks=pytest.mark.skipif(not FNUZ_OK, reason="fnuz Triton types fail in the interpreter below triton 3.8")),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16, (2, 16, 48), "e4m3fn", False),  # bf16 moments
])
def test_kernel_matches_the_reference_byte_for_byte(dtype, quant_dtype, state_dtype, shape, fmt, pow2):
    p, grad, m, v = _state(shape, dtype, seed=0)
    m, v = m.to(state_dtype), v.to(state_dtype)
    p_ref, m_ref, v_ref, p_old = p.clone(), m.clone(), v.clone(), p.float()
    hyper = adamw_hyper(step=3, **HYPER)
    dirty_allocator()
    got = adamw_quantize(p, grad, m, v, hyper, fmt=fmt, pow2=pow2, quant_dtype=quant_dtype)
    want = adamw_quantize_reference(p_ref, grad, m_ref, v_ref, hyper, fmt=fmt, pow2=pow2, quant_dtype=quant_dtype)
    # the update: the reference's fp32 math within one rounding; bf16 results may then round one
    # bf16 ulp (2^-7) apart (seen on a few elements in the interpreter and on the H200)
    state_rtol = 2e-7 if state_dtype == torch.float32 else 2**-7
    torch.testing.assert_close(m.float(), m_ref.float(), rtol=state_rtol, atol=0)
    torch.testing.assert_close(v.float(), v_ref.float(), rtol=state_rtol, atol=0)
    if dtype == torch.float32:  # a few fp32 roundings of the terms p = p_old + step sums (it may cancel)
        bound = 4 * torch.finfo(torch.float32).eps * (p_old.abs() + (p_ref - p_old).abs())
        assert ((p - p_ref).abs() <= bound).all(), ((p - p_ref).abs() - bound).max()
    else:
        torch.testing.assert_close(p.float(), p_ref.float(), rtol=2**-7, atol=0)
    if torch.equal(p, p_ref):  # the same weight: the same copies as the reference's
        _assert_quantized_equal(got, want)
    # the copies are the reference quantizers of the updated weight itself (the cache's contract)
    w = p.to(quant_dtype)
    _assert_quantized_equal(got, (*ref.quantize_expert_colwise(w, fmt, pow2=pow2),
                                  *ref.quantize_expert_colwise(w, fmt, pow2=pow2, transposed=True)))


@pytest.mark.interpreter
@pytest.mark.parametrize("fused", [True, False])
def test_update_equals_torch_adamw_over_steps(fused):
    """Three steps of fp32 AdamW against torch.optim.AdamW (single-tensor), within fp32 rounding;
    ``quantize=False`` writes no copy and updates the same."""
    p, _, _, _ = _state((2, 16, 48), torch.float32, seed=1)
    torch_p = nn.Parameter(p.clone())
    opt = torch.optim.AdamW([torch_p], foreach=False, **HYPER)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    run = adamw_quantize if fused else adamw_quantize_reference
    for step in range(1, 4):
        grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 + step))
        torch_p.grad = grad.clone()
        opt.step()
        assert run(p, grad, m, v, adamw_hyper(step=step, **HYPER), fmt="e4m3fn", quantize=False) is None
        torch.testing.assert_close(p, torch_p.detach(), rtol=1e-6, atol=1e-7)
        # (torch's lerp may fuse a multiply-add: values near 0 differ by an ulp of the gradient's size)
        torch.testing.assert_close(m, opt.state[torch_p]["exp_avg"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(v, opt.state[torch_p]["exp_avg_sq"], rtol=1e-6, atol=1e-8)


def test_bad_input():
    p, grad, m, v = _state((2, 16, 32), torch.bfloat16, seed=2)
    hyper = adamw_hyper(step=1, **HYPER)
    with pytest.raises(ValueError, match="step"):
        adamw_hyper(step=0, **HYPER)
    with pytest.raises(TypeError, match="grad"):
        adamw_quantize(p, grad.float(), m, v, hyper)
    with pytest.raises(TypeError, match="exp_avg_sq"):
        adamw_quantize(p, grad, m.bfloat16(), v, hyper)
    with pytest.raises(TypeError, match="exp_avg"):
        adamw_quantize(p, grad, m.half(), v.half(), hyper)
    with pytest.raises(TypeError, match="state_dtype"):
        AdamWQuantize(_Block().parameters(), _Block(), state_dtype=torch.float16)
    with pytest.raises(ValueError, match="exp_avg_sq"):
        adamw_quantize(p, grad, m, v[:, :8], hyper)
    with pytest.raises(ValueError, match="p: expected a contiguous"):
        adamw_quantize(p.transpose(1, 2), grad.transpose(1, 2), m.transpose(1, 2), v.transpose(1, 2), hyper)
    with pytest.raises(TypeError, match="quant_dtype"):
        adamw_quantize(p, grad, m, v, hyper, quant_dtype=torch.float16)
    with pytest.raises(TypeError, match="p"):
        adamw_quantize(p.half(), grad.half(), m, v, hyper)


class _Block(nn.Module):
    def __init__(self, cache_weights: bool = True, **kw):
        super().__init__()
        self.router = nn.Linear(64, 4, bias=False)
        self.experts = FP8GroupedExperts(4, 64, 32, cache_weights=cache_weights, **kw)

    def forward(self, x):
        weights, ids = torch.softmax(self.router(x).float(), -1).topk(2, dim=-1)
        return self.experts(x, ids, weights.to(x.dtype))


def _count_weight_quantizations(monkeypatch) -> list:
    """A list that gets an entry per expert-weight quantization, any layout, eager or inside the
    compiled cache's op."""
    calls = []
    for module, names in ((library, ("quantize_weight", "quantize_weight_forward_layout", "quantize_weight_dgrad_layout")),
                          (quant_seam, ("quantize_weight_layout", "quantize_weight_forward_layout",
                                        "quantize_weight_dgrad_layout"))):
        for name in names:
            real = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, _f=real, **k: calls.append(1) or _f(*a, **k))
    return calls


@pytest.mark.interpreter
def test_optimizer_fills_the_caches_and_matches_torch_adamw(monkeypatch):
    """fp32 weights (the down GEMM's copies in bf16): AdamWQuantize updates like torch's AdamW (the router bit
    for bit: torch's own step), leaves both layouts of the new weights in the caches (the bytes of
    quantizing them), and the next forward and backward quantize no weight."""
    torch.manual_seed(3)
    model = _Block()
    twin = _Block(cache_weights=False)
    twin.load_state_dict(model.state_dict())
    opt = AdamWQuantize(model.parameters(), model, foreach=False, **HYPER)
    torch_opt = torch.optim.AdamW(twin.parameters(), foreach=False, **HYPER)
    calls = _count_weight_quantizations(monkeypatch)
    x, dy = torch.randn(16, 64), torch.randn(16, 64)
    for step in range(2):
        for m, o in ((model, opt), (twin, torch_opt)):
            before = len(calls)
            o.zero_grad()
            m(x).backward(dy)
            o.step()
            if m is model and step:  # after the first step: the steps made every copy the GEMMs read
                assert len(calls) == before
        assert torch.equal(model.router.weight, twin.router.weight)
        for name in ("gate_up_proj", "down_proj"):
            torch.testing.assert_close(getattr(model.experts, name), getattr(twin.experts, name), rtol=1e-6,
                                       atol=1e-7)
    for p, cache in ((model.experts.gate_up_proj, model.experts._caches[0]),
                     (model.experts.down_proj, model.experts._caches[1])):
        ((dtype, key),) = cache.keys(p)
        cached = cache.get(cache.stand_in(p, dtype), key, lambda t: pytest.fail("a miss after the step"))
        _assert_quantized_equal(cached, library.quantize_weight(p.detach().to(dtype), *key))
    assert opt.state_dict()["state"][1]["exp_avg"].dtype == torch.float32


@pytest.mark.interpreter
def test_optimizer_fills_the_compiled_cache(monkeypatch):
    """After a compiled forward (aot_eager, full graph) the fused step writes its copies into the
    compiled cache: the next compiled forward and backward quantize no weight, and the copies are
    the bytes of quantizing the new weights."""
    torch.manual_seed(4)
    model = _Block().to(torch.bfloat16)
    opt = AdamWQuantize(model.parameters(), model, foreach=False, **HYPER)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    calls = _count_weight_quantizations(monkeypatch)
    x, dy = torch.randn(16, 64).bfloat16(), torch.randn(16, 64).bfloat16()
    for step in range(2):
        before = len(calls)
        opt.zero_grad()
        compiled(x).backward(dy)
        opt.step()
        assert step == 0 or len(calls) == before  # after the first step the fused steps made every copy
    cache = compiled_weight_cache()
    for p in (model.experts.gate_up_proj, model.experts.down_proj):
        ((dtype, key),) = cache.keys(p)
        cached = cache.get(p, key, lambda t: pytest.fail("a miss after the step"))
        _assert_quantized_equal(cached, library.quantize_weight(p.detach(), *key))


@pytest.mark.interpreter
def test_optimizer_bf16_weights_and_unfused_layouts(monkeypatch):
    """bf16 weights keep fp32 moments (rounded once per step); a transposed layout takes torch's
    step and the post-step refresh; a group with amsgrad takes torch's step."""
    torch.manual_seed(4)
    model = _Block(in_out_layout=True).to(torch.bfloat16)
    plain = _Block(in_out_layout=True, cache_weights=False).to(torch.bfloat16)
    fused = _Block().to(torch.bfloat16)
    x, dy = torch.randn(16, 64).bfloat16(), torch.randn(16, 64).bfloat16()
    opt = AdamWQuantize(model.parameters(), model, **HYPER)
    assert not opt._fusable
    opt_fused = AdamWQuantize(fused.parameters(), fused, **HYPER)
    assert len(opt_fused._fusable) == 2
    for m, o in ((model, opt), (fused, opt_fused)):
        for _ in range(2):
            o.zero_grad()
            m(x).backward(dy)
            o.step()
    assert opt.state[model.experts.down_proj]["exp_avg"].dtype == torch.bfloat16  # torch's
    assert opt_fused.state[fused.experts.down_proj]["exp_avg"].dtype == torch.float32
    plain.load_state_dict(model.state_dict())
    hits = [c.hits for c in model.experts._caches]  # refreshed after the step: the next forward hits
    assert torch.equal(model(x), plain(x))
    assert [c.hits for c in model.experts._caches] == [h + 1 for h in hits]
    amsgrad = AdamWQuantize(fused.parameters(), fused, amsgrad=True, **HYPER)
    fused.zero_grad()
    fused(x).backward(dy)
    amsgrad.step()
    assert "max_exp_avg_sq" in amsgrad.state[fused.experts.down_proj]


@pytest.mark.interpreter
def test_optimizer_state_dict_resumes_bit_for_bit():
    """bf16 weights, fp32 moments: a state dict loaded into a fresh optimizer (moments kept in fp32,
    not cast to the weights' dtype) continues exactly as the original; the router's state is torch's."""
    torch.manual_seed(5)
    runs = [_Block().to(torch.bfloat16) for _ in range(2)]
    runs[1].load_state_dict(runs[0].state_dict())
    grads = [{n: torch.randn_like(p) for n, p in runs[0].named_parameters()} for _ in range(3)]

    def step(model, opt, g):
        for n, p in model.named_parameters():
            p.grad = g[n].clone()
        opt.step()

    first = AdamWQuantize(runs[0].parameters(), runs[0], **HYPER)
    for g in grads[:2]:
        step(runs[0], first, g)
    runs[1].load_state_dict(runs[0].state_dict())
    resumed = AdamWQuantize(runs[1].parameters(), runs[1], **HYPER)
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))  # torch's load may share same-dtype tensors
    assert resumed.state[runs[1].experts.gate_up_proj]["exp_avg"].dtype == torch.float32
    assert resumed.state[runs[1].router.weight]["exp_avg"].dtype == torch.bfloat16
    step(runs[0], first, grads[2])
    step(runs[1], resumed, grads[2])
    for (name, a), b in zip(runs[0].named_parameters(), runs[1].parameters()):
        assert torch.equal(a, b), name
    sa, sb = first.state[runs[0].experts.down_proj], resumed.state[runs[1].experts.down_proj]
    assert all(torch.equal(sa[k], sb[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
