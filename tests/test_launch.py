"""The launch seam (moe_fp8.launch): routing of a launch (traced / interpreted / direct), the direct
launch's cache key against Triton's own specialization, and (on a GPU) the direct launch itself."""

import pytest
import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.jit import JITFunction

from moe_fp8 import launch as launch_mod
from moe_fp8.launch import fast_launch, fast_launch_enabled, launch
from moe_fp8.testing import dirty_allocator
from moe_fp8.testing.launches import count_launches


@triton.jit
def _scaled_copy_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr, NEGATE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask) * scale
    tl.store(out_ptr + offs, -v if NEGATE else v, mask=mask)


def _scaled_copy(x: torch.Tensor, out: torch.Tensor, scale: float, negate: bool, block: int = 32) -> None:
    n = x.numel()
    launch(_scaled_copy_kernel)[(triton.cdiv(n, block),)](x, out, n, scale, BLOCK=block, NEGATE=negate, num_warps=1)


def test_launch_runs_the_kernel_and_is_counted():
    dirty_allocator()
    x = torch.randn(37)
    out = torch.empty(37)
    with count_launches() as n:
        _scaled_copy(x, out, 2.0, True)
    torch.testing.assert_close(out, -2.0 * x, rtol=0, atol=0)
    assert (n.triton, n.torch) == (1, 0), n.ops  # the interpreter's own copies are no kernels of the caller
    assert n.ops == {"triton:_scaled_copy_kernel": 1}


def test_launch_rejects_what_is_not_a_kernel():
    with pytest.raises(TypeError, match="kernel"):
        launch(lambda x: x)
    with pytest.raises(TypeError, match="enabled"):
        with fast_launch(1):
            pass


def test_fast_launch_switch():
    before = fast_launch_enabled()
    with fast_launch(False):
        assert not fast_launch_enabled()
    assert fast_launch_enabled() == before


class _OtherMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_tracing_is_recognised():
    x = torch.ones(4)
    assert not launch_mod._tracing((x, 3), {"BLOCK": 4})
    with count_launches():
        assert not launch_mod._tracing((x,), {})  # the counter launches eagerly
    with _OtherMode():
        assert not launch_mod._tracing((x,), {})  # wrap_triton's operator would raise under it
    _OtherMode.supports_higher_order_operators = True
    try:
        with _OtherMode():
            assert launch_mod._tracing((x,), {})
    finally:
        del _OtherMode.supports_higher_order_operators
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        assert launch_mod._tracing((fake,), {})
    assert launch_mod._tracing((1,), {"x": fake})  # a fake tensor argument outside the mode


def _int_values():
    edges = [-(2**31) - 1, -(2**31), -17, -16, -1, 0, 1, 2, 15, 16, 17, 32, 2**31 - 1, 2**31, 2**31 + 16,
             2**32, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 1]
    return edges + [True, False, 0.0, 1.0, 16.0, -3.5, 1e40, None]


def _tensor_values():
    base = {dt: torch.zeros(64, dtype=dt) for dt in (torch.float32, torch.bfloat16, torch.uint8, torch.int32)}
    return [t[i:] for t in base.values() for i in range(0, 9, 1 if t.element_size() == 1 else 2)]


def test_cache_key_refines_the_triton_specialization():
    """Two arguments with one key entry must get one Triton specialization, for every flag of the
    parameter (const, specialized, aligned): the direct launch then reuses the kernel Triton picks."""
    libtriton = pytest.importorskip("triton._C.libtriton")
    native = getattr(libtriton, "native_specialize_impl", None)
    if native is None:
        pytest.skip("this Triton specializes in Python (3.4): the refinement is checked on 3.5+")
    from triton.backends.compiler import BaseBackend

    values = _int_values() + _tensor_values()
    for flags in [(False, True, True), (True, True, False), (False, False, True), (False, True, False)]:
        seen = {}
        for v in values:
            key = launch_mod._spec(v, False)
            assert key is not launch_mod._UNSUPPORTED
            triton_spec = native(BaseBackend, v, *flags)
            assert seen.setdefault(key, triton_spec) == triton_spec, (v, key, flags)
    assert len({launch_mod._spec(v, True) for v in (1, True, 1.0)}) == 3  # constexpr: type and value
    assert launch_mod._spec((1, 2), False) is launch_mod._UNSUPPORTED  # tuples take Triton's own path


