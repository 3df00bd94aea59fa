"""``fused_grad_accumulation``: under gradient accumulation the experts' weight-gradient GEMMs add to
``.grad`` in place (``moe_fp8/grouped_gemm/grad_accumulation.py``). The sums equal autograd's to
within the one rounding they save, against an fp64 sum of the micro-batches' gradients, for every
recipe, both weight layouts and the kernel (interpreter) and reference (emulated) paths; autograd
adds nothing once ``.grad`` exists; the contract is enforced eagerly; a compiled module and an
activation-checkpointed one give the plain eager module's bits; a DDP forward, hooked weights,
``torch.autograd.grad`` and ``backward(inputs=...)`` keep autograd's path."""

import pytest
import torch

from moe_fp8 import fp8_grouped_mm
from moe_fp8.kernel_backend import interpreter_enabled
from moe_fp8.layers.experts import FP8GroupedExperts
from moe_fp8.testing import ulp

T, H, I, E, K = 40, 32, 16, 6, 2
MICRO_BATCHES = 3
NEEDS_INTERPRETER = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1")
BACKENDS = ["emulated", pytest.param("triton", marks=NEEDS_INTERPRETER)]


def _experts(fused: bool, recipe: str, backend: str, in_out: bool = False, dtype=torch.bfloat16) -> FP8GroupedExperts:
    torch.manual_seed(0)
    return FP8GroupedExperts(E, H, I, recipe=recipe, backend=backend, in_out_layout=in_out,
                             fused_grad_accumulation=fused, dtype=dtype)


def _micro_batch(i: int):
    """Tokens, ids and weights of micro-batch ``i``; the last two experts get no token."""
    g = torch.Generator().manual_seed(10 + i)
    x = torch.randn(T, H, generator=g).bfloat16()
    return x, torch.randint(0, E - 2, (T, K), generator=g), torch.rand(T, K, generator=g)


def _backward(module: torch.nn.Module, i: int) -> None:
    module(*_micro_batch(i)).float().square().sum().backward()


@pytest.fixture
def in_place_adds(monkeypatch) -> list:
    """One entry per weight gradient a GEMM added to ``.grad`` in place (``library.mm_2d2d_into`` calls)."""
    from moe_fp8.grouped_gemm import library

    adds = []
    add = library.mm_2d2d_into
    monkeypatch.setattr(library, "mm_2d2d_into", lambda *args: adds.append(1) or add(*args))
    return adds


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp", "tensorwise", "bf16"])
@pytest.mark.parametrize("in_out", [False, True])
def test_fused_sum_matches_the_fp64_sum_of_micro_batches(recipe, backend, in_out):
    fused, plain = _experts(True, recipe, backend, in_out), _experts(False, recipe, backend, in_out)
    parts = {name: [] for name, _ in plain.named_parameters()}
    for i in range(MICRO_BATCHES):
        _backward(fused, i)
        _backward(plain, i)
        for name, p in plain.named_parameters():
            parts[name].append(p.grad.double())
            p.grad = None
    for name, p in fused.named_parameters():
        reference = sum(parts[name])
        diff = (p.grad.double() - reference).abs()
        # the fused sum rounds once per micro-batch, to the partial sum's bf16 grid; the gradients it
        # adds are the unrounded fp32 products of the micro-batches' bf16 gradients: half an ulp each
        partial = torch.cumsum(torch.stack(parts[name]), 0)
        bound = sum(ulp(t, torch.bfloat16).double() for t in (*partial, *parts[name]))
        assert bool((diff <= bound).all()), (name, float(diff.max()))
        assert bool((p.grad[-2:] == 0).all())  # the experts no token reached
        assert float(reference[:-2].abs().max()) > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", ["rowwise", "bf16"])
