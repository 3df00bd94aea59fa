"""The grouped-GEMM harness (moe_fp8.testing): planted bugs fail it, correct kernels pass it,
kernel faults (exceptions, hangs, dead workers) become results, and the CLI runs end to end.

The Triton backend's full quick battery runs once, through the CLI test (interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moe_fp8.quant import E4M3FN
from moe_fp8.quant.reference import quantize_rowwise
from moe_fp8.testing import (
    CHECKS,
    GroupedMMAdapter,
    assert_case,
    check_grouped_mm,
    get_adapter,
    grouped_mm_cases,
    run_case,
)
from moe_fp8.testing.isolation import CaseWorker, run_with_watchdog

REPO = Path(__file__).resolve().parents[1]
QUICK_2D3D = grouped_mm_cases(quick=True, forms=("2d3d",))
GARBAGE = 1e30


def _bounds(offs: torch.Tensor, rows: int, read_past_end: bool) -> list[tuple[int, int]]:
    ends = offs.tolist()
    if read_past_end and ends:
        ends[-1] = rows
    return list(zip([0] + ends[:-1], ends))


def loop_grouped_mm(x, w, offs, *, skip_last=False, read_past_end=False):
    """Differentiable per-group ``x_g @ w_g.T`` in fp32, zero tail rows; the flags plant bugs:
    ``skip_last`` ignores the last group, ``read_past_end`` takes rows past ``offs[-1]`` into it."""
    out = x.new_zeros(x.shape[0], w.shape[1]) + x[:0].sum() + w[:0].sum()  # in the graph even with no rows
    bounds = _bounds(offs, x.shape[0], read_past_end)
    last = len(bounds) - 1
    for g, (s, e) in enumerate(bounds):
        if e > s and not (skip_last and g == last):
            out[s:e] = (x[s:e].float() @ w[g].float().T).to(x.dtype)
    return out


class _GarbageEmptyGrads(torch.autograd.Function):
    """Correct forward and dx; dw of empty groups left 'uninitialised' (filled with garbage)."""

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        return loop_grouped_mm(x, w, offs)

    @staticmethod
    def backward(ctx, g):
        x, w, offs = ctx.saved_tensors
        dx, dw = torch.zeros_like(x), torch.full_like(w, GARBAGE)
        for e, (s, t) in enumerate(_bounds(offs, x.shape[0], False)):
            dx[s:t] = (g[s:t].float() @ w[e].float()).to(x.dtype)
            if t > s:
                dw[e] = (g[s:t].float().T @ x[s:t].float()).to(w.dtype)
        return dx, dw, None


def garbage_empty_grads(x, w, offs):
    return _GarbageEmptyGrads.apply(x, w, offs)


def wrong_scale_axis(x, w, offs):
    """FP8 rowwise forward whose weight scales are computed per (expert, k) but applied per (expert, n)."""
    xq, xs = quantize_rowwise(x, E4M3FN)
    s_k = (w.abs().amax(dim=1).float() / E4M3FN.max).clamp_min(1e-12)  # (E, K): amax over N
    wq = (w.float() / s_k[:, None, :]).clamp(-E4M3FN.max, E4M3FN.max).to(E4M3FN.torch_dtype)
    n_idx = torch.arange(w.shape[1]) % w.shape[2]
    out = torch.zeros(x.shape[0], w.shape[1])
    for g, (s, e) in enumerate(_bounds(offs, x.shape[0], False)):
        acc = xq[s:e].float() @ wq[g].float().T
        out[s:e] = acc * xs[s:e, None] * s_k[g, n_idx][None, :]  # bug: s_k indexed by n
    return out.to(torch.bfloat16)


def _statuses(results):
    return {(r.case, r.check): r.status for r in results}


def test_correct_loop_passes_every_case():
    results = check_grouped_mm(loop_grouped_mm, recipe="bf16", verbose=False)
    assert results and all(r.ok for r in results), [r for r in results if not r.ok]
    twod3d = [r for r in results if r.case.startswith("2d3d")]
    assert all(r.status == "pass" for r in twod3d)
    assert {r.check for r in twod3d} == {"out", "out_tail", "dx", "dx_tail", "dw", "dw_empty"}
    assert all(r.status == "skip" for r in results if r.case.startswith("2d2d"))  # no 2d2d form given


@pytest.mark.parametrize(
    "fn, recipe, must_fail",
    [
        (lambda x, w, o: loop_grouped_mm(x, w, o, skip_last=True), "bf16", {("2d3d-empty_first", "out")}),
        (lambda x, w, o: loop_grouped_mm(x, w, o, read_past_end=True), "bf16",
         {("2d3d-balanced", "out_tail"), ("2d3d-balanced", "dw"), ("2d3d-tail_nan", "dw")}),
        (garbage_empty_grads, "bf16", {("2d3d-empty_first", "dw_empty"), ("2d3d-m0", "dw_empty")}),
        (wrong_scale_axis, "rowwise", {("2d3d-balanced", "out"), ("2d3d-skewed", "out")}),
    ],
    ids=["ignores_last_group", "reads_past_offs_end", "garbage_empty_group_grads", "wrong_scale_axis"],
)
def test_planted_bug_fails(fn, recipe, must_fail):
    adapter = GroupedMMAdapter("planted", recipe, fn, differentiable=recipe == "bf16")
    got = _statuses(check_grouped_mm(adapter, forms=("2d3d",), verbose=False))
    assert {k: got.get(k) for k in must_fail} == dict.fromkeys(must_fail, "fail")


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise", "blockwise", "bf16"])
def test_emulated_backend_passes_every_case(recipe):
    results = check_grouped_mm(f"moe_fp8:emulated:{recipe}", forms=("2d3d",), verbose=False)
    assert all(r.status == "pass" for r in results), [r for r in results if r.status != "pass"]


def test_torch_grouped_mm_passes_both_forms():
    results = check_grouped_mm("torch", verbose=False)
    assert all(r.status == "pass" for r in results), [r for r in results if r.status != "pass"]
    assert {r.check for r in results} == {"out", "out_empty", "dx", "dw", "dw_empty"}  # tail rows undefined


@pytest.mark.parametrize("case", QUICK_2D3D[:4], ids=str)
def test_assert_case_parametrizes_a_suite(case):
    assert all(r.status == "pass" for r in assert_case(loop_grouped_mm, case, recipe="bf16"))


def test_assert_case_raises_on_a_failure_and_skips_unsupported():
    case = next(c for c in QUICK_2D3D if c.name == "empty_first")
    with pytest.raises(AssertionError, match="dw_empty"):
        assert_case(garbage_empty_grads, case)
    bf16_only = GroupedMMAdapter("bf16 only", "bf16", loop_grouped_mm, dtypes=(torch.bfloat16,))
    with pytest.raises(pytest.skip.Exception, match="takes bfloat16"):
        assert_case(bf16_only, next(c for c in QUICK_2D3D if c.name == "fp32"))


def test_exceptions_and_bad_shapes_are_errors_not_crashes():
    def raises(x, w, offs):
        raise RuntimeError("CUDA error: device-side assert triggered")

    def wrong_shape(x, w, offs):
        return x[:, :1]

    case = QUICK_2D3D[0]
    for fn, text in ((raises, "device-side assert"), (wrong_shape, "expected shape")):
        results = run_case(GroupedMMAdapter("bad", "bf16", fn), case)
        assert {r.status for r in results} == {"error"} and text in results[0].detail
        assert {r.check for r in results} == {"out", "out_tail", "dx", "dx_tail", "dw"}


def test_watchdog_reports_a_hang():
    def hangs(x, w, offs):
        time.sleep(30)

    t0 = time.perf_counter()
    results = run_with_watchdog(GroupedMMAdapter("hangs", "bf16", hangs), QUICK_2D3D[0], "cpu", timeout=0.5)
    assert time.perf_counter() - t0 < 5
    assert {r.status for r in results} == {"error"} and "hang" in results[0].detail


def exits_on_a_leading_empty_group(x, w, offs):
    """Kills its process (as a device-side assert kills a CUDA context) when group 0 is empty."""
    if int(offs[0]) == 0:
        os._exit(3)
    return loop_grouped_mm(x, w, offs)


@pytest.mark.slow(9)
def test_worker_survives_a_dead_process_and_goes_on():
    empty_first, balanced = (next(c for c in QUICK_2D3D if c.name == n) for n in ("empty_first", "balanced"))
    adapter = GroupedMMAdapter("exits", "bf16", exits_on_a_leading_empty_group)
    with CaseWorker(adapter, "cpu", timeout=120) as worker:
        died = worker.run(empty_first)
        after = worker.run(balanced)  # a fresh worker
    assert died and all(r.status == "error" and "exit code 3" in r.detail for r in died)
    assert after and all(r.status == "pass" for r in after)


def test_worker_reports_an_unpicklable_adapter():
    with CaseWorker(GroupedMMAdapter("lambda", "bf16", lambda x, w, o: x), "cpu", timeout=60) as worker:
        results = worker.run(QUICK_2D3D[0])
    assert results and all(r.status == "error" and "cannot send" in r.detail for r in results)


def test_get_adapter_rejects_bad_specs():
    for spec, match in (("moe_fp8:nope", "backend"), ("moe_fp8:emulated:fp4", "recipe"), ("cutlass", "impl")):
        with pytest.raises(ValueError, match=match):
            get_adapter(spec)
    with pytest.raises(ValueError, match="recipe"):
        GroupedMMAdapter("x", "fp4", loop_grouped_mm)


def test_cases_are_tiny_and_cover_the_hazards():
    cases = grouped_mm_cases(quick=True)
    assert all(c.rows <= 256 and c.k in (16, 32, 48) and c.n in (16, 32, 48) and c.num_groups <= 8 for c in cases)
    names = {c.name for c in cases}
    assert {"empty_first", "empty_last", "all_empty", "one_group", "m0", "dirichlet", "skewed", "sizes_not_16",
            "tail_nan", "tail_huge", "huge", "tiny", "strided", "fp16", "fp32", "k16_n16"} <= names
    assert grouped_mm_cases() == cases  # deterministic
    with pytest.raises(ValueError, match="forms"):
        grouped_mm_cases(forms=("3d3d",))


@pytest.mark.slow(27)
@pytest.mark.interpreter
def test_cli_quick_cpu(tmp_path):
    """The CLI on the Triton backend (interpreter; the emulated one runs in-process above): every
    check of the quick battery passes or is skipped."""
    out = tmp_path / "h.json"
    cmd = [sys.executable, "-m", "moe_fp8.testing", "--impl", "moe_fp8:triton", "--quick", "--device", "cpu",
           "--json", str(out), "--markdown", str(tmp_path / "h.md")]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc["runs"]) == {"moe_fp8:triton:rowwise"} and doc["env"]["device"] == "CPU"
    for name, rows in doc["runs"].items():
        assert rows and {r["status"] for r in rows} <= {"pass", "skip"}, name
        assert {r["check"] for r in rows} <= set(CHECKS)
        assert doc["summary"][name]["pass"] > 100
    assert "| 2d3d-empty_first |" in (tmp_path / "h.md").read_text()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda_auto", "cuda", "hybrid", "triton"])
def test_gpu_backends_pass_the_quick_battery(backend):
    results = check_grouped_mm(f"moe_fp8:{backend}:rowwise", device="cuda", quick=True, timeout=120, isolate=False,
                               verbose=False)  # in this process: a device-side assert fails the session anyway
    assert all(r.ok for r in results), [r for r in results if not r.ok]
    assert sum(r.status == "pass" for r in results) > 90
