"""Compiled, the FP8 ops keep no FP8 copy of a weight from the forward to the backward.

A weight's dgrad layout depends on the weight alone, so torch.compile's partitioner (Inductor's
``min_cut_rematerialization_partition``) would compute it in the forward and keep it alive until the
backward: one byte per weight element, for every layer at once. The backward's quantization of
the weight is therefore made to depend on grad_out's scales (``quant.kernels.colwise.order_token``).
``saved_for_backward_probe.py`` traces the ops as a GPU runs them (Triton kernels, torch's analysis
of their writes built for sm_90) on meta tensors, in a process without the interpreter. On the GPU,
Inductor's compiled stacks of FP8 layers are measured against the same stacks in BF16.
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
@pytest.mark.parametrize("case", ["fp8_linear", "fp8_linear cached", "fp8_grouped_mm", "fp8_moe cached",
                                  "fp8_moe uncached"])
def test_no_fp8_weight_copy_is_saved(saved, case):
    tensors = saved[case]
    assert tensors, "the forward saved nothing: the probe traced no backward"
    assert not [t for t in tensors if "float8" in t[0]], f"{case} saves FP8 tensors for backward: {tensors}"
    moe = ([4, 128, 64], [4, 64, 64])  # gate_up and down
    weights = {"fp8_linear": ([1, 128, 64], [1, 64, 128]), "fp8_linear cached": ([128, 64], [64, 128]),
               "fp8_grouped_mm": ([4, 128, 64],),
               "fp8_moe cached": moe, "fp8_moe uncached": moe}[case]
    for shape in weights:  # the weight itself (a parameter: saving it costs nothing)
        assert ["torch.bfloat16", shape] in tensors, f"{case}: the weight {shape} is not among {tensors}"


@pytest.mark.slow(20)
@pytest.mark.parametrize("case", ["fp8_linear stack", "fp8_moe stack"])
def test_no_buffer_is_written_by_two_launches(saved, case):
    """Each tensor a compiled launch writes is allocated for that launch alone. Factory calls of one
    shape that the graph's common-subexpression pass merges (``empty_strided``, ``zeros``, ``full``)
    would hand one buffer to several launches, and Inductor would copy it before each write."""
    assert saved["written twice"][case] == []


def _compiled_peak(fn, x, weights, extra=()) -> int:
    """Bytes allocated above the inputs at the peak of a compiled forward + backward (after a warm-up)."""
    import torch

    compiled = torch.compile(fn, fullgraph=True)
    for _ in range(2):  # the first call compiles
        for w in weights:
            w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        compiled(x, *extra, *weights).float().sum().backward()
        torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["fp8_linear", "fp8_grouped_mm"])
def test_compiled_peak_holds_no_fp8_weight_copies_gpu(case):
    """Inductor on the GPU: a stack of 8 FP8 layers with few tokens peaks at most half the weights' FP8
    bytes above the same stack in BF16 (their FP8 copies kept from forward to backward would add all
    of them; one layer's quantized weight at a time is an eighth)."""
    import torch
    import torch.nn.functional as F

    from moe_fp8 import fp8_grouped_mm
    from moe_fp8.layers.fp8_linear import fp8_linear

    torch._dynamo.reset()
    torch.manual_seed(0)
    layers, dev = 8, "cuda"
    if case == "fp8_linear":
        weights = [(torch.randn(4096, 4096, device=dev) * 4096**-0.5).bfloat16().requires_grad_() for _ in range(layers)]
        x, extra = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True), ()

        def stack(recipe):
            def run(x, *ws):
                for w in ws:
                    x = F.linear(x, w) if recipe == "bf16" else fp8_linear(x, w, recipe=recipe)
                return x
            return run
    else:
        weights = [(torch.randn(8, 1024, 1024, device=dev) * 1024**-0.5).bfloat16().requires_grad_()
                   for _ in range(layers)]
        x = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
        extra = (torch.arange(1, 9, device=dev, dtype=torch.int32) * 32,)

        def stack(recipe):
            def run(x, offs, *ws):
                for w in ws:
                    x = fp8_grouped_mm(x, w, offs, recipe=recipe)
                return x
            return run
    fp8_bytes = sum(w.numel() for w in weights)  # one byte per weight element
    bf16_peak = _compiled_peak(stack("bf16"), x, weights, extra)
    torch._dynamo.reset()
    fp8_peak = _compiled_peak(stack("rowwise"), x, weights, extra)
    assert fp8_peak - bf16_peak < fp8_bytes / 2, (
        f"{case}: compiled peak {fp8_peak / 2**20:.0f} MiB against BF16's {bf16_peak / 2**20:.0f} MiB "
        f"(the weights' FP8 bytes: {fp8_bytes / 2**20:.0f} MiB)")


@pytest.mark.slow(20)
def test_compiled_llama_decoder_saves_what_hf_saves(saved):
    """A Llama3-8B-sized decoder layer converted by ``hf.convert``'s defaults: its compiled forward keeps
    the buffers HF's own keeps (no FP8 copy, no second copy of an input its FP8 and BF16 linears
    share), plus the FP8 linears' small amaxes."""
    if "llama decoder" not in saved:
        pytest.skip("transformers is not installed")
    r = saved["llama decoder"]
    assert r["ours_fp8"] == [], f"FP8 tensors saved for backward: {r['ours_fp8']}"
    assert r["hf_bytes"] > 2**30  # the layer's activations at 8 x 1024 tokens: the probe traced a backward
    assert 0 <= r["ours_bytes"] - r["hf_bytes"] <= 2**20, (
        f"converted saves {r['ours_bytes'] / 2**20:.1f} MiB against HF's {r['hf_bytes'] / 2**20:.1f} MiB")
