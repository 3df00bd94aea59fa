"""Linears of one input: ``fp8_linears_shared_input`` (x quantized once) against one ``fp8_linear`` per weight, and
``SharedInput`` (the ``FP8Linear`` layers a model calls on one tensor) with its fallbacks."""

import pytest
import torch
from torch import nn

from moe_fp8 import FP8Linear
from moe_fp8.layers import shared_input as si
from moe_fp8.layers.fp8_linear import fp8_linear, fp8_linears_shared_input
from moe_fp8.layers.shared_input import SharedInput
from moe_fp8.testing import dirty_allocator
from moe_fp8.testing.launches import count_launches

K = 64
NS = (48, 32, 32)


def _data(M, ns=NS, k=K, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, k, generator=g).to(torch.bfloat16)
    ws = [(torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16) for n in ns]
    bs = [torch.randn(n, generator=g).to(torch.bfloat16) for n in ns]
    dys = [torch.randn(M, n, generator=g).to(torch.bfloat16) for n in ns]
    return x, ws, bs, dys


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def _separate(x, ws, bs, dys, recipe):
    """Outputs and gradients of one ``fp8_linear`` per weight; x's gradient summed in member order."""
    outs, gx, gws, gbs = [], None, [], []
    for w, b, dy in zip(ws, bs, dys):
        xi, wi, bi = _leaves(x, w, b)
        y = fp8_linear(xi, wi, bi, recipe=recipe)
        y.backward(dy)
        outs.append(y)
        gx = xi.grad if gx is None else gx + xi.grad
        gws.append(wi.grad)
        gbs.append(bi.grad)
    return outs, gx, gws, gbs


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp", "tensorwise"])
@pytest.mark.parametrize("M", [40, 3, 64])  # token counts not multiples of 16 pad the wgrad operands
def test_fp8_linears_equal_one_linear_per_weight(recipe, M):
    """Outputs, weight and bias gradients bit for bit those of separate ``fp8_linear`` calls (on the
    CPU under the interpreter: the same kernels); x's gradient the sum of theirs, in member order."""
    x, ws, bs, dys = _data(M)
    want = _separate(x, ws, bs, dys, recipe)
    xi, *leaves = _leaves(x, *ws, *bs)
    outs = fp8_linears_shared_input(xi, leaves[:3], leaves[3:], recipe=recipe)
    torch.autograd.backward(outs, dys)
    assert all(torch.equal(o, w) for o, w in zip(outs, want[0]))
    assert torch.equal(xi.grad, want[1])
    assert all(torch.equal(w.grad, g) for w, g in zip(leaves[:3], want[2]))
    assert all(torch.equal(b.grad, g) for b, g in zip(leaves[3:], want[3]))


def test_fp8_linears_weight_of_rows_too_long_for_the_column_amax():
    """A first weight of 16400 output rows (its gradient's rows too long for the column-amax path)
    beside one that takes it: ``x.T`` is made from x's column amax by the first weight gradient, and
    everything equals separate layers bit for bit."""
    x, ws, bs, dys = _data(40, (16400, 32))
    want = _separate(x, ws, bs, dys, "rowwise")
    xi, *leaves = _leaves(x, *ws, *bs)
    outs = fp8_linears_shared_input(xi, leaves[:2], leaves[2:], recipe="rowwise")
    torch.autograd.backward(outs, dys)
    assert torch.equal(xi.grad, want[1])
    assert all(torch.equal(w.grad, g) for w, g in zip(leaves[:2], want[2]))


def test_fp8_linears_some_outputs_without_gradient():
    """Outputs the loss does not read add nothing: the other weights' gradients and x's are those of
    the used outputs alone; the unused weight gets none."""
    x, ws, bs, dys = _data(40)
    want = _separate(x, ws[::2], bs[::2], dys[::2], "rowwise")
    xi, *w = _leaves(x, *ws)
    outs = fp8_linears_shared_input(xi, w, recipe="rowwise")
    torch.autograd.backward([outs[0], outs[2]], [dys[0], dys[2]])
    assert w[1].grad is None
    assert torch.equal(w[0].grad, want[2][0]) and torch.equal(w[2].grad, want[2][1])
    assert torch.equal(xi.grad, want[1])  # x's gradient from the two used outputs


