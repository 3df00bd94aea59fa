"""The test session's memoized lookup of the interpreter's builtins (``interpreter_builtins``)."""

import inspect

import pytest

from interpreter_builtins import memoize_builtin_lookup


@pytest.mark.interpreter
def test_memoized_lookup_patches_what_the_scan_finds():
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    patch = interpreter._patch_builtin
    if not getattr(patch, "memoized", False):
        pytest.skip("this Triton's interpreter has another _patch_builtin: nothing memoized")
    assert memoize_builtin_lookup() is False  # installed once
    for pkg in (tl, tl.tensor, tl.math):
        want = {n for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)}
        patched = []

        class Scope:
            def set_attr(self, obj, name, value):
                patched.append(name)

        patch(pkg, None, Scope())  # the real _patch_attr hands each patched name to the scope
        assert want and set(patched) == want, pkg
