"""What an ``Fp8WeightCache`` keeps: copies only where a later forward or backward reads them.

A training step without gradient accumulation must hold no FP8 copy (it would never be read
again); with accumulation the copies are kept from the second micro-batch of the first step and
from the first micro-batch of every later one; evaluation forwards keep copies for themselves only;
activation checkpointing's recomputation reads a copy but never counts or keeps one. Every run
equals the uncached module bit for bit.
"""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from moe_fp8 import FP8MoE, Fp8WeightCache
from moe_fp8.grouped_gemm import compiled_weight_cache

T, H, I, E, K = 24, 64, 32, 4, 2


class _Counted:
    """A quantizer of ``w`` (``w * 2``, one tensor) that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, w: torch.Tensor) -> tuple[torch.Tensor]:
        self.calls += 1
        return (w * 2,)


def test_training_forwards_keep_from_the_second_use_of_a_state():
    cache, quantize = Fp8WeightCache(), _Counted()
    w = torch.randn(2, 16, 16, requires_grad=True)
    served = [cache.serve(w, "k", quantize, training=True) for _ in range(3)]
    assert served[0] is None and served[1] is served[2] and torch.equal(served[1][0], w * 2)
    assert (quantize.calls, cache.misses, cache.hits) == (1, 2, 1)
    with torch.no_grad():
        w.add_(1)  # an optimizer step: the previous state served three forwards
    assert cache.nbytes == w.numel() * 4  # the stale copy, until the next forward
    assert torch.equal(cache.serve(w, "k", quantize, training=True)[0], w * 2)  # kept from the first
    with torch.no_grad():
        w.add_(1)  # the previous state served one forward: nothing kept now, the stale copy dropped
    assert cache.serve(w, "k", quantize, training=True) is None and cache.nbytes == 0
    with torch.no_grad():
        w.add_(1)
    assert cache.serve(w, "k", quantize, training=True) is None and quantize.calls == 2


def test_evaluation_forwards_keep_for_themselves_only():
    cache, quantize = Fp8WeightCache(), _Counted()
    w = torch.randn(2, 16, 16, requires_grad=True)
    assert cache.serve(w, "k", quantize, training=False) is None
    kept = cache.serve(w, "k", quantize, training=False)  # the second evaluation forward keeps
    assert kept is not None and cache.serve(w, "k", quantize, training=False) is kept
    # a training forward the training rule does not cover drops them: it would hold them
    # through its backward for nothing
    assert cache.serve(w, "k", quantize, training=True) is None and cache.nbytes == 0
    with torch.no_grad():
        w.add_(1)  # the previous state served one training forward
    assert cache.serve(w, "k", quantize, training=True) is None and quantize.calls == 1


def test_get_put_and_refresh_always_keep():
    cache, quantize = Fp8WeightCache(), _Counted()
    w = torch.randn(2, 16, 16)
    assert cache.get(w, "k", quantize) is cache.serve(w, "k", quantize, training=True)
    with torch.no_grad():
        w.add_(1)
    assert cache.serve(w, "k", quantize, training=True) is None  # one use of the last state
    with torch.no_grad():
        w.add_(1)
    assert cache.refresh() == 1 and quantize.calls == 2  # the weights seen, kept or not
    assert torch.equal(cache.serve(w, "k", quantize, training=True)[0], w * 2) and quantize.calls == 2
    cache.put(w, w.dtype, "j", (w * 3,))
    assert cache.keys(w) == [(w.dtype, "k"), (w.dtype, "j")]
    assert torch.equal(cache.serve(w, "j", quantize, training=True)[0], w * 3)
    with torch.no_grad():
        w.add_(1)
    other = torch.randn(4, 4)
    assert cache.get(other, "k", quantize) is not None and quantize.calls == 3
    with torch.no_grad():
        other.add_(1)
    # w's "k" entry (a view names w; "j" was put, with no quantizer to refresh it), not other's
    assert cache.refresh(of=[w[0]]) == 1 and quantize.calls == 4
    with torch.no_grad():
        w.add_(1)  # a write before any forward of the refreshed state: kept at once, as the refresh's copy was
    assert torch.equal(cache.serve(w, "k", quantize, training=True)[0], w * 2) and quantize.calls == 5


def _pair(seed=0):
    torch.manual_seed(seed)
    cached = FP8MoE(H, I, E, K, cache_weights=True).to(torch.bfloat16)
    plain = FP8MoE(H, I, E, K, cache_weights=False).to(torch.bfloat16)
    plain.load_state_dict(cached.state_dict())
    return cached, plain


def _train(module, steps: int, micro_batches: int, checkpointed=False, held=None) -> list[torch.Tensor]:
    """Outputs, input gradients and per step the parameters' gradients of ``steps`` SGD steps of
    ``micro_batches`` micro-batches; ``held`` gets the module's cache bytes after each backward."""
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    seen = []
    for _ in range(steps):
        for _ in range(micro_batches):
            x = torch.randn(T, H, generator=g).to(torch.bfloat16).requires_grad_()
            out = checkpoint(module, x, use_reentrant=False) if checkpointed else module(x)
            out.backward(torch.randn(out.shape, generator=g).to(out.dtype))
            seen += [out.detach(), x.grad]
            if held is not None:
                held.append(module.experts.weight_cache_nbytes)
        seen += [p.grad.clone() for p in module.parameters()]
        opt.step()
        opt.zero_grad()
    return seen


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("checkpointed", [False, True])
def test_one_micro_batch_per_step_holds_no_copy(checkpointed):
    """Without accumulation, with activation checkpointing or not: no copy held after any backward
    (the recomputation quantizes again, as without a cache), the same bits as the uncached module."""
    cached, plain = _pair()
    held = []
    _equal(_train(plain, 3, 1, checkpointed), _train(cached, 3, 1, checkpointed, held))
    assert held == [0, 0, 0]
    assert all(c.hits == 0 for c in cached.experts._caches)