def test_fp8_linears_empty_batch():
    """No tokens: empty outputs, zero weight gradients (not memory an empty reduction left)."""
    dirty_allocator()
    x, ws, _, dys = _data(0)
    xi, *w = _leaves(x, *ws)
    outs = fp8_linears_shared_input(xi, w, recipe="rowwise")
    assert [tuple(o.shape) for o in outs] == [(0, n) for n in NS]
    torch.autograd.backward(outs, dys)
    assert all(g.grad is not None and not g.grad.any() for g in w)


def test_fp8_linears_rejects_bad_arguments():
    x, ws, bs, _ = _data(8)
    with pytest.raises(ValueError, match="weights: expected at least one"):
        fp8_linears_shared_input(x, [])
    with pytest.raises(ValueError, match="biases: expected 3 entries"):
        fp8_linears_shared_input(x, ws, bs[:2])
    with pytest.raises(ValueError, match="in_features"):
        fp8_linears_shared_input(x, [ws[0], torch.zeros(32, 48, dtype=torch.bfloat16)])
    with pytest.raises(TypeError, match="weight_cache: expected Fp8WeightCache"):
        fp8_linears_shared_input(x, ws, weight_caches=[None, object(), None])


class _Attention(nn.Module):
    """Calls its three projections on one tensor, as a Hugging Face attention does."""

    def __init__(self, order=("q_proj", "k_proj", "v_proj"), recipe="rowwise"):
        super().__init__()
        torch.manual_seed(0)
        self.q_proj, self.k_proj, self.v_proj = (FP8Linear(K, n, bias=i == 0, recipe=recipe, dtype=torch.bfloat16)
                                                 for i, n in enumerate(NS))
        self.order = order

    def forward(self, x):
        outs = {name: getattr(self, name)(x) for name in self.order}
        return torch.cat([outs["q_proj"], outs["k_proj"], outs["v_proj"]], dim=-1)


def _run(fn, x, dy, module=None):
    module = fn if module is None else module
    module.zero_grad()
    xi = x.detach().clone().requires_grad_()
    y = fn(xi)
    y.backward(dy)
    return y, xi.grad, [p.grad for p in module.parameters()]


def _grouped(order=("q_proj", "k_proj", "v_proj"), recipe="rowwise"):
    m = _Attention(order, recipe)
    SharedInput([m.q_proj, m.k_proj, m.v_proj], m)
    return m


def _count_group_runs(monkeypatch) -> list:
    runs = []
    real = si.fp8_linears_shared_input

    def counting(x, weights, *args, **kwargs):
        runs.append(len(weights))
        return real(x, weights, *args, **kwargs)

    monkeypatch.setattr(si, "fp8_linears_shared_input", counting)
    return runs


@pytest.mark.parametrize("order", [("q_proj", "k_proj", "v_proj"), ("v_proj", "q_proj", "k_proj")])
def test_shared_input_runs_the_members_together(order, monkeypatch):
    """One ``fp8_linears_shared_input`` call per forward whichever member is called first; the outputs and weight
    gradients of the ungrouped layers bit for bit, x's gradient to bf16 rounding (summed in another
    order)."""
    x, _, _, _ = _data(40)
    dy = torch.randn(40, sum(NS)).to(torch.bfloat16)
    want = _run(_Attention(order), x, dy)
    runs = _count_group_runs(monkeypatch)
    got = _run(_grouped(order), x, dy)
    assert runs == [3]
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-2, atol=1e-2)
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))


def test_shared_input_falls_back_where_the_input_differs(monkeypatch):
    """A member called on another tensor (or on the same one after an in-place write) runs the group
    on it and gives its own output; a member called twice reruns the group."""
    m = _grouped()
    x = _data(40)[0]
    with torch.no_grad():
        m.q_proj(x)
        other = x + 1
        k_other = m.k_proj(other)  # not the tensor the group ran on: the group runs on it
        m.k_proj.shared_input, saved = None, m.k_proj.shared_input
        assert torch.equal(k_other, m.k_proj(other))
        m.k_proj.shared_input = saved
        y = x.clone()
        m.q_proj(y)
        y.mul_(2)  # written in place after the group ran: the kept outputs are stale
        v = m.v_proj(y)
        m.v_proj.shared_input = None
        assert torch.equal(v, m.v_proj(y))
        m.v_proj.shared_input = saved
    runs = _count_group_runs(monkeypatch)
    with torch.no_grad():
        m.q_proj(x), m.q_proj(x), m.k_proj(x), m.v_proj(x)
    assert runs == [3, 3]  # the second q_proj reran the group; k and v took the second run's outputs