def test_fp16_weights_sum_on_their_grid(recipe, backend, in_place_adds):
    """fp16 weights: the kernel adds to an fp16 ``.grad`` (rounded to fp16 once per micro-batch),
    against the fp64 sum of the micro-batches' fp16 gradients."""
    fused, plain = (_experts(f, recipe, backend, dtype=torch.float16) for f in (True, False))
    parts = {name: [] for name, _ in plain.named_parameters()}
    for i in range(MICRO_BATCHES):
        x, ids, weights = _micro_batch(i)
        for module in (fused, plain):
            module(x.half(), ids, weights).float().square().sum().backward()
        for name, p in plain.named_parameters():
            parts[name].append(p.grad.double())
            p.grad = None
    for name, p in fused.named_parameters():
        assert p.grad.dtype == torch.float16
        reference = sum(parts[name])
        partial = torch.cumsum(torch.stack(parts[name]), 0)
        bound = sum(ulp(t, torch.float16).double() for t in (*partial, *parts[name]))
        diff = (p.grad.double() - reference).abs()
        assert bool((diff <= bound).all()), (name, float(diff.max()))
        assert float(reference.abs().max()) > 0
    # gate_up_proj's gradients after the first; down_proj enters its GEMM cast to the bf16 the first
    # GEMM writes, so its gradients take autograd's path
    assert len(in_place_adds) == MICRO_BATCHES - 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemms_add_once_grad_exists(backend, in_place_adds):
    """The first micro-batch's gradient goes through autograd (``.grad`` is None); the GEMMs add the
    later ones into the same tensor, one add per weight and micro-batch (that autograd adds nothing
    besides, the sums against fp64 above show)."""
    counts = {}
    for fused in (False, True):
        module = _experts(fused, "rowwise_gw_hp", backend)
        first = {}
        for i in range(MICRO_BATCHES):
            _backward(module, i)
            first = first or {id(p): p.grad for p in module.parameters()}
        assert all(p.grad is first[id(p)] for p in module.parameters())
        counts[fused] = len(in_place_adds) - sum(counts.values())
    assert counts == {False: 0, True: 2 * (MICRO_BATCHES - 1)}


