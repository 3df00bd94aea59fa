"""adamw_quantize and the post-step cache fill on the GPU: Qwen3-30B-A3B expert shapes, both FP8
casts, byte for byte against the reference quantizers; the next step equals the uncached module."""

import pytest
import torch
from torch import nn

from moe_fp8 import FP8GroupedExperts
from moe_fp8.optim import AdamWQuantize, adamw_hyper, adamw_quantize, adamw_quantize_reference, quantize_after_step
from moe_fp8.quant import reference as ref

pytestmark = pytest.mark.gpu
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _bytes(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("shape", [(8, 1536, 2048), (8, 2048, 768), (3, 80, 1040)])
@pytest.mark.parametrize("dtype, quant_dtype, state_dtype", [
    (torch.bfloat16, torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16, torch.float32),
])
@pytest.mark.parametrize("hw_cast", [True, False])
def test_kernel_byte_for_byte_on_the_gpu(shape, dtype, quant_dtype, state_dtype, hw_cast):
    g = torch.Generator("cuda").manual_seed(0)
    p = (torch.randn(shape, generator=g, device="cuda") * 0.05).to(dtype)
    grad = (torch.randn(shape, generator=g, device="cuda") * 1e-2).to(dtype)
    m = (torch.randn(shape, generator=g, device="cuda") * 1e-3).to(state_dtype)
    v = (torch.rand(shape, generator=g, device="cuda") * 1e-4).to(state_dtype)
    p_ref, m_ref, v_ref = p.clone(), m.clone(), v.clone()
    hyper = adamw_hyper(step=5, **HYPER)
    got = adamw_quantize(p, grad, m, v, hyper, fmt="e4m3fn", quant_dtype=quant_dtype, hw_cast=hw_cast)
    adamw_quantize_reference(p_ref, grad, m_ref, v_ref, hyper, fmt="e4m3fn", quant_dtype=quant_dtype)
    # fp32 math in another order than torch's (FMA, sqrt): bf16 results may round one ulp (2^-7) apart
    tol = 2e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(p.float(), p_ref.float(), rtol=tol, atol=1e-7)
    stol = 2e-6 if state_dtype == torch.float32 else 2**-7
    torch.testing.assert_close(m.float(), m_ref.float(), rtol=stol, atol=1e-9)
    torch.testing.assert_close(v.float(), v_ref.float(), rtol=stol, atol=1e-12)
    w = p.to(quant_dtype)  # the copies are the reference quantizers of the weight the kernel wrote
    want = (*ref.quantize_expert_colwise(w, "e4m3fn"), *ref.quantize_expert_colwise(w, "e4m3fn", transposed=True))
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


class _Block(nn.Module):
    def __init__(self, cache_weights: bool = True, **kw):
        super().__init__()
        self.router = nn.Linear(512, 16, bias=False, device="cuda")
        self.experts = FP8GroupedExperts(16, 512, 256, device="cuda", cache_weights=cache_weights, **kw)

    def forward(self, x):
        weights, ids = torch.softmax(self.router(x).float(), -1).topk(4, dim=-1)
        return self.experts(x, ids, weights.to(x.dtype))


@pytest.mark.parametrize("fused", [False, True])
def test_next_step_on_the_gpu_equals_the_uncached_module(fused):
    torch.manual_seed(0)
    model = _Block().to(torch.bfloat16)
    plain = _Block(cache_weights=False).to(torch.bfloat16)
    if fused:
        opt = AdamWQuantize(model.parameters(), model, **HYPER)
    else:
        opt = torch.optim.AdamW(model.parameters(), **HYPER)
        quantize_after_step(opt, model)
    x = torch.randn(1024, 512, device="cuda").bfloat16()
    dy = torch.randn(1024, 512, device="cuda").bfloat16()
    for step in range(3):
        plain.load_state_dict(model.state_dict())
        outs = []
        for m in (model, plain):
            m.zero_grad()
            xr = x.clone().requires_grad_()
            out = m(xr)
            out.backward(dy)
            outs.append((out, xr.grad, {n: p.grad.clone() for n, p in m.named_parameters()}))
        (a, ga, pa), (b, gb, pb) = outs
        assert torch.equal(a, b) and torch.equal(ga, gb)
        assert all(torch.equal(pa[n], pb[n]) for n in pa)
        assert all((c.hits, c.misses) == (step, 1) for c in model.experts._caches), model.experts._caches
        opt.step()
