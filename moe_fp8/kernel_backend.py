"""Where Triton kernels run: on GPUs and in the CPU interpreter; elsewhere callers use plain torch."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["use_triton", "device_guard"]


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
