"""Backends on the CPU: selection and errors, the cuda and rocm call plans on faked platforms,
the on-device group padding and the tail-row zeroing.

``torch._scaled_grouped_mm`` has no CPU kernel, so the faked platforms replace it with a stand-in
that enforces the documented contract (operand dtypes and layouts, scale shapes, 16-row groups in
the 2D x 2D form, bf16 output), computes with the emulated reference and, like the real op,
leaves the rows past ``offs[-1]`` unwritten (NaN here).
"""

from __future__ import annotations

import types

import pytest
import torch

from moe_fp8 import fp8_grouped_mm
from moe_fp8.grouped_gemm import available_backends, select_backend
from moe_fp8.grouped_gemm.backends.cuda import CudaBackend
from moe_fp8.grouped_gemm.backends.cuda_auto import CudaAutoBackend
from moe_fp8.grouped_gemm.emulated import emulated_grouped_mm_2d2d, emulated_grouped_mm_2d3d
from moe_fp8.grouped_gemm.padding import padded_offsets, padded_row_index, padded_rows
from moe_fp8.grouped_gemm.quant_seam import quantize_wgrad_operands, wgrad_operand_layout
from moe_fp8.grouped_gemm.tail import launch_zero_rows_kernel, zero_rows_past_end
from moe_fp8.quant import E4M3FN
from moe_fp8.quant.reference import quantize_tensorwise
from moe_fp8.testing import OFFSET_KINDS, group_sizes, random_offsets

needs_interpreter = pytest.mark.interpreter  # skipped by tests/conftest.py unless TRITON_INTERPRET=1


def inputs(M=96, K=64, N=32, E=4, used=90, kind="skewed", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(E, N, K, generator=gen) * 0.05).to(torch.bfloat16).requires_grad_()
    g = torch.randn(M, N, generator=gen).to(torch.bfloat16)
    return x, w, g, random_offsets(used, E, kind, generator=gen)


def fwd_bwd(x, w, g, offs, **kw):
    y = fp8_grouped_mm(x, w, offs, **kw)
    return (y, *torch.autograd.grad(y, (x, w), g))


def fake_scaled_grouped_mm(calls: list, fp8_dtype: torch.dtype):
    """A CPU stand-in for torch._scaled_grouped_mm that checks its contract (see module doc)."""

    def op(mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None,
           use_fast_accum=False):
        assert mat_a.dtype == fp8_dtype and mat_b.dtype == fp8_dtype, (mat_a.dtype, mat_b.dtype)
        assert mat_a.stride(-1) == 1, "Expected mat1 to not be transposed"
        assert mat_b.stride(-2) == 1, "Expected mat2 to be transposed"
        assert offs.dtype == torch.int32 and offs.dim() == 1
        assert scale_a.dtype == scale_b.dtype == torch.float32
        assert scale_a.is_contiguous() and scale_b.stride(-1) == 1
        assert out_dtype == torch.bfloat16 and bias is None and scale_result is None
        assert mat_a.shape[-1] % 16 == 0 and mat_b.shape[-2] % 16 == 0 and mat_b.shape[-1] % 16 == 0
        assert mat_a.stride(0) % 16 == 0, "strides should be multiple of 16 bytes"
        E = offs.numel()
        assert E < 1024
        if mat_b.dim() == 3:  # 2D x 3D
            M, (_, K, N) = mat_a.shape[0], mat_b.shape
            assert mat_b.shape[0] == E and scale_a.shape == (M,) and scale_b.shape == (E, N)
            out = emulated_grouped_mm_2d3d(mat_a, scale_a, mat_b.transpose(-2, -1), scale_b, offs)
            out[int(offs[-1]):] = float("nan")  # never written by the real kernel
        else:  # 2D x 2D: mat_a (N, rows) row-major, mat_b (rows, K) column-major
            N, rows, K = mat_a.shape[0], mat_a.shape[1], mat_b.shape[1]
            assert rows % 16 == 0 and mat_b.shape[0] == rows, "strides should be multiple of 16 bytes"
            assert torch.all(group_sizes(offs)[:-1] % 16 == 0), "device-side assert: groups must be 16-aligned"
            assert scale_a.shape == (E * N,) and scale_b.shape == (E * K,)
            out = emulated_grouped_mm_2d2d(mat_a.t(), scale_a.view(E, N), mat_b, scale_b.view(E, K), offs)
        calls.append(types.SimpleNamespace(a=mat_a, b=mat_b, scale_a=scale_a, scale_b=scale_b, offs=offs,
                                           fast_accum=use_fast_accum))
        return out

    return op


def close(a, b):
    torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-5)


