"""quantize_after_step: the optimizer step fills the FP8 expert-weight caches, the next forward and
backward hit them, and every result equals the uncached module's bit for bit."""

import pytest
import torch

from torch import nn

from moe_fp8 import FP8GroupedExperts
from moe_fp8.grouped_gemm import compiled_weight_cache, library
from moe_fp8.optim import quantize_after_step
from moe_fp8.testing import dirty_allocator

T, H, I, E, K = 24, 64, 32, 4, 2
_WEIGHT_QUANTIZERS = ("quantize_weight", "quantize_weight_forward_layout", "quantize_weight_dgrad_layout")


@pytest.fixture
def weight_quantizations(monkeypatch):
    """A list that gets one entry per weight quantization (any layout) the grouped GEMM makes, and
    ``"step"`` where an optimizer step begins (:func:`_mark_steps`)."""
    calls = []
    for name in _WEIGHT_QUANTIZERS:
        real = getattr(library, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(library, name, counted)
    return calls


class _Block(nn.Module):
    """A linear top-k softmax router and ``FP8GroupedExperts`` (cached unless told): the smallest
    trainable MoE block."""

    def __init__(self, cache_weights: bool = True, **kw):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = FP8GroupedExperts(E, H, I, cache_weights=cache_weights, **kw)

    def forward(self, x):
        weights, ids = torch.softmax(self.router(x).float(), -1).topk(K, dim=-1)
        return self.experts(x, ids, weights.to(x.dtype))


def _mark_steps(opt, calls):
    opt.register_step_pre_hook(lambda *args: calls.append("step"))


def _pair(dtype=torch.bfloat16, seed=0, **kw):
    """Two identical MoE blocks: weight cache on (hooked) and off (the plain path)."""
    torch.manual_seed(seed)
    hooked = _Block(**kw).to(dtype)
    plain = _Block(cache_weights=False, **kw).to(dtype)
    plain.load_state_dict(hooked.state_dict())
    return hooked, plain


def _step(moe, opt, xs, dy, autocast=False):
    """One optimizer step over the micro-batches ``xs``; returns the outputs and the gradients."""
    opt.zero_grad()
    outs = []
    for x in xs:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = moe(x)
        out.backward(dy.to(out.dtype))
        outs.append(out)
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}
    opt.step()
    return outs, grads


def _assert_same(a, b):
    (outs_a, grads_a), (outs_b, grads_b) = a, b
    assert all(torch.equal(x, y) for x, y in zip(outs_a, outs_b))
    for name, g in grads_a.items():
        assert torch.equal(g, grads_b[name]), name


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype, autocast, in_out_layout", [
    (torch.bfloat16, False, False),
    (torch.float32, True, True),  # the entries quantize p.to(bf16) of transposed views
])
def test_next_step_hits_and_equals_the_plain_path(weight_quantizations, dtype, autocast, in_out_layout):
    hooked, plain = _pair(dtype, in_out_layout=in_out_layout)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (hooked, plain)]
    quantize_after_step(opts[0], hooked)
    _mark_steps(opts[0], weight_quantizations)
    xs = [torch.randn(T, H).to(dtype)]
    dy = torch.randn(T, H)
    caches = hooked.experts._caches
    # the first forward misses and keeps nothing (bf16 parameters: forward layouts in the forward,
    # down_proj's dgrad layout in the backward (x takes no gradient); fp32 ones, cast: both in the
    # forward); from then on, forward and backward quantize nothing: the step does
    first = (["quantize_weight"] * 2 if dtype == torch.float32
             else ["quantize_weight_forward_layout"] * 2 + ["quantize_weight_dgrad_layout"])
    for step in range(2):
        before = len(weight_quantizations)
        got = _step(hooked, opts[0], xs, dy, autocast)
        fwd_bwd = first if step == 0 else []
        assert weight_quantizations[before:] == [*fwd_bwd, "step", "quantize_weight", "quantize_weight"]
        assert all((c.hits, c.misses) == (step, 1) for c in caches), caches
        _assert_same(got, _step(plain, opts[1], xs, dy, autocast))
    for name, p in hooked.named_parameters():
        assert torch.equal(p, dict(plain.named_parameters())[name]), name


