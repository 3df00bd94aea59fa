"""``FP8Linear(cache_weights=True)``: the weight's FP8 layouts reused while the weight is unchanged.

Every cached run must equal the uncached module bit for bit (the same quantizers on the same
weight), over gradient-accumulation micro-batches and across optimizer steps, eagerly and compiled.
Copies and pickles of modules with filled caches (dense and expert caches alike) start empty.
"""

import pytest
import torch
from torch import nn

from moe_fp8 import FP8Linear, convert_to_fp8
from moe_fp8.grouped_gemm import Fp8WeightCache, compiled_cache, compiled_weight_cache
from moe_fp8.layers import dense_weight_cache
from moe_fp8.layers.dense_quant import weight_layouts
from moe_fp8.layers.fp8_linear import fp8_linear
from moe_fp8.quant.formats import resolve_format

RECIPES = ["rowwise", "rowwise_gw_hp", "tensorwise"]


def _pair(recipe: str, K=64, N=48, dtype=torch.bfloat16, seed=0):
    """An uncached ``FP8Linear`` and a cached one with equal (separate) parameters."""
    torch.manual_seed(seed)
    plain = FP8Linear(K, N, recipe=recipe, dtype=dtype)
    cached = FP8Linear(K, N, recipe=recipe, dtype=dtype, cache_weights=True)
    cached.load_state_dict(plain.state_dict())
    return plain, cached


def _train(module: nn.Module, steps: int, micro_batches: int, rows, frozen_input=False, dtype=torch.bfloat16,
           autocast=False, seed=1) -> list[torch.Tensor]:
    """Outputs, input gradients and (per step) weight and bias gradients of ``steps`` SGD steps of
    ``micro_batches`` accumulated micro-batches each, on data drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1)
    seen = []
    for _ in range(steps):
        for i in range(micro_batches):
            m = rows[i % len(rows)]
            x = torch.randn(m, module.in_features, generator=g).to(dtype).requires_grad_(not frozen_input)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = module(x)
            y.backward(torch.randn(y.shape, generator=g).to(y.dtype))
            seen += [y.detach(), x.grad]
        seen += [p.grad.clone() for p in params]
        opt.step()
        opt.zero_grad()
    return [t for t in seen if t is not None]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert u.dtype == v.dtype and torch.equal(u, v), i


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("frozen_input", [False, True])
def test_cached_equals_uncached_over_micro_batches_and_steps(recipe, frozen_input):
    plain, cached = _pair(recipe)
    rows = [40, 37, 3]  # token counts not multiples of 16 pad for the wgrad
    _equal(_train(plain, 3, 3, rows, frozen_input), _train(cached, 3, 3, rows, frozen_input))
    # one quantization per optimizer step; in the first, whose first micro-batch keeps nothing, two
    assert (cached._cache.misses, cached._cache.hits) == (4, 5)
    assert len(cached._cache) == 1


@pytest.mark.parametrize("compiled", [False, True])
def test_one_micro_batch_per_step_keeps_nothing(compiled):
    """Without gradient accumulation no copy would be read again: nothing is kept (compiled: only
    the column amax the forward leaves for its backward), and the steps equal the uncached module's."""
    plain, cached = _pair("rowwise", seed=4)
    cache = compiled_weight_cache() if compiled else cached._cache
    module = cached
    if compiled:
        torch._dynamo.reset()
        module = torch.compile(cached, fullgraph=True, backend="aot_eager")
    hits = cache.hits
    _equal(_train(plain, 3, 1, [40]), _train(module, 3, 1, [40]))
    assert cache.hits == hits and cached.weight_cache_nbytes == (4 * 64 if compiled else 0)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_cache_misses_after_any_in_place_write(recipe):
    plain, cached = _pair(recipe)
    x = torch.randn(24, 64, dtype=torch.bfloat16)
    _equal([plain(x)], [cached(x)])
    for module in (plain, cached):
        with torch.no_grad():
            module.weight.mul_(-0.5)  # an in-place write outside any optimizer
    _equal([plain(x)], [cached(x)])
    assert cached._cache.misses == 2 and cached._cache.hits == 0


