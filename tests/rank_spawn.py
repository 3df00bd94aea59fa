"""Start ``world`` gloo ranks of a worker module's ``worker`` and fail the test with their tracebacks.

The ranks are forked from a forkserver that has imported the worker modules once (torch, the
library, transformers: about 5 s of CPU a process), instead of each rank importing them again as
``spawn`` would. The forkserver keeps the environment of its start, so each rank sets
``TRITON_INTERPRET=0`` itself: the ranks run the kernels' pure-torch references (bit-identical to
the kernels, which their own tests run in the interpreter; the interpreter would take minutes).
"""

from __future__ import annotations

import multiprocessing
import os
import traceback

import pytest
import torch.multiprocessing as mp

#: imported once by the forkserver, before its first rank forks
PRELOAD = ["ep_workers", "fsdp_workers"]
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)


def _rank(rank: int, module: str, args: tuple, errors) -> None:
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        getattr(__import__(module), "worker")(rank, *args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise


def spawn(module: str, world: int, *args) -> None:
    """``module.worker(rank, *args)`` on ``world`` processes; a rank's exception fails the test."""
    errors = _CONTEXT.SimpleQueue()
    try:
        mp.start_processes(_rank, args=(module, args, errors), nprocs=world, join=True, start_method="forkserver")
    except Exception as e:
        msgs = []
        while not errors.empty():
            msgs.append(errors.get())
        pytest.fail("\n".join(msgs) or str(e))
