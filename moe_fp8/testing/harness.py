"""``check_grouped_mm``: run anyone's grouped GEMM over the battery and report every check."""

from __future__ import annotations

from typing import Callable

import torch

from .adapter import GroupedMMAdapter, as_adapter
from .cases import FORMS, GroupedMMCase, grouped_mm_cases
from .isolation import CaseWorker, run_with_watchdog
from .report import format_summary, format_table
from .results import CheckResult

__all__ = ["check_grouped_mm"]


def check_grouped_mm(
    fn: Callable | GroupedMMAdapter | str,
    *,
    forms: tuple[str, ...] = FORMS,
    recipe: str | None = None,
    device: torch.device | str = "cpu",
    backward: bool = True,
    quick: bool = True,
    cases: list[GroupedMMCase] | None = None,
    timeout: float = 120.0,
    isolate: bool | None = None,
    verbose: bool = True,
) -> list[CheckResult]:
    """Check a grouped GEMM against the fp64 reference on the battery; never raises for a kernel's fault.

    Args:
        fn: a ``(x (M, K), w (E, N, K), offs (E,) int32 end offsets) -> (M, N)`` function
            (differentiable; its wgrad is checked as the 2d2d form too), a :class:`GroupedMMAdapter`,
            or a built-in spec (``"torch"``, ``"torchao"``, ``"moe_fp8:triton:rowwise"``: ``builtin.py``).
        forms: the forms to run (``"2d3d"``, ``"2d2d"``).
        recipe: the SQNR floors for a plain function (``thresholds.THRESHOLDS``; default ``"bf16"``).
        device: where the inputs live.
        backward: check ``dx`` and ``dw`` of the 2d3d form.
        quick: the tiny battery (seconds on a CPU) or the one with GPU-sized problems.
        cases: run these instead of the battery of ``quick`` and ``forms``.
        timeout: seconds a case may take before it counts as a hang.
        isolate: run the cases in a worker process (default: on CUDA devices), so that a hang or a
            device-side assert ends the worker, not the harness; else in this process with a watchdog thread.
        verbose: print the table and the summary.
    Returns:
        One :class:`CheckResult` per (case, check), in battery order.
    """
    if isinstance(fn, str):
        from .builtin import get_adapter

        fn = get_adapter(fn)
    adapter = as_adapter(fn, recipe)
    device = torch.device(device)
    todo = cases if cases is not None else grouped_mm_cases(quick=quick, forms=forms)
    isolate = device.type == "cuda" if isolate is None else isolate
    results: list[CheckResult] = []
    if isolate:
        with CaseWorker(adapter, device, timeout=timeout, backward=backward) as worker:
            for case in todo:
                results += worker.run(case)
    else:
        for case in todo:
            results += run_with_watchdog(adapter, case, device, timeout=timeout, backward=backward)
    if verbose:
        print(format_table(results), format_summary(adapter.name, results), sep="\n\n", flush=True)
    return results