@pytest.mark.gpu
def test_direct_launch_matches_triton_and_keys_on_alignment_and_constexprs():
    torch.manual_seed(0)
    x = torch.randn(1031, device="cuda")
    launcher = launch(_scaled_copy_kernel)
    assert fast_launch_enabled(), "the direct launch is off (MOE_FP8_FAST_LAUNCH=0 or a Triton outside 3.4-3.9)"
    cases = [(x, 2.0, False), (x[1:], 0.5, True), (x[4:], 3.0, False), (x[16:], -1.0, True), (x[1:17], 1.0, False)]
    for _ in range(2):  # the second round hits the cache
        for src, scale, negate in cases:
            got = torch.full_like(src, float("nan"))
            _scaled_copy(src, got, scale, negate)
            want = torch.full_like(src, float("nan"))
            with fast_launch(False):
                _scaled_copy(src, want, scale, negate)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            torch.testing.assert_close(got, -scale * src if negate else scale * src, rtol=0, atol=0)
    # aligned / misaligned pointers, n % 16, n == 1 and NEGATE each give their own entry
    before = len(launcher.cache)
    assert before >= 4, launcher.cache.keys()
    out = torch.empty(1, device="cuda")
    _scaled_copy(x[:1], out, 1.0, False)
    assert len(launcher.cache) == before + 1
    torch.testing.assert_close(out, x[:1], rtol=0, atol=0)


def _plain_copy(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr, NEGATE: tl.constexpr = False):
    pass


class _FakeCompiled:
    """Stands in for Triton's CompiledKernel: its launcher records each direct launch."""

    def __init__(self):
        self.function, self.packed_metadata, self.launches = object(), object(), []

    def run(self, *args):
        self.launches.append(args)


class _FakeJIT(JITFunction):
    """A real JITFunction whose own path (``kernel[grid]``) compiles nothing: it records the call and
    returns a fake compiled kernel per specialization, as Triton's cache would."""

    def __init__(self):
        super().__init__(_plain_copy)
        self.slow_calls, self.compiled = [], {}

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.slow_calls.append((grid, args, kwargs))
            return self.compiled.setdefault(len(self.slow_calls), _FakeCompiled())

        return run


class _FakeDriver:
    class active:  # noqa: N801  (the attribute Triton's driver module has)
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 1234)


