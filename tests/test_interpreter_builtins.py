"""The test session's shortcuts in the interpreter's patching of the language (``interpreter_builtins``)."""

import inspect

import pytest
import triton
import triton.language as tl

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


@pytest.mark.interpreter
def test_helper_calls_inside_a_launch_patch_nothing(monkeypatch):
    """A launch patches the language once; its helper calls, one per loop step, patch nothing, and
    the kernel still computes what it should."""
    import torch
    import triton.runtime.interpreter as interpreter

    if not getattr(interpreter._patch_lang, "skips_helpers", False):
        pytest.skip("this Triton's interpreter has another _patch_lang: nothing skipped")
    patched = []
    real = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda pkg, *a: patched.append(pkg) or real(pkg, *a))
    x = torch.arange(64, dtype=torch.float32)
    y = torch.empty_like(x)
    _twice_kernel[(1,)](x, y, 64, BLOCK=16)
    assert torch.equal(y, 2 * x)
    launches = len(patched)
    _twice_kernel[(1,)](x, y, 64, BLOCK=16)
    assert len(patched) == 2 * launches and launches <= 4  # tl, tl.tensor, tl.math, tensor descriptors


@triton.jit
def _twice(v):
    return v + v


@triton.jit
def _twice_kernel(x, y, n, BLOCK: tl.constexpr):
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(y + offs, _twice(tl.load(x + offs, mask=offs < n)), mask=offs < n)


@pytest.mark.interpreter
def test_subprocesses_get_the_shortcuts():
    """A Python process the session starts installs the shortcuts at start-up."""
    import os
    import subprocess
    import sys

    import triton.runtime.interpreter as interpreter

    code = "import triton.runtime.interpreter as i; print(getattr(i._patch_lang, 'skips_helpers', False))"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"),
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(getattr(interpreter._patch_lang, "skips_helpers", False))