# ----------------------------------------------------------------------------- faked CUDA (sm90)
@pytest.fixture
def fake_cuda(monkeypatch):
    calls: list = []
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(CudaBackend, "device_type", "cpu")  # let the plan run on CPU tensors
    monkeypatch.setattr(torch, "_scaled_grouped_mm", fake_scaled_grouped_mm(calls, torch.float8_e4m3fn), raising=False)
    return calls


@pytest.mark.parametrize("kind", OFFSET_KINDS)
def test_cuda_rowwise_plan(fake_cuda, kind):
    x, w, g, offs = inputs(kind=kind, seed=1)
    got = fwd_bwd(x, w, g, offs, recipe="rowwise", backend="cuda")
    want = fwd_bwd(x, w, g, offs, recipe="rowwise", backend="emulated")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # tail rows zeroed, not NaN
    close(got[2], want[2])  # wgrad summed over zero-padded groups
    fwd, dgrad, wgrad = fake_cuda
    assert fwd.b.shape == (4, 64, 32) and dgrad.b.shape == (4, 32, 64)  # (E, K_contract, N_out)
    assert all(c.fast_accum for c in fake_cuda)
    assert wgrad.a.shape[1] == padded_rows(96, 4) and torch.equal(wgrad.offs, padded_offsets(offs))


def test_cuda_tensorwise_plan(fake_cuda):
    x, w, g, offs = inputs(seed=2)
    got = fwd_bwd(x, w, g, offs, recipe="tensorwise", backend="cuda")
    want = fwd_bwd(x, w, g, offs, recipe="tensorwise", backend="emulated")
    for a, b in zip(got, want):
        close(a, b)
    fwd = fake_cuda[0]
    assert torch.all(fwd.scale_a == fwd.scale_a[0]) and torch.all(fwd.scale_b == fwd.scale_b[:, :1])
    assert len(fake_cuda) == 3


@needs_interpreter  # blockwise GEMMs run on the Triton kernel
@pytest.mark.parametrize("recipe", ["blockwise", "rowwise_gw_hp", "bf16"])
def test_cuda_other_recipes(fake_cuda, recipe):
    x, w, g, offs = inputs(K=160, seed=3)
    got = fwd_bwd(x, w, g, offs, recipe=recipe, backend="cuda")
    want = fwd_bwd(x, w, g, offs, recipe=recipe, backend="emulated")
    for a, b in zip(got, want):
        close(a, b)
    # blockwise runs on the Triton kernel; BF16 wgrad/GEMMs on torch._grouped_mm.
    assert len(fake_cuda) == {"blockwise": 0, "rowwise_gw_hp": 2, "bf16": 0}[recipe]


@needs_interpreter  # the small-group GEMMs run on the Triton kernel
@pytest.mark.parametrize("limit, on_triton", [(24, True), (23, False)])
def test_cuda_auto_picks_the_2d3d_kernel_by_rows_per_group(fake_cuda, monkeypatch, limit, on_triton):
    """96 rows over 4 experts average 24 rows per group: forward and dgrad run on Triton up to the
    limit, on ``torch._scaled_grouped_mm`` above it; wgrad always on the op. The outputs are those
    of the named backends bit for bit."""
    monkeypatch.setattr(CudaAutoBackend, "triton_max_rows_per_group", limit)
    x, w, g, offs = inputs(seed=5)
    got = fwd_bwd(x, w, g, offs, recipe="rowwise", backend="cuda_auto")
    auto_calls = list(fake_cuda)
    fake_cuda.clear()
    want = fwd_bwd(x, w, g, offs, recipe="rowwise", backend="hybrid" if on_triton else "cuda")
    assert [c.b.dim() for c in auto_calls] == ([2] if on_triton else [3, 3, 2])  # 2D x 3D, ..., wgrad
    assert [c.b.dim() for c in fake_cuda] == [c.b.dim() for c in auto_calls]
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@needs_interpreter
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "rowwise_gw_hp"])
@pytest.mark.parametrize("limit", [24, 23])
def test_cuda_auto_other_recipes_on_both_sides(fake_cuda, monkeypatch, recipe, limit):
    """Every FP8 recipe through either branch of the rule agrees with the emulated backend."""
    monkeypatch.setattr(CudaAutoBackend, "triton_max_rows_per_group", limit)
    x, w, g, offs = inputs(K=160, seed=6)
    got = fwd_bwd(x, w, g, offs, recipe=recipe, backend="cuda_auto")
    want = fwd_bwd(x, w, g, offs, recipe=recipe, backend="emulated")
    for a, b in zip(got, want):
        close(a, b)