@pytest.mark.parametrize("replacement", ["none", "new tensor"])
def test_grad_replaced_between_forward_and_backward_takes_autograd_path(replacement):
    """Eagerly, a ``.grad`` set to ``None`` or replaced between a forward and its backward gets that
    backward's gradient through autograd, as the plain module's does; the old ``.grad`` is left alone."""
    fused, plain = _experts(True, "rowwise", "emulated"), _experts(False, "rowwise", "emulated")
    for module in (fused, plain):
        _backward(module, 0)
    old = fused.gate_up_proj.grad.clone()
    held = fused.gate_up_proj.grad
    outs = [module(*_micro_batch(1)) for module in (fused, plain)]
    for module in (fused, plain):
        for p in module.parameters():
            p.grad = None if replacement == "none" else torch.full_like(p, 0.5)
    for out in outs:
        out.float().square().sum().backward()
    for p, q in zip(fused.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert torch.equal(held, old)


def test_in_place_zeroing_keeps_the_gemms_adding():
    """``zero_grad(set_to_none=False)``: every micro-batch after the first step's first one adds to the
    zeroed tensors; a second optimizer step equals a fresh module's first."""
    module, fresh = _experts(True, "rowwise", "emulated"), _experts(True, "rowwise", "emulated")
    for i in range(MICRO_BATCHES):
        _backward(module, i)
    module.zero_grad(set_to_none=False)
    for i in range(MICRO_BATCHES):
        _backward(module, i)
        _backward(fresh, i)
    for p, q in zip(module.parameters(), fresh.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_takes_autograd_path_where_it_must(in_place_adds):
    """fp32 weights cast to the GEMMs' bf16 (autocast), fp32 GEMMs, grad mode off, a module FSDP2
    manages: no ``.grad`` is written in place, and the gradients still arrive."""
    module = _experts(True, "rowwise", "emulated", dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for i in range(2):
            _backward(module, i)
    plain = _experts(False, "rowwise", "emulated", dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for i in range(2):
            _backward(plain, i)
    for p, q in zip(module.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)
    fp32, plain = _experts(True, "rowwise", "emulated", dtype=torch.float32), _experts(False, "rowwise", "emulated",
                                                                                        dtype=torch.float32)
    for i in range(2):  # fp32 GEMMs (the emulated backend takes them): fp32 gradients, autograd's path
        for m in (fp32, plain):
            x, ids, weights = _micro_batch(i)
            m(x.float(), ids, weights).square().sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(fp32.parameters(), plain.parameters()))
    module = _experts(True, "rowwise", "emulated")
    _backward(module, 0)
    before = [p.grad.clone() for p in module.parameters()]
    with torch.no_grad():
        module(*_micro_batch(1))
    assert all(torch.equal(p.grad, b) for p, b in zip(module.parameters(), before))
    module._is_fsdp_managed_module = True  # FSDP2's mark: its gathered weights' gradients go through autograd
    _backward(module, 1)
    assert in_place_adds == []


def test_grad_into_argument_checks():
    x, w = torch.randn(8, 32).bfloat16(), torch.randn(2, 16, 32).bfloat16()
    offs = torch.tensor([3, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match="grad_into"):
        fp8_grouped_mm(x, w, offs, backend="emulated", grad_into=torch.zeros(2, 16, 32))
    with pytest.raises(ValueError, match="grad_into"):
        fp8_grouped_mm(x, w, offs, backend="emulated", grad_into=torch.zeros(2, 32, 16).bfloat16())


@pytest.mark.parametrize(("backend", "in_out"), [("emulated", False), ("emulated", True),
                                                  pytest.param("triton", False, marks=NEEDS_INTERPRETER)])
def test_compiled_module_gives_the_eager_bits(backend, in_out):
    """``torch.compile`` (aot_eager: the graphs AOTAutograd traces, with the in-place add in the
    backward graph; ``in_out``: into a transposed view of ``.grad``): two optimizer steps of 3
    micro-batches, gradients bit for bit the eager module's."""
    eager, compiled = (_experts(True, "rowwise_gw_hp", backend, in_out) for _ in range(2))
    run = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    for _ in range(2):
        for i in range(MICRO_BATCHES):
            eager(*_micro_batch(i)).float().square().sum().backward()
            run(*_micro_batch(i)).float().square().sum().backward()
        for p, q in zip(eager.parameters(), compiled.parameters()):
            assert torch.equal(p.grad, q.grad)
        eager.zero_grad()
        compiled.zero_grad()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp", "bf16"])
@pytest.mark.parametrize("compiled", [False, True])
def test_fused_sum_on_gpu(recipe, compiled):
    """The platform's backend, eager and under Inductor, Qwen3-30B-A3B-sized experts (64 of them, a
    quarter without tokens): 3 micro-batches summed by the GEMMs against the fp64 sum of the plain
    module's per-micro-batch gradients (compiled alike): within the roundings the fused sum makes
    where both paths run the same arithmetic (eager, BF16 weight gradient); else (an FP8
    weight-gradient GEMM of another library; Inductor fusing the two backward graphs differently)
    within 2^-8 of the reference's norm per parameter."""
    E_, H_, I_, T_ = 64, 2048, 768, 2048
    torch._dynamo.reset()  # two modules, two graphs each (before and after a .grad exists), per recipe
    torch.manual_seed(0)
    fused = FP8GroupedExperts(E_, H_, I_, recipe=recipe, fused_grad_accumulation=True, device="cuda",
                              dtype=torch.bfloat16)
    plain = FP8GroupedExperts(E_, H_, I_, recipe=recipe, device="cuda", dtype=torch.bfloat16)
    plain.load_state_dict(fused.state_dict())
    run, run_plain = (torch.compile(m, fullgraph=True) if compiled else m for m in (fused, plain))
    g = torch.Generator(device="cuda").manual_seed(1)
    parts = {name: [] for name, _ in plain.named_parameters()}
    for _ in range(MICRO_BATCHES):
        x = torch.randn(T_, H_, device="cuda", generator=g, dtype=torch.bfloat16)
        ids = torch.randint(0, 3 * E_ // 4, (T_, 8), device="cuda", generator=g)
        weights = torch.rand(T_, 8, device="cuda", generator=g)
        run(x, ids, weights).float().square().mean().backward()
        run_plain(x, ids, weights).float().square().mean().backward()
        for name, p in plain.named_parameters():
            parts[name].append(p.grad.double())
            p.grad = None
    for name, p in fused.named_parameters():
        reference = sum(parts[name])
        partial = torch.cumsum(torch.stack(parts[name]), 0)
        diff = (p.grad.double() - reference).abs()
        if compiled or recipe == "rowwise":
            assert float(diff.norm() / reference.norm()) <= 2.0**-8, (name, float(diff.norm() / reference.norm()))
        else:
            bound = sum(ulp(t, torch.bfloat16).double() for t in (*partial, *parts[name]))
            # the GPU GEMMs sum in another order than each other: a few fp32 roundings more
            assert bool((diff <= bound + 1e-6 * reference.abs()).all()), name
        assert bool((p.grad[3 * E_ // 4:] == 0).all())


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_the_same_bits(reentrant, in_place_adds):
    """Under activation checkpointing (the forward recomputed in the backward, where the GEMMs take
    ``.grad`` again), both checkpoint implementations: the same gradient bits as the module without
    it, the GEMMs adding each weight's gradient once per micro-batch after the first."""
    plain, checkpointed = (_experts(True, "rowwise", "emulated") for _ in range(2))
    for i in range(MICRO_BATCHES):
        _backward(plain, i)
        x, ids, weights = _micro_batch(i)
        x.requires_grad_(reentrant)  # the reentrant form needs an input that requires grad
        out = torch.utils.checkpoint.checkpoint(checkpointed, x, ids, weights, use_reentrant=reentrant)
        out.float().square().sum().backward()
    for p, q in zip(plain.parameters(), checkpointed.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert float(plain.gate_up_proj.grad.abs().max()) > 0
    # two weights, two modules, micro-batches 2 and 3: the first one's gradients pass through autograd
    assert len(in_place_adds) == 2 * 2 * (MICRO_BATCHES - 1)


@pytest.mark.parametrize("hook", ["tensor", "post_accumulate_grad"])
def test_hooked_weight_takes_autograd_path(hook, in_place_adds):
    """Eagerly, a weight with a tensor hook or a post-accumulate-grad hook gets every micro-batch's
    gradient through autograd: its hook runs once per backward and sees the plain module's bits, its
    sum is the plain module's, and the GEMMs add only the other weight's gradients. With the hook
    removed they add both again."""
    fused, plain = _experts(True, "rowwise", "emulated"), _experts(False, "rowwise", "emulated")
    seen = {"fused": [], "plain": []}
    handles = []
    for name, module in (("fused", fused), ("plain", plain)):
        w = module.gate_up_proj
        if hook == "tensor":
            handles.append(w.register_hook(lambda g, s=seen[name]: s.append(g.clone())))
        else:
            handles.append(w.register_post_accumulate_grad_hook(lambda p, s=seen[name]: s.append(p.grad.clone())))
    for i in range(MICRO_BATCHES):
        _backward(fused, i)
        _backward(plain, i)
    assert len(seen["fused"]) == MICRO_BATCHES
    assert all(torch.equal(a, b) for a, b in zip(seen["fused"], seen["plain"]))
    assert torch.equal(fused.gate_up_proj.grad, plain.gate_up_proj.grad)
    assert len(in_place_adds) == MICRO_BATCHES - 1  # down_proj's
    handles[0].remove()
    _backward(fused, 0)
    assert len(in_place_adds) == MICRO_BATCHES + 1


def test_ddp_forward_takes_autograd_path(tmp_path, in_place_adds):
    """Inside a ``DistributedDataParallel`` forward (gloo, one process) the weight gradients pass
    through autograd, where DDP's reducer takes them: no GEMM adds in place, and the sum is the plain
    module's bit for bit. Outside DDP the same module fuses."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        fused, plain = _experts(True, "rowwise", "emulated"), _experts(False, "rowwise", "emulated")
        ddp = DistributedDataParallel(fused)
        for i in range(MICRO_BATCHES):
            _backward(ddp, i)
            _backward(plain, i)
        assert in_place_adds == []
        for p, q in zip(fused.parameters(), plain.parameters()):
            assert torch.equal(p.grad, q.grad)
        _backward(fused, 0)  # outside DDP, with .grad held: added by the GEMMs
        assert len(in_place_adds) == 2
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_that_does_not_accumulate_takes_autograd_path(backend):
    """With ``.grad`` held, a backward that does not accumulate into it leaves it alone and hands
    autograd the gradient: ``torch.autograd.grad`` returns the plain module's bits, and
    ``backward(inputs=[x])`` changes no weight's ``.grad``."""
    fused, plain = _experts(True, "rowwise", backend), _experts(False, "rowwise", backend)
    _backward(fused, 0)
    held = [p.grad.clone() for p in fused.parameters()]
    ours = torch.autograd.grad(fused(*_micro_batch(1)).float().square().sum(), list(fused.parameters()))
    theirs = torch.autograd.grad(plain(*_micro_batch(1)).float().square().sum(), list(plain.parameters()))
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    x, ids, weights = _micro_batch(2)
    x.requires_grad_(True)
    fused(x, ids, weights).float().square().sum().backward(inputs=[x])
    assert x.grad is not None and float(x.grad.abs().max()) > 0
    for p, before in zip(fused.parameters(), held):
        assert torch.equal(p.grad, before)
