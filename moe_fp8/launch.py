"""The one seam through which the project launches its Triton kernels.

    launch(kernel)[grid](*args, **kwargs)      # same meaning as kernel[grid](*args, **kwargs)

- While torch traces (``torch.compile``, a fake / functional / other tensor subclass among the
  arguments, or a dispatch mode that takes higher-order operators: fake, proxy, functional) the call
  goes through ``torch.library.wrap_triton`` so that the graph holds a ``triton_kernel_wrapper``
  node that Inductor launches from its generated code. Under ``TRITON_INTERPRET=1`` the kernel is
  traced as a ``JITFunction`` of the same source whose launches run in the interpreter, so CPU
  graphs hold the same nodes as GPU graphs. A traced launch is functionalized: each tensor argument
  the kernel may write is cloned on its own, so a tensor passed in place of an unused pointer must
  be one the kernel does not write (an input).
- In the interpreter (``TRITON_INTERPRET=1``), on CPU tensors, or on a Triton without the fast
  path: plain ``kernel[grid](...)``.
- Eagerly on a GPU with Triton 3.4-3.9: a direct launch. The compiled kernel is cached per
  specialization and launched through its low-level launcher with the call ``JITFunction.run``
  makes, skipping its binding, key computation and option parsing. The cache key refines what
  Triton specializes on (so a cached kernel is always the one Triton would pick): the current
  device; each tensor's dtype and 16-byte alignment of its data pointer; each int's width class
  (i32 / i64 / u64), ``== 1`` and divisibility by 16; the type of every other scalar; the type and
  value of every constexpr; the launch options (``num_warps``, ``num_stages``, ...); the compile
  knobs read from the environment. Anything else (another argument type, a callable grid, a
  launch hook such as a profiler's, pre-run hooks, a missing argument) takes Triton's own path.

``MOE_FP8_FAST_LAUNCH=0`` (read at import) or :func:`fast_launch` turns the direct launch off.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

__all__ = ["launch", "fast_launch", "fast_launch_enabled", "interpreted_trace", "kernel_input", "zeroed",
           "FAST_LAUNCH_VERSIONS"]

FAST_LAUNCH_VERSIONS = ((3, 4), (3, 5), (3, 6), (3, 7), (3, 8), (3, 9))
"""Triton versions (major, minor) whose ``JITFunction.run`` launches the way the direct launch mirrors."""

_VERSION_OK = tuple(int(p) for p in triton.__version__.split(".")[:2]) in FAST_LAUNCH_VERSIONS
_KNOBS = getattr(triton, "knobs", None)  # Triton 3.4+
_STATE = {"fast": os.environ.get("MOE_FP8_FAST_LAUNCH", "1") != "0"}
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # kernels are decorated at import
_MISSING = inspect.Parameter.empty
_UNSUPPORTED = object()

ACTIVE_COUNTERS: list = []
"""The active counters of :func:`moe_fp8.testing.launches.count_launches`: each launch calls their
``record(kernel)`` and raises their ``paused`` while it runs."""


def fast_launch_enabled() -> bool:
    """Whether eager GPU launches take the direct path (on a Triton in :data:`FAST_LAUNCH_VERSIONS`)."""
    return _STATE["fast"] and _VERSION_OK


@contextlib.contextmanager
def fast_launch(enabled: bool) -> Iterator[None]:
    """Turn the direct launch on or off while the block runs (off: every launch is ``kernel[grid]``)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__}")
    before = _STATE["fast"]
    _STATE["fast"] = enabled
    try:
        yield
    finally:
        _STATE["fast"] = before


def _traces_kernels(mode) -> bool:
    """Does dispatch mode ``mode`` take ``wrap_triton``'s operator (fake, proxy, functional modes and any
    mode that handles higher-order operators)? Other modes (such as the launch counter) see a plain launch:
    the operator would raise under them."""
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_mutation

    return type(mode) in triton_kernel_wrapper_mutation.python_key_table or bool(
        getattr(mode, "supports_higher_order_operators", False))


