"""The benchmark scripts still run: their CPU smoke modes end to end, the GPU-only ones compile.

GPU time is scarce; a benchmark that dies of a typo wastes a run. The smoke modes use tiny shapes
and wall-clock timing on the CPU (Triton kernels in the interpreter), so they check the scripts'
code paths, not any number.
"""

import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_compiles(script):
    py_compile.compile(str(script), doraise=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("script, extra, outputs", [
    ("bench_grouped_gemm.py", [], ["grouped_gemm.json", "grouped_gemm.md"]),
    ("bench_grouped_gemm.py", ["--rounds", "2", "--methods", "rowwise / emulated"], ["grouped_gemm.json"]),
    ("bench_moe_layer.py", [], ["moe_layer.json", "moe_layer.md"]),
    ("bench_quant.py", ["--sweep"], ["quant.json", "quant.md"]),
    ("ab_layer_backends.py", [], ["ab_layer_backends.json", "ab_layer_backends.md"]),
    ("ab_layer_backends.py", ["--uncached"], ["ab_layer_backends.md"]),
    ("ab_triton_wgrad_padding.py", [], ["ab_triton_wgrad_padding.json", "ab_triton_wgrad_padding.md"]),
    ("ab_padded_rows.py", [], ["ab_padded_rows.json", "ab_padded_rows.md"]),
    ("sm90_resources.py", [], [f"sm90_resources_triton{triton.__version__}.md"]),
    ("sweep_colwise_lag.py", ["--kinds", "dgrad"], ["colwise_lag.json", "colwise_lag.md"]),
])
def test_benchmark_smoke(script, extra, outputs, tmp_path):
    # ROOT first, then the caller's path (a torch/triton pair run from side folders stays the one tested)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", *extra, "--out", str(tmp_path)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for name in outputs:
        assert (tmp_path / name).stat().st_size > 0


@pytest.fixture
def bench_quant(monkeypatch):
    """``benchmarks/bench_quant.py`` imported, its kernels on the CPU (the interpreter)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_quant

    monkeypatch.setattr(bench_quant, "DEVICE", "cpu")
    return bench_quant


@pytest.mark.interpreter
def test_bench_quant_reports_each_model_as_it_ends(bench_quant, monkeypatch):
    """``bench_quant.run`` hands the table to its callback after every model (``main`` writes the
    files then), so a run stopped by a time limit keeps the models it finished."""
    two = {"one": bench_quant.SMOKE_MODELS["smoke"], "two": bench_quant.SMOKE_MODELS["smoke"]}
    monkeypatch.setattr(bench_quant, "SMOKE_MODELS", two)
    seen = []
    bench_quant.run(["one", "two"], False, 0.0, None,
                    on_model_done=lambda table, sweeps: seen.append(sorted({r["model"] for r in table.rows})))
    assert seen == [["one"], ["one", "two"]]


@pytest.mark.interpreter
def test_bench_quant_kernel_filter(bench_quant):
    """``--kernels`` times only the rows whose kernel name contains one of its substrings."""
    table, _ = bench_quant.run(["smoke"], False, 0.0, None, kernels=["padded", "tensorwise"])
    kernels = {r["kernel"] for r in table.rows}
    assert kernels == {"tensorwise (A)", "group colwise dual, padded out", "group dual, a from amax, padded",
                       "group dual, both from amax, padded"}
