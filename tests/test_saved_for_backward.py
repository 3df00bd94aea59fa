"""Compiled, the FP8 ops keep no FP8 copy of a weight from the forward to the backward.

A weight's dgrad layout depends on the weight alone, so torch.compile's partitioner (Inductor's
``min_cut_rematerialization_partition``) would compute it in the forward and keep it alive until the
backward: one byte per weight element, for every layer at once. The backward's quantization of
the weight is therefore made to depend on grad_out's scales (``quant.kernels.colwise.order_token``).
``saved_for_backward_probe.py`` traces the ops as a GPU runs them (Triton kernels, torch's analysis
of their writes built for sm_90) on meta tensors, in a process without the interpreter.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).resolve().parent / "saved_for_backward_probe.py"


@pytest.fixture(scope="module")
def saved() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROBE.parent.parent), env.get("PYTHONPATH", "")) if p)
    run = subprocess.run([sys.executable, str(PROBE)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report.pop("analysis fallbacks") == [], "torch could not analyse a kernel: the graphs are not a GPU's"
    return report


@pytest.mark.slow(20)
@pytest.mark.parametrize("case", ["fp8_linear", "fp8_grouped_mm"])
def test_no_fp8_weight_copy_is_saved(saved, case):
    tensors = saved[case]
    assert tensors, "the forward saved nothing: the probe traced no backward"
    assert not [t for t in tensors if "float8" in t[0]], f"{case} saves FP8 tensors for backward: {tensors}"
    weights = {"fp8_linear": ([1, 128, 64], [1, 64, 128]), "fp8_grouped_mm": ([4, 128, 64],)}[case]
    for shape in weights:  # the weight itself (a parameter: saving it costs nothing)
        assert ["torch.bfloat16", shape] in tensors, f"{case}: the weight {shape} is not among {tensors}"
