"""Test-session set-up.

Without CUDA, Triton kernels run in the interpreter: TRITON_INTERPRET=1 is set here, before any
kernel module is imported, so a plain `pytest` works on a CPU machine. Markers:

* ``gpu``: needs CUDA; skipped without it (run `pytest -m gpu` on the H200).
* ``interpreter``: runs Triton kernels on CPU tensors; skipped unless TRITON_INTERPRET=1.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the H200)")
    skip_interp = pytest.mark.skip(reason="runs Triton on CPU tensors: needs TRITON_INTERPRET=1")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and not INTERPRETING:
            item.add_marker(skip_interp)
