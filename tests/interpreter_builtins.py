"""Memoize which members of ``triton.language`` the Triton interpreter patches.

Before every kernel launch and every call of a ``@triton.jit`` helper, the interpreter re-patches
the language's builtins and finds them anew with ``inspect.getmembers`` over ``triton.language``,
its ``tensor`` class and ``math``: about 15% of an interpreted kernel's time when helpers are
called per tile, as ours are. The members a module holds do not change, so this looks them up once
per module (from its unpatched state, on the first launch) and patches the same ones each time.
Applied only where the interpreter's ``_patch_builtin(pkg, builder, scope)`` and
``_patch_attr(obj, name, member, builder, scope)`` exist as expected; otherwise nothing changes.
"""

from __future__ import annotations

import inspect


def memoize_builtin_lookup() -> bool:
    """Install the memoized lookup; False where this Triton's interpreter differs."""
    try:
        import triton.language as tl
        import triton.runtime.interpreter as interpreter
    except ImportError:
        return False
    patch_builtin = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    if patch_builtin is None or patch_attr is None or getattr(patch_builtin, "memoized", False):
        return False
    if list(inspect.signature(patch_builtin).parameters) != ["pkg", "builder", "scope"]:
        return False
    builtins: dict[int, list] = {}

    def memoized_patch_builtin(pkg, builder, scope):
        members = builtins.get(id(pkg))
        if members is None:
            members = builtins[id(pkg)] = [(n, m) for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
        for name, member in members:
            patch_attr(pkg, name, member, builder, scope)

    memoized_patch_builtin.memoized = True
    interpreter._patch_builtin = memoized_patch_builtin
    return True