def test_fp32_parameters_under_autocast():
    """fp32 parameters cast to bf16 by autocast hit too: the cache keys on the parameter, the cast
    happens inside the quantization (on a miss), the weight gradient reaches the fp32 parameter."""
    plain, cached = _pair("rowwise", dtype=torch.float32)
    want = _train(plain, 2, 2, [32], dtype=torch.float32, autocast=True)
    got = _train(cached, 2, 2, [32], dtype=torch.float32, autocast=True)
    _equal(want, got)
    assert cached.weight.grad is None and cached.weight.dtype == torch.float32
    assert (cached._cache.misses, cached._cache.hits) == (3, 1)


def test_layouts_and_bytes_held():
    _, cached = _pair("rowwise", K=64, N=48)
    assert cached.weight_cache_nbytes == 0 and "cache_weights=True" in repr(cached)
    for _ in range(2):  # the second forward of the same weight keeps its layouts
        cached(torch.randn(8, 64, dtype=torch.bfloat16))
    fmt = resolve_format("e4m3fn")
    want = weight_layouts(cached.weight.detach(), "rowwise", fmt, True, True)
    got = next(iter(cached._cache._entries.values())).value
    _equal(list(want), list(got))
    assert got[0].shape == (48, 64) and got[2].shape == (64, 48)  # forward layout, dgrad layout
    assert cached.weight_cache_nbytes == 2 * 48 * 64 + 4 * (48 + 64)  # both layouts and their scales
    cached.cache_weights = False
    assert cached.weight_cache_nbytes == 0 and not cached.cache_weights
    cached.cache_weights = True
    assert cached.cache_weights and len(cached._cache) == 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_cached_equals_eager_uncached(recipe):
    """Compiled (fullgraph, aot_eager on the CPU), the GEMMs read the process-wide compiled cache:
    the same bits as the uncached module, one quantization per optimizer step."""
    plain, cached = _pair(recipe, seed=3)
    rows = [40]  # one static shape: one graph
    want = _train(plain, 2, 3, rows)
    cache = compiled_weight_cache()
    cache.invalidate()
    hits, misses = cache.hits, cache.misses
    torch._dynamo.reset()
    compiled = torch.compile(cached, fullgraph=True, backend="aot_eager")
    got = _train(compiled, 2, 3, rows)
    _equal(want, got)
    # the first step: the first micro-batch keeps nothing, the second keeps both layouts (3 hits);
    # the second step: one miss, then five hits (forward and dgrad of three micro-batches)
    assert (cache.misses - misses, cache.hits - hits) == (3, 8)
    assert len(cached._cache) == 0 and cached.weight_cache_nbytes > 0  # the compiled cache's entry


def test_compiled_op_off_the_default_stream_stores_nothing(monkeypatch):
    """Where the compiled cache is not read (a side stream: CUDA-graph capture), the op quantizes
    the one layout its GEMM reads: the same result, no entry."""
    torch.manual_seed(5)
    w = torch.randn(48, 64, dtype=torch.bfloat16)
    a, g = torch.randn(24, 64, dtype=torch.bfloat16), torch.randn(24, 48, dtype=torch.bfloat16)
    fmt = resolve_format("e4m3fn")
    from moe_fp8.layers.dense_quant import quantize_rows

    args = lambda dgrad: (*quantize_rows(g if dgrad else a, "rowwise", fmt, True), w, dgrad, "rowwise",  # noqa: E731
                          "e4m3fn", True, True, torch.bfloat16, True, True)
    cache = compiled_weight_cache()
    cache.invalidate()
    want = [dense_weight_cache.dense_mm_cached_weight(*args(d)) for d in (False, True)]
    assert len(cache) == 1
    cache.invalidate()
    monkeypatch.setattr(compiled_cache, "off_default_stream", lambda t: True)
    got = [dense_weight_cache.dense_mm_cached_weight(*args(d)) for d in (False, True)]
    _equal(want, got)
    assert len(cache) == 0


def test_weights_fsdp_gathers_are_not_cached():
    """A weight FSDP gathers keeps its identity and version counter across optimizer steps: a module
    FSDP manages quantizes it in every forward (the same bits), and stores nothing."""
    plain, cached = _pair("rowwise")
    cached._is_fsdp_managed_module = True  # what fully_shard sets on every module of a unit
    _equal(_train(plain, 2, 2, [32]), _train(cached, 2, 2, [32]))
    assert len(cached._cache) == 0 and cached._cache.misses == 0


