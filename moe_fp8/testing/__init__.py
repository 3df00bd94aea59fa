"""Test helpers and a correctness harness for grouped GEMMs.

Helpers (plain PyTorch, may sync, not for hot paths): :func:`sqnr`, :func:`ulp`, :func:`random_offsets`,
:func:`group_sizes`, the fp64 references.

Harness: :func:`check_grouped_mm` runs anyone's grouped GEMM (through a :class:`GroupedMMAdapter`,
or a built-in one from :func:`get_adapter`) over a battery of hard cases (:func:`grouped_mm_cases`)
against fp64 and returns a :class:`CheckResult` per (case, check); :func:`assert_case` is its
pytest form; ``python -m moe_fp8.testing`` its command line. See ``docs/testing-harness.md``.
"""

from .adapter import GroupedMMAdapter, as_adapter
from .allocator import dirty_allocator
from .builtin import ADAPTER_SPECS, get_adapter
from .cases import FORMS, GroupedMMCase, grouped_mm_cases
from .harness import check_grouped_mm
from .metrics import sqnr, ulp
from .offsets import OFFSET_KINDS, group_sizes, random_offsets
from .pytest_helpers import assert_case
from .references import reference_grouped_mm, reference_grouped_mm_2d2d, reference_moe_forward
from .report import format_summary, format_table
from .results import CHECKS, CheckResult, count_statuses
from .run_case import run_case
from .thresholds import THRESHOLDS, Floors
from .tiny_lm import TinyMoELM, lm_loss

__all__ = [
    "ADAPTER_SPECS",
    "CHECKS",
    "FORMS",
    "OFFSET_KINDS",
    "THRESHOLDS",
    "TinyMoELM",
    "CheckResult",
    "Floors",
    "GroupedMMAdapter",
    "GroupedMMCase",
    "as_adapter",
    "assert_case",
    "check_grouped_mm",
    "count_statuses",
    "dirty_allocator",
    "lm_loss",
    "format_summary",
    "format_table",
    "get_adapter",
    "group_sizes",
    "grouped_mm_cases",
    "random_offsets",
    "reference_grouped_mm",
    "reference_grouped_mm_2d2d",
    "reference_moe_forward",
    "run_case",
    "sqnr",
    "ulp",
]
