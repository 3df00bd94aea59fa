"""Parametrize a project's own test suite over the battery in one line.

    @pytest.mark.parametrize("case", grouped_mm_cases(quick=True), ids=str)
    def test_my_kernel(case):
        assert_case(my_grouped_mm, case, recipe="rowwise")
"""

from __future__ import annotations

from typing import Callable

import torch

from .adapter import GroupedMMAdapter, as_adapter
from .cases import GroupedMMCase
from .isolation import run_with_watchdog
from .report import format_table
from .results import CheckResult

__all__ = ["assert_case"]


def assert_case(fn: Callable | GroupedMMAdapter, case: GroupedMMCase, *, recipe: str | None = None,
                device: torch.device | str = "cpu", backward: bool = True,
                timeout: float = 120.0) -> list[CheckResult]:
    """Run ``case`` on ``fn`` (see ``check_grouped_mm``); ``AssertionError`` listing every failed or
    errored check, ``pytest.skip`` when the adapter declared the whole case unsupported.

    Returns the results when nothing failed.
    """
    results = run_with_watchdog(as_adapter(fn, recipe), case, device, timeout=timeout, backward=backward)
    bad = [r for r in results if not r.ok]
    if bad:
        raise AssertionError(f"{case}: {len(bad)} check(s) failed\n{format_table(results)}")
    if results and all(r.status == "skip" for r in results):
        import pytest

        pytest.skip(f"{case}: {results[0].detail}")
    return results
