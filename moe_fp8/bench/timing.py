"""Timing shared by the benchmark scripts: wall-clock for CPU smoke runs (on the GPU each script
uses do_bench), and the host cost of issuing a call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def wall_median_ms(fn: Callable[[], object], calls: int = 3) -> float:
    """Median wall-clock milliseconds of ``calls`` calls of ``fn`` (no device sync: CPU tensors)."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def layer_timer(cuda: bool, quick: bool) -> Callable[[Callable[[], object]], float]:
    """``timer(fn) -> ms``: ``do_bench``'s median on the GPU (fewer repetitions when ``quick``), else
    the wall clock of two calls (CPU smoke runs)."""
    if not cuda:
        return lambda fn: wall_median_ms(fn, calls=2)
    from triton.testing import do_bench  # noqa: PLC0415

    return lambda fn: do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 300, return_mode="median")


def fwd_bwd_step(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                 dy: torch.Tensor) -> Callable[[], None]:
    """A call of ``layer`` on ``x`` (which requires grad) and its backward from ``dy``."""
    def run() -> None:
        x.grad = None
        layer(x).backward(dy)
    return run


def host_ms(fn: Callable[[], object], calls: int = 30) -> float:
    """Median host milliseconds to make one call of ``fn``, starting each from an idle device (so
    the launches never wait for queue space): the CPU cost of a sync-free call, not its GPU time."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(calls):
        sync()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    sync()
    return statistics.median(times)


def alternated_rounds(steps: dict[str, Callable[[], object]], rounds: int,
                      timer: Callable[[Callable[[], object]], float]) -> dict[str, list[float]]:
    """``{name: [ms per round]}``: each round times every step once, in order, so a drift of the
    device over the run hits all of them alike (A/B scripts take the median and the range)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(timer(step))
    return times


def event_median_ms(step: Callable[[], object], steps: int) -> float:
    """Median milliseconds of ``steps`` calls of ``step``, each between two CUDA events (wall clock
    on the CPU); what a host-bound call costs shows up, as it does in a training step."""
    times = []
    for _ in range(steps):
        if not torch.cuda.is_available():
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
