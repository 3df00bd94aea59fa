"""Count the device kernels a block of code enqueues: Triton launches through :func:`moe_fp8.launch.launch`
and torch ops that launch a kernel (aten ops that are not views, metadata or bare allocations).

    with count_launches() as n:
        layer(x).sum().backward()
    n.total, n.triton, n.torch, n.ops     # ints, and a Counter of kernel / op names

The project's custom ops are opened up: their Python implementation runs with the counter active, so
what they launch is counted, not the op itself. An aten op can launch more than one kernel on a GPU
(a sort, a scan); the count is one per op, the same on CPU and GPU. For tests and benchmarks only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from torch._library.custom_ops import _maybe_get_opdef
from torch.utils._python_dispatch import TorchDispatchMode

from ..launch import ACTIVE_COUNTERS

__all__ = ["LaunchCount", "count_launches"]

# aten ops that allocate or change metadata only (views are recognised by their schema).
_NO_KERNEL = frozenset({
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "resize_", "set_", "record_stream",
    "detach", "lift_fresh", "_has_compatible_shallow_copy_type", "_unsafe_view", "_reshape_alias",
})


class LaunchCount:
    """What :func:`count_launches` counted: ``triton`` launches, ``torch`` kernel-launching ops, and
    ``ops``, a :class:`collections.Counter` by name (``triton:<kernel>`` and ``aten.<op>``)."""

    def __init__(self) -> None:
        self.triton = 0
        self.torch = 0
        self.paused = 0  # > 0 while a Triton launch runs: its own torch ops are not kernels of the code
        self.ops: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return self.triton + self.torch

    def record(self, kernel) -> None:
        """One Triton launch of ``kernel`` (called by the launch seam)."""
        self.triton += 1
        self.ops[f"triton:{getattr(kernel, '__name__', type(kernel).__name__)}"] += 1

    def record_op(self, name: str) -> None:
        self.torch += 1
        self.ops[name] += 1

    def __repr__(self) -> str:
        return f"LaunchCount(total={self.total}, triton={self.triton}, torch={self.torch})"


class _CountingMode(TorchDispatchMode):
    """Counts aten ops; takes no higher-order operators, so the launch seam launches eagerly under it."""

    def __init__(self, count: LaunchCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.count.paused:
            return func(*args, **kwargs)
        namespace = func.namespace
        if namespace not in ("aten", "prims"):
            opdef = _maybe_get_opdef(func)
            if opdef is not None:
                with self:
                    return opdef._init_fn(*args, **kwargs)
            self.count.record_op(f"{namespace}.{func.overloadpacket.__name__}")
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if not func.is_view and name not in _NO_KERNEL:
            self.count.record_op(f"aten.{name}")
        return func(*args, **kwargs)


@contextmanager
def count_launches() -> Iterator[LaunchCount]:
    """Count the kernels the block enqueues (see the module docstring); yields a :class:`LaunchCount`."""
    count = LaunchCount()
    ACTIVE_COUNTERS.append(count)
    try:
        with _CountingMode(count):
            yield count
    finally:
        ACTIVE_COUNTERS.remove(count)