def test_functional_weight_cache_and_bad_arguments():
    torch.manual_seed(6)
    x, w = torch.randn(16, 32, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    cache = Fp8WeightCache()
    for _ in range(3):  # the first call keeps nothing, the second keeps, the third hits
        assert torch.equal(fp8_linear(x, w, weight_cache=cache), fp8_linear(x, w))
    assert (cache.misses, cache.hits) == (2, 1)
    with pytest.raises(TypeError, match="weight_cache: expected Fp8WeightCache or None, got dict"):
        fp8_linear(x, w, weight_cache={})
    stand_in = cache.stand_in(w.float(), torch.bfloat16)
    with pytest.raises(ValueError, match="weight: a Fp8WeightCache.stand_in holds no values"):
        fp8_linear(x, stand_in)
    with pytest.raises(ValueError, match="weight: a Fp8WeightCache.stand_in holds no values"):
        fp8_linear(x, stand_in, recipe="bf16", weight_cache=cache)


def test_converters_pass_cache_weights():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    convert_to_fp8(model, cache_weights=True)
    assert model[0].cache_weights and model[2].cache_weights
    assert not convert_to_fp8(nn.Linear(16, 32)).cache_weights  # off by default
    plain = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)))
    report, cached = plain.fp8_conversion_report, model.fp8_conversion_report
    layouts = plain[0].weight_layouts_nbytes + plain[2].weight_layouts_nbytes
    assert layouts > 0 and (report.weight_cache_nbytes, report.uncached_layouts_nbytes) == (0, layouts)
    assert (cached.weight_cache_nbytes, cached.uncached_layouts_nbytes) == (layouts, 0)
    assert "FP8 weight caches off: cache_weights=True would hold" in str(report)
    with pytest.raises(TypeError, match="cache_weights: expected a bool, got int"):
        convert_to_fp8(nn.Linear(16, 32), cache_weights=1)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_cached_equals_uncached_gpu(recipe):
    """On the GPU, eagerly and under Inductor: cached equals uncached over micro-batches and steps,
    and a cached compiled step quantizes the weight once per optimizer step."""
    plain, cached = (m.cuda() for m in _pair(recipe, K=1024, N=512))

    def train(module, steps=2, mb=3):
        g = torch.Generator(device="cuda").manual_seed(7)
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        seen = []
        for _ in range(steps):
            for _ in range(mb):
                x = torch.randn(1000, 1024, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
                y = module(x)
                y.backward(torch.randn(y.shape, device="cuda", generator=g, dtype=y.dtype))
                seen += [y.detach(), x.grad]
            seen += [p.grad.clone() for p in module.parameters()]
            opt.step()
            opt.zero_grad()
        return seen

    _equal(train(plain), train(cached))
    plain_c, cached_c = _pair(recipe, K=1024, N=512, seed=8)
    plain_c, cached_c = plain_c.cuda(), cached_c.cuda()
    torch._dynamo.reset()
    want = train(torch.compile(plain_c, fullgraph=True))
    cache = compiled_weight_cache()
    misses = cache.misses
    got = train(torch.compile(cached_c, fullgraph=True))
    _equal(want, got)
    assert cache.misses - misses == 3


def test_copies_and_pickles_start_with_empty_caches():
    """``copy.deepcopy`` and ``torch.save`` of a whole module after a forward: the copy holds no FP8
    copies of the original's weights (keyed on their identities, they could never hit), and pickling
    does not fail on the cache's weak references; the copies compute the same outputs."""
    import copy
    import io

    from moe_fp8 import FP8MoE

    torch.manual_seed(9)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    for module in (FP8Linear(64, 48, dtype=torch.bfloat16, cache_weights=True),
                   FP8MoE(64, 32, 4, 2, dtype=torch.bfloat16, cache_weights=True)):
        module(x)
        want = module(x)  # the second forward of the same weights keeps their copies
        caches = [c for m in module.modules() for c in (getattr(m, "_caches", None) or [getattr(m, "_cache", None)])
                  if c is not None]
        assert caches and all(len(c) == 1 for c in caches)
        buf = io.BytesIO()
        torch.save(module, buf)
        buf.seek(0)
        for twin in (copy.deepcopy(module), torch.load(buf, weights_only=False)):
            twin_caches = [c for m in twin.modules()
                           for c in (getattr(m, "_caches", None) or [getattr(m, "_cache", None)]) if c is not None]
            assert len(twin_caches) == len(caches) and all(len(c) == 0 for c in twin_caches)
            assert torch.equal(twin(x), want)
