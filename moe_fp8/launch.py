"""Kernel launches that ``torch.compile`` can see: ``launch(kernel)[grid](*args, **kwargs)``.

While torch traces (``torch.compiler.is_compiling()``, a fake or functional tensor argument, or an
active dispatch mode) the launch goes through ``torch.library.wrap_triton``, so the graph holds a
``triton_kernel_wrapper`` node that Inductor launches from its generated code; otherwise the kernel
launches directly. Under ``TRITON_INTERPRET=1`` the kernel is traced as a ``JITFunction`` of the same
source whose launches run in the interpreter, so CPU graphs hold the same nodes as GPU graphs.

A traced launch is functionalized: each tensor argument the kernel may write is cloned on its own
(on CPU every argument counts as written: the mutation analysis needs a GPU target). So a tensor
passed in place of an unused pointer must be one that the kernel does not write (an input).
"""

from __future__ import annotations

import functools

import torch
import triton
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.utils._python_dispatch import _get_current_dispatch_mode
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

__all__ = ["launch"]


def launch(kernel):
    """``launch(kernel)[grid](*args, **kwargs)``: ``kernel[grid](...)``, traceable (see the module)."""
    return _Launch(kernel)


class _Launch:
    __slots__ = ("kernel",)

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            if not _tracing(args, kwargs):
                return self.kernel[grid](*args, **kwargs)
            kernel = _traceable(self.kernel)
            if "maxnreg" in kwargs:  # torch moves num_warps / num_stages into a config itself, not maxnreg
                options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
                kernel = _configured(kernel, tuple(sorted(options.items())))
            return torch.library.wrap_triton(kernel)[grid](*args, **kwargs)

        return run


def _tracing(args, kwargs) -> bool:
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return True
    return any(isinstance(a, (FakeTensor, FunctionalTensor)) for a in (*args, *kwargs.values()))


@functools.lru_cache(maxsize=None)
def _configured(kernel, options: tuple):
    """``kernel`` with its launch options as the one config of an autotuner (what torch traces)."""
    return triton.autotune(configs=[triton.Config({}, **dict(options))], key=[])(kernel)


@functools.lru_cache(maxsize=None)
def _traceable(kernel):
    """``kernel`` itself, or for an interpreted kernel a ``JITFunction`` that launches it."""
    return _InterpretedJIT(kernel) if isinstance(kernel, InterpretedFunction) else kernel


class _InterpretedJIT(JITFunction):
    """The ``JITFunction`` of an interpreted kernel's source; its launches run the interpreter."""

    def __init__(self, interpreted):
        super().__init__(interpreted.fn)
        self.interpreted = interpreted

    def run(self, *args, grid, warmup, **kwargs):
        return self.interpreted.run(*args, grid=grid, warmup=warmup, **kwargs)

    # A JITFunction hashes its source's dependencies, which the interpreter's kernels cannot give.
    __hash__ = object.__hash__
    __eq__ = object.__eq__
