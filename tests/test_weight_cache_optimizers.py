"""The FP8 weight caches follow every ``torch.optim`` step, the fused and foreach kernels too, which
write parameters without bumping their version counters (``moe_fp8.optimizer_steps`` bumps them in
a step pre-hook): cached modules equal uncached ones bit for bit over steps, with and without
gradient accumulation, and the caches are read where they should be."""

import pytest
import torch

from moe_fp8 import FP8Linear, FP8MoE, Fp8WeightCache
from moe_fp8.grouped_gemm import compiled_weight_cache

T, H, I, E, K = 24, 64, 32, 4, 2
KINDS = {"fused": dict(fused=True), "foreach": dict(foreach=True), "for-loop": dict(foreach=False)}


def _train(module: torch.nn.Module, kind: str, steps: int, micro_batches: int) -> list[torch.Tensor]:
    """Outputs and parameter gradients of ``steps`` AdamW steps of ``micro_batches`` micro-batches."""
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2, **KINDS[kind])
    seen = []
    for _ in range(steps):
        for _ in range(micro_batches):
            out = module(torch.randn(T, H, generator=g).to(torch.bfloat16))
            out.backward(torch.randn(out.shape, generator=g).to(out.dtype))
            seen.append(out.detach())
        seen += [p.grad.clone() for p in module.parameters()]
        opt.step()
        opt.zero_grad()
    return seen


def _pair(make) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    cached = make(True).to(torch.bfloat16)
    plain = make(False).to(torch.bfloat16)
    plain.load_state_dict(cached.state_dict())
    return cached, plain


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_cached_moe_equals_uncached_under_every_adamw(kind, micro_batches):
    cached, plain = _pair(lambda cache: FP8MoE(H, I, E, K, cache_weights=cache))
    want, got = _train(plain, kind, 3, micro_batches), _train(cached, kind, 3, micro_batches)
    assert len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got))
    hits = sum(c.hits for c in cached.experts._caches)
    assert hits == (0 if micro_batches == 1 else 2 * 2)  # each weight: the second micro-batch of the first step
    # keeps, and from then on each step keeps at its first and hits at its second


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_cached_linear_equals_uncached_under_every_adamw(kind):
    cached, plain = _pair(lambda cache: FP8Linear(H, 48, cache_weights=cache))
    want, got = _train(plain, kind, 3, 2), _train(cached, kind, 3, 2)
    assert len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got))
    assert cached._cache.hits > 0


def test_a_fused_step_makes_a_kept_copy_stale():
    """The premise and the remedy on the cache alone: a fused AdamW step writes ``w``; the hook has
    bumped ``w``'s version, so the copy kept for its old values is not served again."""
    cache = Fp8WeightCache()
    w = torch.nn.Parameter(torch.randn(2, 16, 16))
    quantize = lambda t: (t * 2,)  # noqa: E731
    assert cache.serve(w, "k", quantize, training=True) is None
    kept = cache.serve(w, "k", quantize, training=True)  # the second use of this state keeps
    assert kept is not None and cache.serve(w, "k", quantize, training=True) is kept
    w.grad, before, version = torch.randn_like(w), w.detach().clone(), w._version
    torch.optim.AdamW([w], lr=0.1, fused=True).step()
    assert not torch.equal(w.detach(), before) and w._version == version + 1  # the hook's bump alone
    served = cache.serve(w, "k", quantize, training=True)
    assert served is None or torch.equal(served[0], w.detach() * 2)
    assert cache.held(w, "k") == ((), ()) or torch.equal(cache.held(w, "k")[0][0], w.detach() * 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compiled", [False, True])
def test_cache_follows_fused_adamw_on_gpu(compiled):
    """CUDA's fused AdamW, eager and under Inductor (the process-wide compiled cache): after 3
    optimizer steps of 2 micro-batches the forward that reads the caches gives the bits of one that
    quantizes the current weights afresh (a copy of the weights before the last step would not)."""
    torch.manual_seed(0)
    moe = FP8MoE(2048, 768, 32, 8, device="cuda", dtype=torch.bfloat16, cache_weights=True)
    forward = torch.compile(moe, fullgraph=True) if compiled else moe
    opt = torch.optim.AdamW(moe.parameters(), lr=1e-3, fused=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(1024, 2048, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3)]
    for _ in range(3):
        for x in xs[:2]:
            forward(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    read = forward(xs[2]).detach()
    for cache in (*moe.experts._caches, compiled_weight_cache()):
        cache.invalidate()
    assert torch.equal(read, forward(xs[2]).detach())
