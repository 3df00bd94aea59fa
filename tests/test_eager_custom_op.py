"""``kernel_backend.eager_custom_op``: eager calls skip the dispatcher, compile sees the custom op."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_fp8.kernel_backend import eager_custom_op


@eager_custom_op("moe_fp8_test::double")
def double(x: torch.Tensor, k: int) -> torch.Tensor:
    return x * 2 + k


@double.register_fake
def _(x, k):
    return torch.empty_like(x)


def _op_calls(fn) -> int:
    """Calls of ``moe_fp8_test::double`` that went through the dispatcher while ``fn()`` ran (the
    profiler records dispatched ops; a direct call of the function is not one)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "moe_fp8_test::double")


def test_eager_call_skips_the_dispatcher():
    x = torch.randn(4)
    assert torch.equal(double(x, 1), x * 2 + 1)
    assert _op_calls(lambda: double(x, 1)) == 0  # the function ran directly
    assert _op_calls(lambda: double.op(x, 1)) == 1  # the op itself is seen


def test_traced_or_subclass_inputs_go_through_the_op():
    """Fake / functional tensors (AOTAutograd traces a registered backward with them) and dispatch
    modes must reach the op: its fake kernel, never the real function on tensors without data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = torch.randn(4)
    with _Mode():
        assert _op_calls(lambda: double(x, 1)) > 0
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        assert _op_calls(lambda: double(fake, 1)) > 0


def test_inputs_that_require_grad_go_through_the_op():
    """The op has no backward: differentiating through it must raise, not give no gradient."""
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError):
        double(x, 1).sum().backward()
    with torch.no_grad():  # inside an autograd.Function's forward / backward: the direct call
        assert not double(x, 1).requires_grad


def test_compile_traces_the_custom_op():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = torch.compile(lambda x: double(x, 3), fullgraph=True, backend=backend)(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 5.0))
    assert "moe_fp8_test.double" in graphs[0].code
