"""Where Triton kernels run: on GPUs and in the CPU interpreter; elsewhere callers use plain torch."""

from __future__ import annotations

import contextlib
import os

import torch

__all__ = ["interpreter_enabled", "triton_runs_on", "use_triton", "device_guard", "eager_or_custom_op"]


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
    gives the same results (bit for bit for the permutes and quantization).
    """
    if t.device.type == "cuda":
        # Under torch.compile the answer is the compiled kernel (dynamo cannot inspect the kernel's type).
        return torch.compiler.is_compiling() or not _interpreted(kernel)
    return t.device.type == "cpu" and _interpreted(kernel)


def device_guard(t: torch.Tensor):
    """Make ``t``'s GPU the current device while launching (Triton launches on the current one)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def eager_or_custom_op(op, impl):
    """A function calling ``impl`` eagerly (no dispatcher overhead on every call) and the torch
    custom op ``op`` wrapping it under ``torch.compile`` (one opaque node with a fake kernel)."""

    def call(*args):
        return op(*args) if torch.compiler.is_compiling() else impl(*args)

    call.__name__ = impl.__name__.lstrip("_")
    call.__doc__ = f"``{impl.__name__}`` eagerly, the custom op ``{op._qualname}`` under torch.compile."
    return call