@pytest.mark.parametrize("layer, tokens, top_k, experts, on_triton", [
    ("Llama 4", 8192, 1, 16, True),  # 512 rows per group: Triton 9% faster in the layer A/B
    ("DeepSeek-V3 E=32", 4096, 8, 32, True),  # 1024: 2-4% faster
    ("DeepSeek-V3 E=32", 8192, 8, 32, False),  # 2048: 2.6% slower
    ("DeepSeek-V3 E=8", 4096, 8, 8, False),  # 4096: even
])
def test_cuda_auto_rule_on_the_measured_layers(layer, tokens, top_k, experts, on_triton):
    """The layer A/B behind ``triton_max_rows_per_group`` (cuda_auto.py): each measured layer
    shape takes the kernel that won there (wrong if the threshold moves past a measurement)."""
    assert CudaAutoBackend().triton_2d3d(tokens * top_k, experts) is on_triton


def test_cuda_group_limit(fake_cuda):
    x = torch.randn(16, 16, dtype=torch.bfloat16)
    w = torch.randn(1024, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="1023"):
        fp8_grouped_mm(x, w, torch.full((1024,), 16, dtype=torch.int32), backend="cuda")
    assert not fake_cuda


def test_cuda_rejects_other_formats(fake_cuda, monkeypatch):
    monkeypatch.setenv("MOE_FP8_FORMAT", "e4m3fnuz")
    x, w, _, offs = inputs()
    with pytest.raises(ValueError, match="e4m3fn"):
        fp8_grouped_mm(x, w, offs, backend="cuda")


def test_cuda_rejects_other_out_dtypes(fake_cuda):
    x, w, _, offs = inputs()
    with pytest.raises(TypeError, match="out_dtype"):
        fp8_grouped_mm(x, w, offs, backend="cuda", out_dtype=torch.float32)
    with pytest.raises(TypeError, match="x"):
        fp8_grouped_mm(x.float(), w.float(), offs, backend="cuda")


# ----------------------------------------------------------------------------- faked ROCm
def fake_rocm(monkeypatch, arch: str, fp8_dtype: torch.dtype, build="USE_ROCM=ON, USE_MSLK=ON"):
    calls: list = []
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    props = types.SimpleNamespace(gcnArchName=f"{arch}:sramecc+:xnack-")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props)
    monkeypatch.setattr(torch.__config__, "show", lambda: build)
    monkeypatch.setattr(CudaBackend, "device_type", "cpu")
    monkeypatch.setattr(torch, "_scaled_grouped_mm", fake_scaled_grouped_mm(calls, fp8_dtype), raising=False)
    return calls


@pytest.mark.parametrize("arch, usable", [("gfx942", True), ("gfx950", False)])
def test_rocm_fbgemm_genai_builds_serve_gfx942_only(monkeypatch, arch, usable):
    """torch 2.9 / 2.10 ROCm builds (FBGEMM-GenAI, no MSLK) have the grouped GEMM for gfx942 only:
    on gfx950 the automatic choice falls back to triton, and asking for rocm says why."""
    fake_rocm(monkeypatch, arch, torch.float8_e4m3fnuz, build="USE_ROCM=ON, USE_FBGEMM_GENAI=ON")
    monkeypatch.setattr(CudaBackend, "device_type", "cuda")
    if usable:
        assert select_backend(None, "cuda:0").name == "rocm" and select_backend("rocm", "cuda:0").name == "rocm"
    else:
        assert select_backend(None, "cuda:0").name == "triton"
        with pytest.raises(ValueError, match="gfx950 needs a PyTorch build with USE_MSLK"):
            select_backend("rocm", "cuda:0")


@needs_interpreter  # the wgrad runs on the Triton kernel
@pytest.mark.parametrize("arch, fmt", [("gfx942", "e4m3fnuz"), ("gfx950", "e4m3fn")])
def test_rocm_plan(monkeypatch, arch, fmt):
    if fmt == "e4m3fnuz":
        import triton

        if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 8):
            pytest.skip("fnuz Triton types fail in the interpreter below triton 3.8")
    calls = fake_rocm(monkeypatch, arch, getattr(torch, f"float8_{fmt}"))
    x, w, g, offs = inputs(seed=4)
    got = fwd_bwd(x, w, g, offs, recipe="rowwise", backend="rocm")
    assert len(calls) == 2 and all(c.b.dim() == 3 for c in calls)  # fwd, dgrad; wgrad on Triton
    assert not any(c.fast_accum for c in calls)
    fp8_max = 240.0 if fmt == "e4m3fnuz" else 448.0
    assert calls[0].a.float().abs().max() == fp8_max  # scales computed for this format's max
    monkeypatch.setenv("MOE_FP8_FORMAT", fmt)
    want = fwd_bwd(x, w, g, offs, recipe="rowwise", backend="emulated")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    close(got[2], want[2])


