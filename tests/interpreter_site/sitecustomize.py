"""Run at the start of every Python process the test session starts (``tests/conftest.py`` puts this
folder on ``PYTHONPATH``): where ``TRITON_INTERPRET=1``, the interpreter shortcuts of
``tests/interpreter_builtins.py`` that the session's own processes have, for the CLIs and benchmark
scripts the tests run in subprocesses."""

import importlib.util
import os

if os.environ.get("TRITON_INTERPRET") == "1":
    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "interpreter_builtins.py")
    _spec = importlib.util.spec_from_file_location("interpreter_builtins", _path)
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    _module.install()
