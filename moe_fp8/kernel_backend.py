"""Where Triton kernels run: on GPUs and in the CPU interpreter; elsewhere callers use plain torch."""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = [
    "interpreter_enabled", "triton_runs_on", "use_triton", "device_guard", "eager_or_custom_op", "eager_custom_op",
    "eager_triton_op",
    "LaunchTarget", "launch_target", "configure_launches_for",
]


def interpreter_enabled() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the Triton interpreter (kernels then take CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_runs_on(t) -> bool:
    """Can Triton kernels take ``t``: a GPU tensor, or any tensor while the interpreter is on."""
    return isinstance(t, torch.Tensor) and (t.is_cuda or interpreter_enabled())


def _interpreted(kernel) -> bool:
    """True when ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (it then takes CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


def use_triton(kernel, t: torch.Tensor) -> bool:
    """Run ``kernel`` for tensors on ``t``'s device? GPUs (CUDA / ROCm) always; CPU in the interpreter.

    Without a GPU and without the interpreter the callers use their pure-torch reference, which
    gives the same results (bit for bit for the permutes and quantization). CPU tensors take the
    kernel only while ``TRITON_INTERPRET`` is still set: a process whose kernels were decorated for
    the interpreter goes to the references once it sets ``TRITON_INTERPRET=0``, as
    :func:`triton_runs_on` does.
    """
    if t.device.type == "cuda":
        # Under torch.compile the answer is the compiled kernel (dynamo cannot inspect the kernel's type).
        return torch.compiler.is_compiling() or not _interpreted(kernel)
    return t.device.type == "cpu" and _interpreted(kernel) and interpreter_enabled()


@dataclass(frozen=True)
class LaunchTarget:
    """The machine a kernel launch is configured for (tile sizes, casts, launch options).

    ``kind``: ``"interpreter"`` (CPU tensors), ``"cuda"`` (NVIDIA) or ``"hip"`` (AMD); ``arch``: the
    compute capability ``(major, minor)`` on CUDA, the ``gfx`` name on HIP, ``None`` in the
    interpreter; ``multiprocessors``: SMs (CUs on HIP), a small constant in the interpreter.
    """

    kind: str
    arch: tuple[int, int] | str | None = None
    multiprocessors: int = 4

    def is_sm90(self) -> bool:
        return self.kind == "cuda" and self.arch[0] == 9


_CONFIGURED_FOR: list[LaunchTarget] = []


@functools.lru_cache(maxsize=None)
def _gpu_target(index: int) -> LaunchTarget:
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip is not None:
        return LaunchTarget("hip", props.gcnArchName.split(":")[0], props.multi_processor_count)
    return LaunchTarget("cuda", torch.cuda.get_device_capability(index), props.multi_processor_count)


def launch_target(device: torch.device) -> LaunchTarget:
    """What launches for tensors on ``device`` are configured for: the GPU itself, or the
    interpreter for CPU tensors (and for GPU tensors under ``TRITON_INTERPRET=1``); inside
    :func:`configure_launches_for`, its target."""
    if _CONFIGURED_FOR:
        return _CONFIGURED_FOR[-1]
    if device.type != "cuda" or interpreter_enabled():
        return LaunchTarget("interpreter")
    return _gpu_target(device.index if device.index is not None else torch.cuda.current_device())


@contextlib.contextmanager
def configure_launches_for(target: LaunchTarget):
    """Configure every launch as for ``target`` while the block runs (the interpreter still runs
    them): how the offline compile check records the launches a GPU would make."""
    _CONFIGURED_FOR.append(target)
    try:
        yield target
    finally:
        _CONFIGURED_FOR.pop()


_NO_GUARD = contextlib.nullcontext()


def device_guard(t: torch.Tensor):
    """Make ``t``'s GPU the current device while launching (Triton launches on the current one); nothing
    to do when it is current already."""
    device = t.device
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return _NO_GUARD
    return torch.cuda.device(device)


def eager_or_custom_op(op, impl):
    """A function calling ``impl`` eagerly (no dispatcher overhead on every call) and the torch
    custom op ``op`` wrapping it under ``torch.compile`` (one opaque node with a fake kernel).

    ``impl`` runs directly only on plain tensors with nothing tracing: any tensor subclass (fake
    or functional tensors: AOTAutograd traces a custom op's registered backward with them, and on
    torch <= 2.11 ``torch.compiler.is_compiling()`` is then False) or an active dispatch mode sends
    the call through ``op``. So does an input that requires grad (grad mode on), so that
    differentiating through an op without a registered backward raises instead of silently giving
    no gradient; inside an ``autograd.Function``'s forward and backward grad mode is off.
    """

    def call(*args, **kwargs):
        return impl(*args, **kwargs) if _plain_eager_call(args, kwargs) else op(*args, **kwargs)

    call.__name__ = impl.__name__.lstrip("_")
    call.__doc__ = f"``{impl.__name__}`` eagerly, the custom op ``{op._qualname}`` under torch.compile."
    return call


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _plain_eager_call(args, kwargs) -> bool:
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    grad = torch.is_grad_enabled()
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and (type(a) not in _PLAIN_TENSORS or (grad and a.requires_grad)):
            return False
    return True


def eager_custom_op(name: str, *, make=torch.library.custom_op):
    """Decorator: ``fn`` becomes the torch custom op ``name`` (no mutated arguments) for
    ``torch.compile``, called through :func:`eager_or_custom_op` (directly) in eager mode. The
    returned function keeps the op's ``register_fake``; the op itself is its ``op`` attribute.
    Only for ops without a registered backward (eager calls would skip it). ``make`` builds the op
    (``torch.library.custom_op``: one opaque node; see :func:`eager_triton_op`)."""

    def wrap(fn):
        op = make(name, fn, mutates_args=())
        call = eager_or_custom_op(op, fn)
        call.register_fake = op.register_fake
        call.op = op
        return call

    return wrap


def eager_triton_op(name: str):
    """:func:`eager_custom_op` for a function whose kernels launch through :func:`moe_fp8.launch.launch`:
    the op is a ``torch.library.triton_op``, so ``torch.compile`` traces its body and the graph holds
    the Triton kernels themselves (``triton_kernel_wrapper`` nodes) instead of one opaque call. The
    body must be traceable with fake tensors (shape- and dtype-dependent Python only)."""
    return eager_custom_op(name, make=torch.library.triton_op)
