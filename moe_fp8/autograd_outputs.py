"""What an ``autograd.Function.forward`` of this library returns: never a no-op alias.

Under ``torch.compile`` in torch 2.11, Dynamo routes the backward gradient of an
``autograd.Function`` to the wrong output slot when the tensor its forward returns shares its
TensorImpl with an intermediate Dynamo also tracked: an in-place op, or ``t.to(dtype)`` with ``t``
already in ``dtype``. The function's backward then receives zeros (PyTorch bug 180642, fixed for
2.12 by PyTorch pull request 180921). Seen here on the H200 (torch 2.11): the compiled bf16 grouped GEMM's
backward was handed an all-zero ``grad_out`` under both ``aot_eager`` and Inductor.
"""

from __future__ import annotations

import torch

__all__ = ["same_or_cast"]


def same_or_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` itself when it already has ``dtype`` (no ``.to`` node aliasing it), else ``t.to(dtype)``."""
    return t if t.dtype == dtype else t.to(dtype)