def test_shared_input_skips_weights_it_cannot_read(monkeypatch):
    """A member whose weight is not a plain tensor on the input's device (FSDP's sharded ``DTensor``,
    here a meta tensor) leaves every member to run alone."""
    m = _grouped()
    runs = _count_group_runs(monkeypatch)
    m.v_proj.weight = nn.Parameter(torch.empty(NS[2], K, dtype=torch.bfloat16, device="meta"))
    with torch.no_grad():
        m.q_proj(_data(8)[0])
    assert runs == []


def test_shared_input_rejects_bad_members():
    a, b = FP8Linear(K, 32), FP8Linear(K, 16)
    with pytest.raises(ValueError, match="two or more distinct"):
        SharedInput([a, a])
    with pytest.raises(ValueError, match="one in_features, recipe and fmt"):
        SharedInput([a, FP8Linear(32, 16)])
    with pytest.raises(ValueError, match="one in_features, recipe and fmt"):
        SharedInput([a, FP8Linear(K, 16, recipe="tensorwise")])
    with pytest.raises(TypeError, match="expected FP8Linear"):
        SharedInput([a, nn.Linear(K, 16)])
    SharedInput([a, b])
    with pytest.raises(ValueError, match="one SharedInput at most"):
        SharedInput([a, FP8Linear(K, 16)])


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_shared_input_compiles_fullgraph(recipe):
    """The group traces with torch.compile(fullgraph=True) (aot_eager on CPU) and equals eager."""
    m = _grouped(recipe=recipe)
    x = _data(40)[0]
    dy = torch.randn(40, sum(NS)).to(torch.bfloat16)
    eager = _run(m, x, dy)
    torch._dynamo.reset()
    compiled = _run(torch.compile(m, fullgraph=True, backend="aot_eager"), x, dy)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
    assert all(torch.equal(a, b) for a, b in zip(compiled[2], eager[2]))


def test_shared_input_saves_a_quantization_each_way():
    """Two linears of one input, forward + backward, against two separate layers: one row quantization
    of x fewer (its Triton launch, the zeroing of its column amax, the fill of its one-group offsets)
    and one ``x.T`` operand fewer (the second weight gradient's operand launch takes grad_out alone:
    the same launch count, without the concatenation of two amaxes the two-operand launch reads)."""
    x = _data(40)[0].requires_grad_()

    def count(group: bool):
        torch.manual_seed(0)
        a, b = FP8Linear(K, 48, dtype=torch.bfloat16), FP8Linear(K, 32, dtype=torch.bfloat16)
        if group:
            SharedInput([a, b])
        with count_launches() as n:
            torch.cat([a(x), b(x)], dim=1).float().sum().backward()
        return n

    count(False)  # one-time probes of the CPU GEMM out of the counts
    alone, together = count(False), count(True)
    assert alone.triton - together.triton == 1, (sorted(alone.ops.items()), sorted(together.ops.items()))
    assert alone.total - together.total == 4, (sorted(alone.ops.items()), sorted(together.ops.items()))


