"""Does torch see what each kernel writes? While torch traces a launch (``torch.compile``), it builds
the kernel's TTIR for the GPU and follows every store back to the pointer arguments; the tensors it
finds are the ones it clones and writes back. A write it misses is lost under Inductor. A kernel it
cannot analyse makes it count every argument as written: correct, but a warning per compile, extra
copies, and copies back into a graph's inputs (which an eager backward that saved them refuses).

:func:`check` takes the launches ``launch_recorder.record("sm_90a")`` gives (each with the arguments
its launches changed in the interpreter) and, for each, runs torch's analysis on TTIR built for
sm_90 (no GPU needed) and builds the kernel once more with every int and float argument a constexpr,
as torch 2.11 passes them to the analysis. Problems: an analysis that fails, a changed argument it
does not list (one that shares a storage with an argument it lists counts as listed), an argument it
lists that no launch changed (a copy per traced launch; beyond :data:`READ_BUT_LISTED`), a kernel
that does not build with constexpr sizes.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

__all__ = ["check", "READ_BUT_LISTED"]

READ_BUT_LISTED = {("moe_fp8.quant.kernels.colwise", "_colwise_kernel"): {"amax_ptr", "cnt_ptr"}}
"""Arguments torch's analysis lists as written where a launch only reads them: the column-wise
kernel's launches that take their amaxes from upstream hand the amax and counter buffers to the
helper that, in the other launches, takes the amaxes with atomics (a pointer handed to a helper
counts as written)."""


class _Sm90Driver:
    """What torch's analysis asks of Triton's active driver: the target to build TTIR for."""

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)


class _Warnings(logging.Handler):
    """The warnings logged from ``triton_kernel_wrap.py`` (its logger is ``torch._dynamo``'s in torch
    2.11, the module's own in 2.13: other records on it are not the analysis')."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.pathname.endswith("triton_kernel_wrap.py"):
            self.records.append(record)


@contextlib.contextmanager
def _sm90_analysis() -> Iterator[_Warnings]:
    """torch's kernel analysis against an sm_90 target; yields the warnings it logs (a fallback)."""
    from torch._higher_order_ops import triton_kernel_wrap

    logger = getattr(triton_kernel_wrap, "log", None) or logging.getLogger(triton_kernel_wrap.__name__)
    handler = _Warnings()
    logger.addHandler(handler)
    drivers = triton.runtime.driver
    # the active driver as stored: None without a GPU (reset_active would then raise) from triton
    # 3.6 on, whose property creates it on first read; a lazy proxy before
    slot = "_active" if hasattr(drivers, "_active") else "active"
    previous = getattr(drivers, slot)
    drivers.set_active(_Sm90Driver())
    try:
        yield handler
    finally:
        setattr(drivers, slot, previous)
        logger.removeHandler(handler)


def _kwargs(launch: dict) -> dict:
    kwargs = {}
    for name, (kind, value) in launch["args"]:
        if kind == "ptr":
            kwargs[name] = torch.empty(64, dtype=getattr(torch, value))  # the recorder's dtype name
        elif kind == "tl_dtype":
            kwargs[name] = tl.dtype(value)
        else:
            kwargs[name] = value
    return kwargs


def _torch_writes(fn, kwargs: dict) -> set[str]:
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    if hasattr(wrap, "identify_accessed_tensors"):  # torch >= 2.12
        return {dep.name for dep in wrap.identify_accessed_tensors(fn, kwargs, {}).read_writes.writes}
    return set(wrap.identify_mutated_tensors(fn, kwargs, {}))


def _with_aliases(names, aliases: list) -> set[str]:
    """``names`` and every argument that shared a storage with one of them."""
    names = set(names)
    for group in aliases:
        if names & set(group):
            names |= set(group)
    return names


def _name(launch: dict) -> str:
    return f"{launch['module']}.{launch['kernel']}"


def check(launches: list[dict], source, target: GPUTarget) -> list[str]:
    """The problems of torch's view of the recorded sm_90a ``launches`` (see the module docstring);
    ``source(launch)`` is the launch's ``ASTSource`` (``offline_compile._source``), ``target`` sm_90a."""
    problems = []
    for launch in launches:
        fn = getattr(importlib.import_module(launch["module"]), launch["kernel"])
        with _sm90_analysis() as warned:
            writes = _torch_writes(fn, _kwargs(launch))
        if warned.records:
            problems.append(f"{_name(launch)}: torch cannot analyse it ({warned.records[0].getMessage()[:120]})")
            continue
        missed = sorted(set(launch["written"]) - _with_aliases(writes, launch["aliases"]))
        if missed:
            problems.append(f"{_name(launch)}: writes {missed}, which torch's analysis does not list ({sorted(writes)})")
        written = _with_aliases(launch["written"], launch["aliases"])
        read = sorted(set(writes) - written - READ_BUT_LISTED.get((launch["module"], launch["kernel"]), set()))
        if read:
            problems.append(f"{_name(launch)}: torch's analysis lists {read} as written, which the launch only "
                            "reads (each traced launch copies them first)")
        sizes = dict(launch, args=[[n, ["const", d[1]] if d[0] in ("int", "float") else d] for n, d in launch["args"]])
        try:
            triton.compile(source(sizes), target=target, options=dict(launch["options"]))
        except Exception as e:  # noqa: BLE001 - a build error is the finding
            problems.append(f"{_name(launch)}: does not build with its sizes as constexprs "
                            f"({type(e).__name__}: {str(e).strip().splitlines()[-1][:120]})")
    return problems