def test_rocm_bf16_grouped_mm_warns_about_the_host_loop(monkeypatch):
    """Once per process, on ROCm GPUs only, unless ROCM_ALLOW_GROUP_GEMM_CK asks for PyTorch's CK kernel."""
    import warnings

    import moe_fp8.grouped_gemm.backends.base as base

    gpu = torch.device("cuda", 0)
    base._warn_once.cache_clear()
    monkeypatch.delenv("ROCM_ALLOW_GROUP_GEMM_CK", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monkeypatch.setattr(torch.version, "hip", None)
        base.warn_rocm_bf16_host_loop(gpu)  # CUDA
        monkeypatch.setattr(torch.version, "hip", "6.4.0")
        base.warn_rocm_bf16_host_loop(torch.device("cpu"))
        monkeypatch.setenv("ROCM_ALLOW_GROUP_GEMM_CK", "1")
        base.warn_rocm_bf16_host_loop(gpu)
    monkeypatch.delenv("ROCM_ALLOW_GROUP_GEMM_CK")
    with pytest.warns(UserWarning, match="ROCM_ALLOW_GROUP_GEMM_CK=1"):
        base.warn_rocm_bf16_host_loop(gpu)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        base.warn_rocm_bf16_host_loop(gpu)  # once
    base._warn_once.cache_clear()


def test_rocm_unsupported_arch_falls_back_to_triton(monkeypatch):
    fake_rocm(monkeypatch, "gfx90a", torch.float8_e4m3fnuz)
    x, w, _, offs = inputs()
    with pytest.raises(ValueError, match="gfx90a"):
        fp8_grouped_mm(x, w, offs, backend="rocm")
    monkeypatch.setattr(CudaBackend, "device_type", "cuda")
    assert select_backend(None, torch.device("cuda", 0)).name == "triton"


def test_rocm_needs_ck_build(monkeypatch):
    fake_rocm(monkeypatch, "gfx942", torch.float8_e4m3fnuz, build="USE_ROCM=ON")
    x, w, _, offs = inputs()
    with pytest.raises(ValueError, match="USE_MSLK"):
        fp8_grouped_mm(x, w, offs, backend="rocm")


def test_rocm_rejects_wrong_format_override(monkeypatch):
    fake_rocm(monkeypatch, "gfx942", torch.float8_e4m3fnuz)
    monkeypatch.setenv("MOE_FP8_FORMAT", "e4m3fn")
    x, w, _, offs = inputs()
    with pytest.raises(ValueError, match="e4m3fnuz"):
        fp8_grouped_mm(x, w, offs, backend="rocm")


def test_auto_selection_on_gpus(monkeypatch):
    fake_rocm(monkeypatch, "gfx942", torch.float8_e4m3fnuz)
    monkeypatch.setattr(CudaBackend, "device_type", "cuda")
    assert select_backend(None, "cuda:0").name == "rocm"
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert select_backend(None, "cuda:0").name == "cuda_auto"
    assert select_backend("cuda", "cuda:0").name == "cuda"
    assert select_backend("hybrid", "cuda:0").name == "hybrid"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert select_backend(None, "cuda:0").name == "triton"
    for name in ("cuda", "cuda_auto", "hybrid"):
        with pytest.raises(ValueError, match="sm89"):
            select_backend(name, "cuda:0")


# ----------------------------------------------------------------------------- selection on CPU
def test_cpu_defaults_to_emulated(monkeypatch):
    monkeypatch.delenv("MOE_FP8_BACKEND", raising=False)
    assert select_backend(None, "cpu").name == "emulated"


@needs_interpreter
def test_environment_variable_and_argument(monkeypatch):
    monkeypatch.setenv("MOE_FP8_BACKEND", "triton")
    assert select_backend(None, "cpu").name == "triton"
    assert select_backend("emulated", "cpu").name == "emulated"
    assert available_backends("cpu") == ["triton", "emulated"]
    monkeypatch.setenv("MOE_FP8_BACKEND", "cutlass")
    with pytest.raises(ValueError, match="MOE_FP8_BACKEND"):
        select_backend(None, "cpu")


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_backend("triton", "cpu")


@pytest.mark.parametrize("name", ["cuda", "cuda_auto", "hybrid", "rocm"])
def test_gpu_backends_refuse_cpu_tensors(name):
    with pytest.raises(ValueError, match=name):
        select_backend(name, "cpu")


def test_backend_name_type():
    with pytest.raises(TypeError, match="backend"):
        select_backend(3, "cpu")


# ----------------------------------------------------------------------------- padding, tail
@pytest.mark.parametrize("kind", OFFSET_KINDS)
@pytest.mark.parametrize("M, used, E", [(100, 100, 5), (100, 77, 7), (16, 3, 1), (40, 0, 3)])
def test_padded_layout(kind, M, used, E):
    offs = random_offsets(used, E, kind, generator=torch.Generator().manual_seed(M + E))
    p_offs = padded_offsets(offs)
    sizes, p_sizes = group_sizes(offs), group_sizes(p_offs)
    assert p_offs.dtype == torch.int32
    assert torch.all(p_sizes % 16 == 0) and torch.all(p_sizes >= sizes) and torch.all(p_sizes < sizes + 16)
    dest = padded_row_index(offs, p_offs, M)
    rows = padded_rows(M, E)
    assert rows % 16 == 0 and int(dest.max()) < rows and dest.unique().numel() == M
    p_starts = torch.cat([torch.zeros(1, dtype=torch.int64), p_offs[:-1].long()])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), offs[:-1].long()])
    for gi in range(E):
        s, e = int(starts[gi]), int(offs[gi])
        assert torch.equal(dest[s:e], torch.arange(s, e) - s + p_starts[gi])
    assert torch.all(dest[used:] >= int(p_offs[-1]))  # tail rows land past every group