@pytest.mark.gpu
@pytest.mark.parametrize("ns", [(4096, 1024, 1024), (14336, 14336), (16400, 512), (512, 16400)])
def test_fp8_linears_equal_one_linear_per_weight_gpu(ns):
    """On the GPU: the shapes of Llama3-8B's q/k/v and gate/up projections (8192 tokens) and a weight
    whose rows are too long for the column-amax path (16400), first or second, bit for bit as in
    the CPU test."""
    x, ws, bs, dys = _data(8192, ns, k=4096)
    x, ws, bs, dys = x.cuda(), [w.cuda() for w in ws], [b.cuda() for b in bs], [d.cuda() for d in dys]
    want = _separate(x, ws, bs, dys, "rowwise")
    xi, *leaves = _leaves(x, *ws, *bs)
    outs = fp8_linears_shared_input(xi, leaves[:len(ns)], leaves[len(ns):], recipe="rowwise")
    torch.autograd.backward(outs, dys)
    assert all(torch.equal(o, w) for o, w in zip(outs, want[0]))
    assert torch.equal(xi.grad, want[1])
    assert all(torch.equal(w.grad, g) for w, g in zip(leaves[:len(ns)], want[2]))
    assert all(torch.equal(b.grad, g) for b, g in zip(leaves[len(ns):], want[3]))


@pytest.mark.parametrize("device, backend", [("cpu", "aot_eager"),
                                             pytest.param("cuda", "inductor", marks=pytest.mark.gpu)])
def test_shared_input_compiles_inside_activation_checkpointing(device, backend):
    """Under torch.compile(fullgraph=True) inside a non-reentrant activation checkpoint of the parent
    (its input made outside the region) the group traces and equals eager: its kept outputs ride on
    the view of the input that the parent's pre-hook made inside. The outputs and weight gradients
    come from the library's kernels: bit for bit. Inductor adds the members' input gradients and
    reduces the bias gradient in fp32 with one rounding (eager rounds each sum to bf16): those agree
    to bf16 rounding there (``aot_eager`` runs eager's ops: bit for bit)."""
    from torch.utils.checkpoint import checkpoint

    m = _grouped().to(device)
    x = _data(40)[0].to(device)
    dy = torch.randn(40, sum(NS)).to(torch.bfloat16).to(device)

    def block(t):
        return checkpoint(m, t * 2, use_reentrant=False)  # exact: Inductor's values equal eager's

    eager = _run(block, x, dy, m)
    torch._dynamo.reset()
    compiled = _run(torch.compile(block, fullgraph=True, backend=backend), x, dy, m)
    assert torch.equal(compiled[0], eager[0])
    grads = list(zip(m.parameters(), compiled[2], eager[2]))
    assert all(torch.equal(got, want) for p, got, want in grads if p.dim() == 2)
    for got, want in [(compiled[1], eager[1])] + [(got, want) for p, got, want in grads if p.dim() == 1]:
        if backend == "aot_eager":
            assert torch.equal(got, want)
        else:  # a missing or doubled term would move them by about the largest value
            assert float((got.float() - want.float()).abs().max()) <= 2**-6 * float(want.float().abs().max())


def test_converters_join_only_known_parents():
    """Siblings are joined in the model classes known to call them on one tensor (``PARENTS``): an
    attention of another class (a cross-attention calls k/v on other states) keeps them apart."""
    from moe_fp8 import convert_to_fp8

    class CrossAttention(_Attention):
        pass

    model = convert_to_fp8(nn.ModuleDict({"a": CrossAttention()}))
    assert all(m.shared_input is None for m in model.modules() if isinstance(m, FP8Linear))
    assert si.sibling_linears(_Attention()) == []


def test_shared_input_with_weight_caches_follows_the_optimizer():
    """Members with ``cache_weights=True``, two micro-batches per step over three AdamW steps: the
    same outputs and weight gradients as members without caches (the caches' layouts follow each
    step's new weights)."""
    x = _data(40)[0]
    dy = torch.randn(40, sum(NS)).to(torch.bfloat16)

    def train(cache: bool):
        m = _grouped()
        for lin in (m.q_proj, m.k_proj, m.v_proj):
            lin.cache_weights = cache
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        seen = []
        for _ in range(3):
            for _ in range(2):
                y = m(x.clone().requires_grad_())
                y.backward(dy)
                seen.append(y.detach())
            seen.extend(p.grad.clone() for p in m.parameters())
            kept = m.q_proj.weight_cache_nbytes  # the layouts the second micro-batch read
            opt.step()
            opt.zero_grad()
        return seen, kept

    (cached, kept), (plain, _) = train(True), train(False)
    assert kept > 0 and len(cached) == len(plain)
    assert all(torch.equal(a, b) for a, b in zip(cached, plain))