def test_direct_launch_passes_what_triton_passes(monkeypatch):
    """The direct path on the CPU with a faked driver: the first call of a specialization goes through
    ``kernel[grid]``; later ones call the compiled kernel's launcher with Triton's arguments (grid padded
    to 3, stream, function, metadata, no hooks, every parameter in order with defaults filled in)."""
    monkeypatch.setattr(launch_mod, "_VERSION_OK", True)
    monkeypatch.setattr(launch_mod, "_hooked", lambda: False)
    kernel = _FakeJIT()
    launcher = launch(kernel)
    launcher.driver = _FakeDriver
    x = torch.zeros(64)
    with fast_launch(True):
        first = launcher[(3,)](x, x, 32, 2.0, BLOCK=16, num_warps=1)
        assert len(kernel.slow_calls) == 1 and first.launches == []
        again = launcher[(5, 2)](x[16:], x, 48, 0.5, BLOCK=16, num_warps=1)  # same specialization
        assert again is first and len(kernel.slow_calls) == 1
        (launched,) = first.launches
        assert launched[:9] == (5, 2, 1, 1234, first.function, first.packed_metadata, None, None, None)
        assert [a.data_ptr() for a in launched[9:11]] == [x[16:].data_ptr(), x.data_ptr()]
        assert launched[11:] == (48, 0.5, 16, False)
        # each of these changes what Triton specializes on: a new compile through Triton's own path
        for args, kwargs in [((x[1:], x, 32, 2.0), dict(BLOCK=16, num_warps=1)),  # misaligned pointer
                             ((x, x, 33, 2.0), dict(BLOCK=16, num_warps=1)),  # n % 16
                             ((x, x, 1, 2.0), dict(BLOCK=16, num_warps=1)),  # n == 1
                             ((x, x, 2**31, 2.0), dict(BLOCK=16, num_warps=1)),  # n needs i64
                             ((x.int(), x, 32, 2.0), dict(BLOCK=16, num_warps=1)),  # dtype
                             ((x, x, 32, 2.0), dict(BLOCK=32, num_warps=1)),  # constexpr
                             ((x, x, 32, 2.0), dict(BLOCK=16, NEGATE=True, num_warps=1)),  # a default given
                             ((x, x, 32, 2.0), dict(BLOCK=16, num_warps=2))]:  # launch option
            before = len(kernel.slow_calls)
            launcher[(1,)](*args, **kwargs)
            assert len(kernel.slow_calls) == before + 1, (args, kwargs)
        with fast_launch(False):
            launcher[(1,)](x, x, 32, 2.0, BLOCK=16, num_warps=1)
        assert len(kernel.slow_calls) == 10 and len(first.launches) == 1
        monkeypatch.setattr(launch_mod, "_hooked", lambda: True)  # a profiler's hook: Triton's path calls it
        launcher[(1,)](x, x, 32, 2.0, BLOCK=16, num_warps=1)
        assert len(kernel.slow_calls) == 11 and len(first.launches) == 1


@pytest.mark.gpu
def test_compiled_launch_goes_through_wrap_triton():
    """Under torch.compile the seam hands Inductor the kernel (fullgraph: no break at the launch)."""
    x = torch.randn(100, device="cuda")

    def f(x):
        out = torch.empty_like(x)
        _scaled_copy(x, out, 3.0, False)
        return out + 1

    torch.testing.assert_close(torch.compile(f, fullgraph=True)(x), 3.0 * x + 1, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["rowwise", "bf16"])
def test_layer_is_bitwise_the_same_with_and_without_the_direct_launch(recipe):
    from moe_fp8 import FP8MoE

    def run():
        torch.manual_seed(0)
        moe = FP8MoE(256, 128, 8, 2, recipe=recipe, cache_weights=True).to(device="cuda", dtype=torch.bfloat16)
        x = torch.randn(333, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2):  # the second step runs from the weight caches
            moe.zero_grad(set_to_none=True)
            x.grad = None
            out = moe(x)
            out.backward(torch.ones_like(out))
        return [out, x.grad, *(p.grad for p in moe.parameters())]

    dirty_allocator("cuda")
    with fast_launch(True):
        fast = run()
    dirty_allocator("cuda")
    with fast_launch(False):
        slow = run()
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


def test_direct_path_hands_tensor_subclasses_to_wrap_triton(monkeypatch):
    """A fake tensor among the arguments of an eager call (AOTAutograd tracing a backward): wrap_triton."""
    monkeypatch.setattr(launch_mod, "_VERSION_OK", True)
    monkeypatch.setattr(launch_mod, "_hooked", lambda: False)
    wrapped = []
    monkeypatch.setattr(torch.library, "wrap_triton", lambda k: wrapped.append(k) or k)
    kernel = _FakeJIT()
    launcher = launch(kernel)
    launcher.driver = _FakeDriver
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.zeros(64))
    with fast_launch(True):
        launcher[(1,)](fake, fake, 32, 2.0, BLOCK=16)
    assert wrapped == [kernel] and len(kernel.slow_calls) == 1 and launcher.cache == {}
