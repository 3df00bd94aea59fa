"""Run one battery case through an adapter, in this process, and check it against fp64.

2d3d: ``out`` (SQNR on the routed rows), ``out_tail`` (rows past ``offs[-1]`` exactly zero, when
the adapter's contract says so), then through autograd ``dx`` / ``dx_tail`` and ``dw`` (SQNR over
the non-empty groups) / ``dw_empty`` (empty groups' gradients exactly zero). 2d2d: ``out`` (SQNR
over the non-empty groups) and ``out_empty``. An exception fails the part it came from as
``error``; nothing raises out of :func:`run_case`.
"""

from __future__ import annotations

import torch

from .adapter import GroupedMMAdapter, Part
from .allocator import dirty_allocator
from .cases import GroupedMMCase
from .inputs import CaseInputs, make_inputs
from .metrics import sqnr
from .references import reference_grouped_mm, reference_grouped_mm_2d2d
from .results import CheckResult
from .thresholds import floors_for

__all__ = ["planned_checks", "run_case"]


def planned_checks(adapter: GroupedMMAdapter, case: GroupedMMCase) -> dict[str, Part]:
    """The checks that apply to ``case`` (in table order), each with the part that produces it."""
    tail = case.tail > 0 and adapter.zero_tail
    empty, nonempty = bool(case.empty_groups()), case.num_groups > len(case.empty_groups())
    if case.form == "2d2d":
        checks = {"out": "forward", "out_empty": "forward" if empty else None}
    else:
        checks = {"out": "forward", "out_tail": "forward" if tail else None, "dx": "backward",
                  "dx_tail": "backward" if tail else None, "dw": "backward" if nonempty else None,
                  "dw_empty": "backward" if empty else None}
    return {k: v for k, v in checks.items() if v is not None}


def _error_text(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:300]}"


def _sqnr_result(name: str, ref: torch.Tensor, got: torch.Tensor, floor: float, **kw) -> CheckResult:
    db = sqnr(ref, got)
    ok = db >= floor  # NaN fails
    return CheckResult(check=name, status="pass" if ok else "fail", value=db, threshold=floor,
                       detail="" if ok else f"SQNR {db:.1f} dB < {floor} dB", **kw)


def _zero_result(name: str, got: torch.Tensor, what: str, **kw) -> CheckResult:
    bad = (got != 0) | torch.isnan(got)
    n = int(bad.sum())
    if n == 0:
        return CheckResult(check=name, status="pass", value=0.0, **kw)
    sample = got[bad].flatten()[:3].tolist()
    return CheckResult(check=name, status="fail", value=float(n),
                       detail=f"{n} of {got.numel()} elements of {what} are not 0 (e.g. {sample})", **kw)


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected shape {shape}, got {got}")


def _group_mask(case: GroupedMMCase, empty: bool) -> torch.Tensor:
    return torch.tensor([(s == 0) == empty for s in case.sizes], dtype=torch.bool)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_2d2d(adapter: GroupedMMAdapter, case: GroupedMMCase, inp: CaseInputs, device: torch.device,
              checks: dict[str, Part], kw: dict) -> list[CheckResult]:
    out = adapter.mm_2d2d(inp.lhs, inp.rhs, inp.offs)
    _synchronize(device)
    _check_shape("out", out, (case.num_groups, case.n, case.k))
    out = out.detach().double().cpu()
    ref = reference_grouped_mm_2d2d(inp.lhs, inp.rhs, inp.offs.cpu())
    full = _group_mask(case, empty=False)
    results = [_sqnr_result("out", ref[full], out[full], floors_for(adapter.recipe).dw, **kw)]
    if "out_empty" in checks:
        results.append(_zero_result("out_empty", out[~full], "the empty groups' slices", **kw))
    return results