def _tensorwise_wgrad_operands(a, b, offs, fused, **padding):
    """The tensorwise wgrad operands as the op makes them: each tensor quantized (as the forward and
    the dgrad do), then laid out by ``wgrad_operand_layout``."""
    (qa, sa), (qb, sb) = quantize_tensorwise(a, E4M3FN), quantize_tensorwise(b, E4M3FN)
    return (wgrad_operand_layout(qa, offs, fused, **padding), sa, wgrad_operand_layout(qb, offs, fused, **padding), sb)


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=needs_interpreter)])
@pytest.mark.parametrize("scaling", ["rowwise", "tensorwise"])
def test_padded_wgrad_operands_match_unpadded(scaling, fused):
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(50, 32, generator=gen), torch.randn(50, 48, generator=gen)
    offs = torch.tensor([7, 7, 30, 45], dtype=torch.int32)
    p_offs, rows = padded_offsets(offs), padded_rows(50, 4)
    if scaling == "rowwise":
        qa, sa, qb, sb = quantize_wgrad_operands(a, b, offs, E4M3FN, False, False)  # the reference
        pa, psa, pb, psb = quantize_wgrad_operands(a, b, offs, E4M3FN, False, fused, padded_offs=p_offs,
                                                   padded_rows=rows)
    else:
        qa, sa, qb, sb = _tensorwise_wgrad_operands(a, b, offs, False)
        pa, psa, pb, psb = _tensorwise_wgrad_operands(a, b, offs, fused, padded_offs=p_offs, padded_rows=rows)
        fa, _, fb, _ = _tensorwise_wgrad_operands(a, b, offs, fused)  # unpadded through the kernel
        assert fa.stride() == (1, 50) and torch.equal(fa.view(torch.uint8), qa.view(torch.uint8))
        assert torch.equal(fb.view(torch.uint8), qb.view(torch.uint8))
    assert qa.stride() == (1, 50) and pa.stride() == (1, rows) and pb.stride() == (1, rows)
    assert torch.equal(sa, psa) and torch.equal(sb, psb)
    dest = padded_row_index(offs, p_offs, 50)
    assert torch.equal(pa.view(torch.uint8)[dest[:45]], qa.view(torch.uint8)[:45])
    assert torch.equal(pb.view(torch.uint8)[dest[:45]], qb.view(torch.uint8)[:45])
    padding = torch.ones(rows, dtype=torch.bool)
    padding[dest] = False  # rows of no source row: zero (tail rows land past every group: unspecified)
    assert torch.all(pa.float()[padding] == 0) and torch.all(pb.float()[padding] == 0)


def test_zero_rows_past_end_cpu():
    out = torch.randn(40, 24)
    zero_rows_past_end(out, torch.tensor([5, 33], dtype=torch.int32))
    assert torch.all(out[33:] == 0) and torch.all(out[:33] != 0)


@needs_interpreter
@pytest.mark.parametrize("end", [0, 31, 32, 70])
def test_zero_rows_kernel(end):
    out = torch.randn(70, 136, dtype=torch.bfloat16)  # two column blocks, a partial row block
    want = out.clone()
    want[end:] = 0
    launch_zero_rows_kernel(out, torch.tensor([0, end], dtype=torch.int32))
    assert torch.equal(out, want)