def test_accumulation_with_checkpointing_reads_the_copies_in_the_recomputation():
    cached, plain = _pair(seed=2)
    held = []
    _equal(_train(plain, 2, 2, True), _train(cached, 2, 2, True, held))
    assert held[0] == 0 and held[1] == held[2] == held[3] > 0
    # hits: the second micro-batch's recomputation in the first step; both forwards and both
    # recomputations of the second, less its first forward (the miss that keeps)
    assert all((c.misses, c.hits) == (3, 4) for c in cached.experts._caches)


@pytest.mark.slow(5)
def test_compiled_one_micro_batch_per_step_holds_amaxes_only():
    """Compiled (aot_eager): without accumulation the compiled cache holds, per weight, only the
    dgrad layout's amax that the forward leaves for its backward; the same bits as uncached eager."""
    cached, plain = _pair(seed=3)
    torch._dynamo.reset()
    compiled = torch.compile(cached, fullgraph=True, backend="aot_eager")
    hits = compiled_weight_cache().hits
    _equal(_train(plain, 2, 1), _train(compiled, 2, 1))
    assert compiled_weight_cache().hits == hits
    assert cached.experts.weight_cache_nbytes <= 4 * E * (H + I)  # (E, K) fp32 amaxes of the two weights


@pytest.mark.parametrize(("recipe", "h", "i"), [("rowwise", H, I), ("rowwise_gw_hp", H, I), ("tensorwise", H, I),
                                                ("blockwise", 256, 144), ("bf16", H, I)])
def test_experts_filled_bytes_are_what_accumulation_holds(recipe, h, i):
    """``weight_layouts_nbytes`` (from the shapes and the recipe, before any forward) equals what
    the caches hold once gradient accumulation has filled them: both layouts of both weights and
    their scales (blockwise: ragged 128 x 128 blocks); the BF16 recipe holds nothing."""
    from moe_fp8.layers.experts import FP8GroupedExperts

    torch.manual_seed(0)
    experts = FP8GroupedExperts(E, h, i, recipe=recipe, backend="emulated", cache_weights=True,
                                dtype=torch.bfloat16)
    expected = experts.weight_layouts_nbytes
    assert (expected == 0) == (recipe == "bf16")
    for _ in range(3):
        x = torch.randn(T, h).bfloat16()
        experts(x, torch.randint(0, E, (T, K)), torch.rand(T, K)).float().square().sum().backward()
    assert experts.weight_cache_nbytes == expected
    experts.cache_weights = False
    assert experts.weight_cache_nbytes == 0


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_linear_filled_bytes_are_what_accumulation_holds(recipe):
    from moe_fp8.layers.fp8_linear import FP8Linear

    torch.manual_seed(0)
    linear = FP8Linear(160, 272, recipe=recipe, cache_weights=True, dtype=torch.bfloat16)
    expected = linear.weight_layouts_nbytes
    for _ in range(3):
        linear(torch.randn(T, 160).bfloat16()).float().square().sum().backward()
    assert expected > 2 * 160 * 272 and linear.weight_cache_nbytes == expected