def _tracing_context() -> bool:
    """Is torch tracing (compile, or a dispatch mode that takes ``wrap_triton``'s operator)?"""
    if torch.compiler.is_compiling():
        return True
    if torch._C._len_torch_dispatch_stack():
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        return any(_traces_kernels(m) for m in _get_current_dispatch_mode_stack())
    return False


def interpreted_trace(t: torch.Tensor) -> bool:
    """Is torch tracing launches whose kernels the interpreter runs on ``t`` (a CPU tensor)? torch
    cannot analyse such kernels and counts every tensor argument as written: correct, but a graph
    input written in the backward by a launch that depends on the backward's tensors is more than
    torch 2.9 takes (the forward must return it), so the callers keep such launches apart there."""
    return _INTERPRET and not t.is_cuda and _tracing_context()


def kernel_input(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the input of Triton kernels that only read it: eagerly ``t`` itself, under
    ``torch.compile`` an ``as_strided`` of ``t`` onto its own storage (the same elements).

    Inductor hands a kernel launch a view of a pointwise result it has not yet written out as a
    copy of its own, which the kernel computing the result writes as one more output: a view read
    by two launches (a gradient's row quantization and the weight gradient's operands) costs two
    extra writes of the tensor. ``as_strided`` makes Inductor write the result once, in a fixed
    layout, and pass every launch that buffer."""
    if not torch.compiler.is_compiling() or interpreted_trace(t):  # interpreted launches count t as written
        return t
    return t.as_strided(t.shape, t.stride())  # at t's own storage offset (traceable inside autograd.Function)


def zeroed(shape: tuple[int, ...] | int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed buffer for a launch to write (atomics, counters): ``torch.empty`` zeroed in place. A
    compiled graph merges equal ``torch.zeros`` calls into one buffer, which every launch but one
    would then copy before writing; ``torch.empty`` calls it keeps apart."""
    return torch.empty(shape, dtype=dtype, device=device).zero_()


def _tracing(args: tuple, kwargs: dict) -> bool:
    """Is torch tracing this call (compile, a tracing dispatch mode, or a tensor subclass argument)?"""
    if _tracing_context():
        return True
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and type(a) not in _PLAIN_TENSORS:
            return True
    return False


def _hooked() -> bool:
    """Is a Triton launch hook registered (a profiler's): then Triton's own path must call it."""
    runtime = _KNOBS.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and (not hasattr(hook, "calls") or hook.calls):
            return True
    return getattr(runtime, "add_stages_inspection_hook", None) is not None


def _knob_state() -> tuple:
    """The compile knobs ``JITFunction.run`` folds into the options on every call."""
    compilation = _KNOBS.compilation
    return (_KNOBS.runtime.debug, getattr(compilation, "instrumentation_mode", None),
            getattr(compilation, "fpsan_homomorphic_casts", None))


def _spec(value, constexpr: bool):
    """What of ``value`` the cache key holds (a refinement of Triton's specialization)."""
    kind = type(value)
    if constexpr:
        return kind, value
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        return value.dtype, value.data_ptr() & 15 == 0
    if kind is int:
        return -(2**31) <= value < 2**31, value < 2**63, value == 1, value & 15 == 0
    if kind is bool or kind is float or value is None:
        return kind
    return _UNSUPPORTED


class _Launcher:
    """``launch(kernel)``: indexing with a grid gives the call that launches ``kernel``."""

    __slots__ = ("kernel", "jit", "names", "name_set", "constexpr", "defaults", "cache", "driver")

    def __init__(self, kernel):
        self.kernel = kernel
        self.jit = isinstance(kernel, JITFunction)
        self.cache: dict = {}
        if self.jit:
            params = kernel.params
            self.names = tuple(p.name for p in params)
            self.name_set = frozenset(self.names)
            self.constexpr = tuple(p.is_constexpr for p in params)
            self.defaults = tuple(p.default for p in params)
            from triton.runtime import driver

            self.driver = driver

    def __getitem__(self, grid) -> Callable[..., Any]:
        return functools.partial(self._call, grid)

    def _call(self, grid, *args, **kwargs):
        if ACTIVE_COUNTERS:
            return self._counted(grid, args, kwargs)
        kernel = self.kernel
        if not self.jit:
            return self._triton(grid, args, kwargs)
        direct = _STATE["fast"] and _VERSION_OK and not callable(grid) and not getattr(kernel, "pre_run_hooks", None)
        if not direct or _tracing_context() or _hooked():
            return self._triton(grid, args, kwargs)
        return self._fast(grid, args, kwargs)

    def _triton(self, grid, args: tuple, kwargs: dict):
        """Triton's own launch, through ``wrap_triton`` while torch traces."""
        if not _tracing(args, kwargs):
            return self.kernel[grid](*args, **kwargs)
        kernel = _traceable(self.kernel)
        if "maxnreg" in kwargs:  # torch moves num_warps / num_stages into a config itself, not maxnreg
            options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
            kernel = _configured(kernel, tuple(sorted(options.items())))
        return torch.library.wrap_triton(kernel)[grid](*args, **kwargs)


    def _counted(self, grid, args: tuple, kwargs: dict):
        """Launch with every active counter recording it (and not counting the torch ops of the launch itself,
        such as the interpreter's copies)."""
        counters = list(ACTIVE_COUNTERS)
        for counter in counters:
            counter.record(self.kernel)
            counter.paused += 1
        ACTIVE_COUNTERS.clear()
        try:
            return self._call(grid, *args, **kwargs)
        finally:
            ACTIVE_COUNTERS.extend(counters)
            for counter in counters:
                counter.paused -= 1

    def _fast(self, grid, args: tuple, kwargs: dict):
        names, n = self.names, len(args)
        if n > len(names):
            return self._triton(grid, args, kwargs)
        values = list(args)
        for name, default in zip(names[n:], self.defaults[n:]):
            values.append(kwargs.get(name, default))
        key = [self.driver.active.get_current_device(), _knob_state()]
        key += [(k, v) for k, v in kwargs.items() if k not in self.name_set]
        for value, constexpr in zip(values, self.constexpr):
            spec = _UNSUPPORTED if value is _MISSING else _spec(value, constexpr)
            if spec is _UNSUPPORTED:
                return self._triton(grid, args, kwargs)
            key.append(spec)
        key = tuple(key)
        entry = self.cache.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **kwargs)
            run, function, meta = (getattr(compiled, a, None) for a in ("run", "function", "packed_metadata"))
            if run is not None and function is not None and meta is not None:
                self.cache[key] = compiled, run, function, meta
            return compiled
        for (name, _), (val, globals_dict) in getattr(self.kernel, "used_global_vals", {}).items():
            if globals_dict.get(name, _MISSING) != val:  # Triton's own path raises the error
                return self._triton(grid, args, kwargs)
        compiled, run, function, meta = entry
        size = len(grid)
        stream = self.driver.active.get_current_stream(key[0])
        run(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, stream, function, meta,
            None, None, None, *values)
        return compiled


_LAUNCHERS: dict[int, _Launcher] = {}


def launch(kernel) -> _Launcher:
    """The launcher of a Triton ``kernel`` (``@triton.jit``): ``launch(kernel)[grid](*args, **kwargs)``
    launches it like ``kernel[grid](*args, **kwargs)`` and returns what that returns."""
    if torch.compiler.is_compiling() and not _INTERPRET:
        # Dynamo traces this call: it takes wrap_triton's kernel as it is (no id(), no launcher cache)
        return torch.library.wrap_triton(kernel)
    launcher = _LAUNCHERS.get(id(kernel))
    if launcher is not None and launcher.kernel is kernel:
        return launcher
    if not hasattr(kernel, "__getitem__"):
        raise TypeError(f"kernel: expected a Triton kernel (@triton.jit), got {type(kernel).__name__}")
    launcher = _Launcher(kernel)
    if launcher.jit:  # the project's kernels live as long as their modules: cache their launchers
        _LAUNCHERS[id(kernel)] = launcher
    return launcher


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
