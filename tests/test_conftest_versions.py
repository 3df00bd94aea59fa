"""The test session's version check: Triton's interpreter below 3.7 with numpy >= 2.4 is refused
with a clear message instead of failing every kernel test with a numpy TypeError."""

import pytest
from conftest import interpreter_numpy_problem


@pytest.mark.parametrize("triton_version, numpy_version, refused", [
    ("3.6.0", "2.4.6", True),
    ("3.4.0", "2.4.0", True),
    ("3.5.1", "2.3.5", False),
    ("3.7.0", "2.4.6", False),
    ("3.9.0", "2.4.6", False),
    ("3.10.0", "3.0.0", False),
    ("3.6.0+git1234abcd", "2.4.0rc1", True),
])
def test_interpreter_numpy_problem(triton_version, numpy_version, refused):
    problem = interpreter_numpy_problem(triton_version, numpy_version)
    assert (problem is not None) == refused
    if refused:
        assert "numpy<2.4" in problem and triton_version in problem
