"""Bounded runs of battery cases: a hang or a dead device becomes an ``error`` result, never a
stuck or crashed harness.

* :func:`run_with_watchdog`: the case runs in a thread of this process; past ``timeout`` it is
  abandoned (reported as a hang) and the harness goes on. For the CPU, where a kernel cannot
  poison the process.
* :class:`CaseWorker`: the cases run one after another in a worker process (``spawn``). A hang
  kills it; a device error (a device-side assert leaves the CUDA context unusable) ends it after
  it reported; the next case starts a fresh worker. For GPUs.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import threading

import torch

from .adapter import GroupedMMAdapter
from .cases import GroupedMMCase
from .results import CheckResult
from .run_case import planned_checks, run_case

__all__ = ["CaseWorker", "run_with_watchdog"]


def _all_errors(adapter: GroupedMMAdapter, case: GroupedMMCase, detail: str) -> list[CheckResult]:
    return [CheckResult(adapter.name, str(case), c, "error", detail=detail) for c in planned_checks(adapter, case)]


def run_with_watchdog(adapter: GroupedMMAdapter, case: GroupedMMCase, device: torch.device | str, *,
                      timeout: float, backward: bool = True) -> list[CheckResult]:
    """:func:`run_case` in a daemon thread, given up after ``timeout`` seconds."""
    box: list[list[CheckResult]] = []
    t = threading.Thread(target=lambda: box.append(run_case(adapter, case, device, backward=backward)), daemon=True)
    t.start()
    t.join(timeout)
    return box[0] if box else _all_errors(adapter, case, f"hang: no result within {timeout:g} s")


def _device_broken(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        torch.cuda.synchronize(device)
        return False
    except Exception:  # noqa: BLE001 (the context is gone, whatever the error)
        return True


def _worker_main(conn, adapter: GroupedMMAdapter | str, device: str, backward: bool) -> None:
    from .builtin import get_adapter

    adapter = get_adapter(adapter) if isinstance(adapter, str) else adapter
    dev = torch.device(device)
    while True:
        case = conn.recv()
        if case is None:
            return
        conn.send(run_case(adapter, case, dev, backward=backward))
        if _device_broken(dev):
            return


class CaseWorker:
    """Runs cases in a worker process, restarting it after a hang, a crash or a device error.

    The adapter travels by its ``spec`` when it has one (built-ins), else pickled: a user's
    adapter must then be made of picklable, module-level functions.
    """

    def __init__(self, adapter: GroupedMMAdapter, device: torch.device | str, *, timeout: float,
                 backward: bool = True) -> None:
        self.adapter, self.device, self.timeout, self.backward = adapter, str(device), timeout, backward
        self._proc = self._conn = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        payload = self.adapter.spec or self.adapter
        self._proc = ctx.Process(target=_worker_main, args=(child, payload, self.device, self.backward), daemon=True)
        self._proc.start()
        child.close()

    def _stop(self, kill: bool) -> None:
        if self._proc is None:
            return
        if kill:
            self._proc.kill()
        else:
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()
        self._proc = self._conn = None

    def run(self, case: GroupedMMCase) -> list[CheckResult]:
        """The case's results; a hang or a worker that died is an ``error`` for every check."""
        if self._proc is None or not self._proc.is_alive():
            self._stop(kill=True)
            try:
                self._start()
            except (pickle.PicklingError, AttributeError, TypeError) as e:  # e.g. a lambda in the adapter
                self._proc = self._conn = None
                return _all_errors(self.adapter, case, f"cannot send the adapter to a worker process: {e}")
        try:
            self._conn.send(case)
            if self._conn.poll(self.timeout):
                return self._conn.recv()
            self._stop(kill=True)
            return _all_errors(self.adapter, case, f"hang: no result within {self.timeout:g} s (worker killed)")
        except (EOFError, BrokenPipeError, OSError):
            self._proc.join(10)
            code = self._proc.exitcode
            self._stop(kill=True)
            return _all_errors(self.adapter, case, f"the worker process died (exit code {code})")

    def close(self) -> None:
        self._stop(kill=False)

    def __enter__(self) -> "CaseWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
