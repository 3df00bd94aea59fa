"""Timing shared by the benchmark scripts' CPU smoke runs (on the GPU each script uses do_bench)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def wall_median_ms(fn: Callable[[], object], calls: int = 3) -> float:
    """Median wall-clock milliseconds of ``calls`` calls of ``fn`` (no device sync: CPU tensors)."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
