"""Three shortcuts in the Triton interpreter, for the test session.

Before every kernel launch and every call of a ``@triton.jit`` helper, the interpreter patches the
language's builtins (``_patch_lang(fn)``), finding them anew with ``inspect.getmembers`` over
``triton.language``, its ``tensor`` class and ``math``. Our kernels call helpers per tile, so this
was about a third of an interpreted kernel's time.

* ``memoize_builtin_lookup``: the members a module holds do not change, so they are looked up once
  per module (from its unpatched state, on the first launch) and the same ones patched each time.
* ``cache_numpy_dtypes``: the NumPy dtype of a Triton dtype, which the interpreter finds by building
  a dict of every dtype on each of its many calls, kept per element type.
* ``skip_repatching_in_helpers``: a helper call patches nothing where the language modules its
  function sees are already patched. A launch patches them and restores them when it ends (triton
  3.6+; older interpreters never restore); a helper's own patches are never restored. So the
  modules patched since the last restore are still patched, with the same lambdas a re-patch would
  make. A launch always patches. A module left unpatched would fail loudly ("``_semantic`` argument
  must be provided outside of JIT functions"), never compute something else.

Each applies only where the interpreter's functions have the expected signatures; otherwise
nothing changes. ``install`` applies all three (``tests/conftest.py`` in the session's processes,
``tests/interpreter_site/sitecustomize.py`` in the processes they start).
"""

from __future__ import annotations

import inspect
import sys


def install() -> None:
    """All three shortcuts, where this Triton's interpreter has the expected functions."""
    memoize_builtin_lookup()
    skip_repatching_in_helpers()
    cache_numpy_dtypes()


def _replaceable(name: str, params: list[str], mark: str):
    """``(triton.language, the interpreter module, its function name)`` where that function exists
    with these parameters and is not replaced yet (no ``mark`` attribute); else ``None``."""
    try:
        import triton.language as tl
        import triton.runtime.interpreter as interpreter
    except ImportError:
        return None
    fn = getattr(interpreter, name, None)
    if fn is None or getattr(fn, mark, False) or list(inspect.signature(fn).parameters) != params:
        return None
    return tl, interpreter, fn


def memoize_builtin_lookup() -> bool:
    """Install the memoized lookup; False where this Triton's interpreter differs."""
    found = _replaceable("_patch_builtin", ["pkg", "builder", "scope"], "memoized")
    patch_attr = found and getattr(found[1], "_patch_attr", None)
    if not patch_attr:
        return False
    tl, interpreter, _ = found
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


def skip_repatching_in_helpers() -> bool:
    """Install the helper-call shortcut; False where this Triton's interpreter differs."""
    found = _replaceable("_patch_lang", ["fn"], "skips_helpers")
    helper_call = found and getattr(getattr(found[1], "InterpretedFunction", None), "__call__", None)
    if not helper_call:
        return False
    tl, interpreter, patch_lang = found
    helper_code = helper_call.__code__
    patched: set[int] = set()  # ids of the language modules patched since the last restore
    seen_by: dict[int, tuple[object, set[int]]] = {}  # id(fn) -> (fn, ids of the language modules it sees)

    def langs(fn) -> set[int]:
        known = seen_by.get(id(fn))
        if known is None or known[0] is not fn:
            known = seen_by[id(fn)] = (fn, {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core})
        return known[1]

    def patch_lang_once(fn):
        seen = langs(fn)
        in_helper = sys._getframe(1).f_code is helper_code
        if in_helper and patched and seen <= patched:
            return None  # the helper call site discards what _patch_lang returns
        scope = patch_lang(fn)
        if not in_helper:
            patched.clear()
        patched.update(seen)
        restore = getattr(scope, "restore", None)
        if restore is not None:
            def restore_and_forget():
                patched.clear()
                restore()

            scope.restore = restore_and_forget
        return scope

    patch_lang_once.skips_helpers = True
    interpreter._patch_lang = patch_lang_once
    return True


def cache_numpy_dtypes() -> bool:
    """Install the cached dtype lookup; False where this Triton's interpreter differs."""
    found = _replaceable("_get_np_dtype", ["tt_dtype"], "cached")
    if not found:
        return False
    tl, interpreter, get_np_dtype = found
    by_element: dict = {}

    def cached_np_dtype(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(element, tl.pointer_type):  # unhashable; a pointer is a uint64 address
            return get_np_dtype(element)
        np_dtype = by_element.get(element)
        if np_dtype is None:
            np_dtype = by_element[element] = get_np_dtype(element)
        return np_dtype

    cached_np_dtype.cached = True
    interpreter._get_np_dtype = cached_np_dtype
    return True
