"""What one check of one case gave: the rows of the harness's table."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Literal

__all__ = ["CHECKS", "CheckResult", "Status", "count_statuses"]

Status = Literal["pass", "fail", "error", "skip"]

#: every check, in table order: SQNR checks (dB) and exact-zero checks (``*_tail``, ``*_empty``).
CHECKS: tuple[str, ...] = ("out", "out_tail", "out_empty", "dx", "dx_tail", "dw", "dw_empty")


@dataclass
class CheckResult:
    """One cell of the table.

    Attributes:
        impl: the adapter's name.
        case: ``str(case)``.
        check: one of :data:`CHECKS`: ``out``/``dx``/``dw`` compare by SQNR against the fp64
            reference; ``*_tail`` (rows past ``offs[-1]``) and ``*_empty`` (empty groups' slices)
            must be exactly zero.
        status: ``pass``, ``fail``, ``error`` (exception, device error, hang) or ``skip``
            (declared unsupported by the adapter).
        value: the SQNR in dB, or for an exact-zero check the number of non-zero (or NaN) elements.
        threshold: the SQNR floor in dB (``None`` for exact-zero checks).
        detail: why it failed, errored or was skipped.
    """

    impl: str
    case: str
    check: str
    status: Status
    value: float | None = None
    threshold: float | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        """Passed or skipped."""
        return self.status in ("pass", "skip")

    def to_dict(self) -> dict:
        d = asdict(self)
        if isinstance(self.value, float) and not math.isfinite(self.value):
            d["value"] = str(self.value)  # JSON has no inf / nan
        return d

    def cell(self) -> str:
        """Its table cell: the dB value or pass for a passing check, ``FAIL 12.3`` / ``FAIL`` / ``ERROR`` / ``skip``."""
        if self.status in ("error", "skip"):
            return self.status.upper() if self.status == "error" else "skip"
        text = f"{self.value:.1f}" if self.threshold is not None and self.value is not None else ""
        if self.status == "pass":
            return text or "pass"
        return f"FAIL {text}".strip()


def count_statuses(results: list[CheckResult]) -> dict[str, int]:
    """``{"pass": n, "fail": n, "error": n, "skip": n}``."""
    c = Counter(r.status for r in results)
    return {s: c.get(s, 0) for s in ("pass", "fail", "error", "skip")}