def _forward_2d3d(adapter, case, inp, device, checks, kw, x, w):
    y = adapter.mm_2d3d(x, w, inp.offs)
    _synchronize(device)
    _check_shape("out", y, (case.rows, case.n))
    ref = reference_grouped_mm(inp.lhs, inp.rhs, inp.offs.cpu())
    y64, used = y.detach().double().cpu(), case.used_rows
    results = [_sqnr_result("out", ref[:used], y64[:used], floors_for(adapter.recipe).out, **kw)]
    if "out_tail" in checks:
        results.append(_zero_result("out_tail", y64[used:], "the rows past offs[-1]", **kw))
    return y, results


def _backward_2d3d(adapter, case, inp, device, checks, kw, x, w, y):
    grad = inp.grad.to(y.dtype)  # the output gradient as autograd hands it to the op
    dx, dw = torch.autograd.grad(y, (x, w), grad)
    _synchronize(device)
    _check_shape("dx", dx, tuple(x.shape))
    _check_shape("dw", dw, tuple(w.shape))
    floors, offs, used = floors_for(adapter.recipe), inp.offs.cpu(), case.used_rows
    ref_dx = reference_grouped_mm(grad, inp.rhs.transpose(1, 2), offs)
    dx64, dw64 = dx.double().cpu(), dw.double().cpu()
    results = [_sqnr_result("dx", ref_dx[:used], dx64[:used], floors.dx, **kw)]
    if "dx_tail" in checks:
        results.append(_zero_result("dx_tail", dx64[used:], "dx's rows past offs[-1]", **kw))
    full = _group_mask(case, empty=False)
    if "dw" in checks:
        ref_dw = reference_grouped_mm_2d2d(grad, inp.lhs, offs)
        results.append(_sqnr_result("dw", ref_dw[full], dw64[full], floors.dw, **kw))
    if "dw_empty" in checks:
        results.append(_zero_result("dw_empty", dw64[~full], "the empty groups' dw", **kw))
    return results


def _fill(checks: dict[str, Part], part: Part, status: str, detail: str, kw: dict) -> list[CheckResult]:
    return [CheckResult(check=c, status=status, detail=detail, **kw) for c, p in checks.items() if p == part]


def run_case(adapter: GroupedMMAdapter, case: GroupedMMCase, device: torch.device | str = "cpu", *,
             backward: bool = True) -> list[CheckResult]:
    """The results of ``case`` (one per planned check), computed in this process.

    The allocator is dirtied first (``dirty_allocator``), so an output left unwritten holds NaN.
    ``backward=False`` skips the gradient checks.
    """
    device = torch.device(device)
    kw = dict(impl=adapter.name, case=str(case))
    checks = planned_checks(adapter, case)
    skip = {p: adapter.skip_reason(case, p, device) for p in ("forward", "backward")}
    if not backward:
        skip["backward"] = skip["backward"] or "backward not asked for"
    if skip["forward"]:
        return _fill(checks, "forward", "skip", skip["forward"], kw) + _fill(checks, "backward", "skip",
                                                                              skip["backward"] or skip["forward"], kw)
    try:
        inp = make_inputs(case, device)
        dirty_allocator(device)
        if case.form == "2d2d":
            return _run_2d2d(adapter, case, inp, device, checks, kw)
        grads = not skip["backward"]
        x = inp.lhs.detach().requires_grad_(grads)
        w = inp.rhs.detach().requires_grad_(grads)
        y, results = _forward_2d3d(adapter, case, inp, device, checks, kw, x, w)
    except Exception as e:  # noqa: BLE001 (any failure of the kernel is a result)
        after = ("skip", skip["backward"]) if skip["backward"] else ("error", "the forward failed")
        return _fill(checks, "forward", "error", _error_text(e), kw) + _fill(checks, "backward", *after, kw)
    if skip["backward"]:
        return results + _fill(checks, "backward", "skip", skip["backward"], kw)
    try:
        return results + _backward_2d3d(adapter, case, inp, device, checks, kw, x, w, y)
    except Exception as e:  # noqa: BLE001
        return results + _fill(checks, "backward", "error", _error_text(e), kw)