@pytest.mark.interpreter
def test_write_after_the_step_misses_and_state_dict_load_misses():
    hooked, plain = _pair()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (hooked, plain)]
    quantize_after_step(opts[0], hooked)
    xs, dy = [torch.randn(T, H).to(torch.bfloat16)], torch.randn(T, H)
    for m, opt in zip((hooked, plain), opts):
        _step(m, opt, xs, dy)
        with torch.no_grad():
            m.experts.gate_up_proj.add_(0.01)  # after the hook: its entry is stale
    caches = hooked.experts._caches
    got = _step(hooked, opts[0], xs, dy)
    assert (caches[0].misses, caches[1].misses) == (2, 1), caches
    _assert_same(got, _step(plain, opts[1], xs, dy))
    dirty_allocator()
    torch.manual_seed(1)
    other = _Block().to(torch.bfloat16)
    for m in (hooked, plain):  # copy_ under no_grad: both weights change after the step
        m.load_state_dict(other.state_dict())
    got = _step(hooked, opts[0], xs, dy)
    assert (caches[0].misses, caches[1].misses) == (3, 2), caches
    _assert_same(got, _step(plain, opts[1], xs, dy))


@pytest.mark.interpreter
def test_gradient_accumulation_and_a_param_group_added_later(weight_quantizations):
    hooked, plain = _pair(seed=2)
    opts = []
    for m in (hooked, plain):  # the experts join the optimizer through add_param_group
        opt = torch.optim.SGD(m.router.parameters(), lr=0.1)
        opt.add_param_group({"params": list(m.experts.parameters()), "lr": 0.3})
        opts.append(opt)
    quantize_after_step(opts[0], hooked)
    _mark_steps(opts[0], weight_quantizations)
    xs = [torch.randn(T, H).to(torch.bfloat16) for _ in range(2)]
    dy = torch.randn(T, H)
    _step(hooked, opts[0], xs, dy)
    plain.load_state_dict(hooked.state_dict())  # SGD keeps no state: the plain twin starts here
    before = len(weight_quantizations)
    got = _step(hooked, opts[0], xs, dy)
    assert weight_quantizations[before:] == ["step", "quantize_weight", "quantize_weight"]
    # the first step: the first micro-batch keeps nothing, the second keeps; the second step hits twice
    assert all((c.hits, c.misses) == (2, 2) for c in hooked.experts._caches)
    _assert_same(got, _step(plain, opts[1], xs, dy))


@pytest.mark.interpreter
def test_frozen_weights_keep_their_entries(weight_quantizations):
    hooked, _ = _pair()
    hooked.experts.down_proj.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in hooked.parameters() if p.requires_grad], lr=1e-2)
    quantize_after_step(opt, hooked)
    _mark_steps(opt, weight_quantizations)
    xs, dy = [torch.randn(T, H).to(torch.bfloat16)], torch.randn(T, H)
    _step(hooked, opt, xs, dy)
    before = len(weight_quantizations)
    _step(hooked, opt, xs, dy)  # down_proj's second forward in the same state keeps it
    assert weight_quantizations[before:] == ["quantize_weight", "step", "quantize_weight"]
    before = len(weight_quantizations)
    _step(hooked, opt, xs, dy)
    assert weight_quantizations[before:] == ["step", "quantize_weight"]  # gate_up only: down_proj did not change


def test_bad_arguments():
    moe = _Block()
    opt = torch.optim.SGD(moe.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="optimizer"):
        quantize_after_step(moe, moe)
    with pytest.raises(ValueError, match="cache_weights=False"):
        quantize_after_step(opt, _Block(cache_weights=False))
    with pytest.raises(ValueError, match="FP8GroupedExperts"):
        quantize_after_step(opt, torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="model"):
        quantize_after_step(opt, "model")
    bf16 = _Block(recipe="bf16")
    handle = quantize_after_step(torch.optim.SGD(bf16.parameters(), lr=0.1), bf16)  # nothing to quantize
    handle.remove()


@pytest.mark.slow(5)
@pytest.mark.interpreter
@pytest.mark.parametrize("in_out_layout", [False, True])
def test_compiled_module_quantizes_once_per_step(weight_quantizations, in_out_layout):
    """Compiled (aot_eager, full graph): the GEMMs read the compiled cache, which the second forward
    fills (the first keeps nothing) and the hook refreshes; a step of 2 micro-batches, then one
    after a write to a weight after the step (it misses, and keeps the copy as the hook's was
    kept), each equal to the uncached eager module bit for bit (with a transposed weight too, where
    a stale hit would differ)."""
    hooked, plain = _pair(seed=3, in_out_layout=in_out_layout)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (hooked, plain)]
    quantize_after_step(opts[0], hooked)
    _mark_steps(opts[0], weight_quantizations)
    compiled = torch.compile(hooked, fullgraph=True, backend="aot_eager")
    xs, dy = [torch.randn(16, H).to(torch.bfloat16) for _ in range(2)], torch.randn(16, H)
    cache = compiled_weight_cache()
    misses = cache.misses
    got = _step(compiled, opts[0], xs, dy)
    want_calls = ["quantize_weight"] * 2 + ["step", "quantize_weight", "quantize_weight"]
    if not in_out_layout:  # aot_eager hands the backward a new alias of a transposed weight: it misses
        assert weight_quantizations == want_calls and cache.misses - misses == 4
    _assert_same(got, _step(plain, opts[1], xs, dy))
    assert all(len(c) == 0 for c in hooked.experts._caches)
    assert len(cache.keys(hooked.experts._weights()[0])) == 1
    weight_bytes = sum(p.numel() for p in hooked.experts.parameters())  # one FP8 byte per element and layout
    assert 2 * weight_bytes < hooked.experts.weight_cache_nbytes < 2 * weight_bytes * 1.1
    for m in (hooked, plain):
        with torch.no_grad():
            m.experts.down_proj.mul_(-0.5)  # after the hook: its entry is stale, gate_up's is not
    before = len(weight_quantizations)
    got = _step(compiled, opts[0], xs[:1], dy)
    if not in_out_layout:
        assert weight_quantizations[before:] == ["quantize_weight", "step", "quantize_weight", "quantize_weight"]
    _assert_same(got, _step(plain, opts[1], xs[:1], dy))


def test_cache_refresh_put_and_keys():
    """Fp8WeightCache's step-side API on its own: refresh re-quantizes stale entries only (views by
    their geometry), put stores a value a later get serves, keys lists what an entry was made with."""
    from moe_fp8.grouped_gemm import Fp8WeightCache

    cache, made = Fp8WeightCache(), []

    def quantize(t):
        made.append(t.shape)
        return (t * 2,)

    w = torch.randn(2, 8, 4)
    view = w.transpose(1, 2)
    cache.get(view, "k", quantize)
    cache.get(w, "k", quantize)
    assert cache.refresh() == 0 and len(made) == 2  # nothing changed
    assert cache.keys(view) == [(torch.float32, "k")] and cache.keys(w[:1]) == []
    w.add_(1.0)
    assert cache.refresh() == 2 and made[2:] == [torch.Size([2, 4, 8]), torch.Size([2, 8, 4])]
    assert torch.equal(cache.get(view, "k", quantize)[0], view * 2) and cache.misses == 2
    w.mul_(3.0)
    cache.put(w, torch.float32, "k", (w + 5,))
    assert torch.equal(cache.get(w, "k", quantize)[0], w + 5)  # a hit on what put stored
    assert cache.refresh() == 1 and len(made) == 5  # the view only; put's entry is current
    w.add_(1.0)
    assert cache.refresh() == 2  # put kept the replaced entry's quantizer
    del w, view
    assert len(cache) == 0 and cache.refresh() == 0
